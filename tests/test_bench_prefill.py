"""bench/bench_prefill.py's pure parts: flops, bytes, roofline, scenarios, checked windows.

The formulas are checked against brute-force counts so they can fail; the checked-window oracle
runs once on the kernel's output (interpreter on the CPU, or the GPU) and once on a corrupted one.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from portattn.kernels.paged_attention import paged_attention

_BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(_BENCH))  # bench_prefill imports _common and bench_paged from there
_SPEC = importlib.util.spec_from_file_location("bench_prefill", _BENCH / "bench_prefill.py")
bp = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bp)
from bench_paged import make_inputs  # noqa: E402

# (seq_len, q_len): chunked prefill, pure prefill, decode, a 2-token chunk, a 1-token decode
TINY = ((7, 3), (5, 5), (9, 1), (4, 2), (1, 1))


def brute_pairs(seq_len: int, q_len: int) -> int:
    """Count (query j, key p) with p < seq_len - q_len + j + 1, one by one."""
    return sum(1 for j in range(q_len) for p in range(seq_len) if p < seq_len - q_len + j + 1)


def test_causal_pairs_and_prefill_flops_match_a_brute_force_count():
    for s, q in TINY + ((4096, 512), (4096, 4096), (300, 299)):
        assert bp.causal_pairs(s, q) == brute_pairs(s, q), (s, q)
    # (7,3): 5+6+7, (5,5): 1+..+5, (4,2): 3+4; the decodes are not prefill
    assert sum(brute_pairs(s, q) for s, q in TINY if q > 1) == 18 + 15 + 7
    assert bp.prefill_flops(TINY, num_q_heads=3, head_dim=8) == 4 * 3 * 8 * 40
    # the default shape: 32 heads x 128; 8 pure prefills of 4096 = 8 * 4096 * 4097 / 2 pairs
    assert bp.prefill_flops(bp.prefill(8, 4096)) == 4 * 32 * 128 * 8 * 4096 * 4097 // 2


def test_decode_bytes_count_kv_per_kv_head_plus_query_and_output():
    # decodes of TINY: (9,1) and (1,1): K+V of 10 tokens x 2 kv heads x 8 dims x 2 bytes, plus
    # query + output of 2 rows x 3 heads x 8 dims x 2 bytes
    got = bp.decode_bytes(TINY, 2, num_q_heads=3, num_kv_heads=2, head_dim=8)
    assert got == 2 * 10 * 2 * 8 * 2 + 2 * 2 * 3 * 8 * 2
    assert bp.decode_bytes(bp.prefill(8, 4096), 2) == 0
    mixed = bp.decode_bytes(bp.mixed(8, 512, 56, 4096), 2)
    assert mixed == 56 * (2 * 4096 * 8 * 128 * 2 + 2 * 32 * 128 * 2) == 940_441_600


def test_roofline_is_flops_time_plus_bytes_time():
    assert bp.roofline_us(750e12, 0, 750.0, 3000.0) == pytest.approx(1e6)
    assert bp.roofline_us(0, 3e12, 750.0, 3000.0) == pytest.approx(1e6)
    assert bp.roofline_us(75e9, 3e6, 750.0, 3000.0) == pytest.approx(100.0 + 1.0)


def test_scenarios_metadata():
    seqs = bp.POINTS["mixed 8x512 + 56x1 @4k"][0]
    q_lens, seq_lens, qsl = bp.metadata(seqs)
    assert q_lens == [512] * 8 + [1] * 56 and seq_lens == [4096] * 64
    assert qsl[-1] == 4152 and qsl[8] == 8 * 512 and qsl[9] == 8 * 512 + 1
    q_lens, seq_lens, qsl = bp.metadata(bp.POINTS["mixed 8x2048 + 56x1 @4k"][0])
    assert qsl[-1] == 8 * 2048 + 56 and seq_lens == [4096] * 64
    q_lens, seq_lens, qsl = bp.metadata(bp.POINTS["prefill 8x4096"][0])
    assert q_lens == seq_lens == [4096] * 8 and qsl == [4096 * i for i in range(9)]
    assert all(544 in bp.POINTS[n][1] and 16 in bp.POINTS[n][1] and 2048 in bp.POINTS[n][1]
               for n in bp.DEFAULT_POINTS)  # fmt: skip
    parts = {n for n in bp.POINTS if n.startswith("part:")}
    assert set(bp.POINTS) - set(bp.DEFAULT_POINTS) == parts


@pytest.mark.parametrize("block_size", [2, 3, 16])
def test_make_inputs_matches_the_metadata(block_size):
    q, k, v, table, seq_lens, qsl = make_inputs(TINY, block_size, torch.float32, device="cpu")
    q_lens, sl, qsl_ref = bp.metadata(TINY)
    assert qsl.tolist() == qsl_ref and seq_lens.tolist() == sl and q.shape[0] == qsl_ref[-1]
    used = [b for i, (s, _) in enumerate(TINY) for b in table[i, : -(-s // block_size)].tolist()]
    assert sorted(used) == list(range(k.shape[0]))  # every block once: a permutation
    assert k.shape[1] == block_size and bool(k.abs().sum() > 0)
    # shuffle=False: the same blocks in order, sequence after sequence
    _, _, _, ordered, *_ = make_inputs(TINY, block_size, torch.float32, device="cpu", shuffle=False)
    used = [b for i, (s, _) in enumerate(TINY) for b in ordered[i, : -(-s // block_size)].tolist()]
    assert used == list(range(k.shape[0]))


def test_check_windows_and_their_batch_keep_the_causal_limits():
    seqs = ((20, 12), (9, 1), (30, 30), (15, 6), (8, 1), (7, 1))
    windows = bp.check_windows(seqs, rows=4)
    # first prefill: first and last 4 rows; last prefill: last 4; first and last decode
    assert windows == [(0, 0, 4), (0, 8, 4), (3, 2, 4), (1, 0, 1), (5, 0, 1)]
    rows, idx, sub_sl, sub_qsl = bp.window_batch(seqs, windows)
    _, _, qsl = bp.metadata(seqs)
    owner = {r: i for i in range(len(seqs)) for r in range(qsl[i], qsl[i + 1])}
    assert idx == [0, 0, 3, 1, 5] and sub_qsl[-1] == len(rows) == 14
    for w, (i, a, width) in enumerate(windows):
        s, q = seqs[i]
        for t in range(width):
            row = rows[sub_qsl[w] + t]
            assert owner[row] == i
            j = row - qsl[i]  # the row's index in its sequence
            assert j == a + t
            assert sub_sl[w] - width + t + 1 == s - q + j + 1  # same keys seen
    # a window wider than its chunk is cut to it; a pure-decode batch has decode windows only
    assert bp.check_windows(((5, 3), (4, 1)), rows=128) == [(0, 0, 3), (1, 0, 1)]
    assert bp.check_windows(((5, 1),) * 3) == [(0, 0, 1), (2, 0, 1)]
    with pytest.raises(ValueError, match="window_batch: rows 2..5 outside sequence 0"):
        bp.window_batch(((5, 3),), [(0, 2, 3)])


def test_spreads_are_max_over_min_per_scenario_and_variant():
    rows = [
        dict(scenario="a", variant="policy", block_size=16, graph_us=100.0),
        dict(scenario="a", variant="policy", block_size=544, graph_us=110.0),
        dict(scenario="a", variant="gfx942 policy", block_size=16, graph_us=50.0),
        dict(scenario="a", variant="gfx942 policy", block_size=544, graph_us=50.0),
        dict(scenario="b", variant="policy", block_size=16, graph_us=7.0),  # alone: no spread
    ]
    got = bp.spreads(rows)
    assert [(s["scenario"], s["variant"], s["spread"]) for s in got] == [
        ("a", "policy", pytest.approx(1.1)),
        ("a", "gfx942 policy", 1.0),
    ]


def test_variants_are_call_keywords():
    var = bp.variants(["gfx942"])
    assert var["policy"] == {} and var["gfx942 policy"]["target"].arch == "gfx942"


def test_schedule_variants_set_real_switches():
    """Every upper-case key of a schedule variant is a switch of `portattn.policy.paged` (a typo
    would time the policy under another name)."""
    var = bp.variants([], schedules=True)
    assert {"overlap", "overlap+pingpong", "pingpong"} <= set(var)
    for name, extra in var.items():
        for key in (k for k in extra if k.isupper()):
            assert hasattr(bp.paged_policy, key), (name, key)


@pytest.mark.parametrize("variant", ["policy", "gfx942 policy"])
def test_oracle_passes_the_kernel_and_stops_a_corrupted_output(device, variant):
    """The bench's check on a small mixed batch (32/8 heads, d 128 as the bench) at block 3, for
    the live policy and the gfx942 policy forced (the bench's call); fp16 (the interpreter has no
    bf16)."""
    seqs = ((24, 20), (9, 1), (16, 16), (6, 1))
    args = make_inputs(seqs, 3, torch.float16, device=device)
    oracle = bp.Oracle(seqs, args, rows=8)
    assert len(oracle.rows) == 8 + 8 + 8 + 1 + 1
    extra = bp.variants(["gfx942"])[variant]
    out = paged_attention(*args, max_query_len=20, max_seq_len=24, **extra)
    ok, e = oracle.check(out)
    print(f"{variant}: kernel error {e:.3e}, torch fp16 error {oracle.e_torch:.3e}")
    assert ok, (e, oracle.e_torch)
    bad = out.clone()
    bad[int(oracle.rows[-9])] += 0.05  # one checked row of the last prefill window, a bit off
    assert not oracle.check(bad)[0]


def _on_the_interpreter(monkeypatch, tmp_path, graph):
    """`main` on one tiny point (two block sizes) with CPU inputs: eager timer 1 ms, graph timer
    ``graph``, ceilings 3000 GB/s and 750 TFLOP/s, the record in ``tmp_path``."""
    monkeypatch.setattr(bp, "make_inputs", lambda *a, **k: make_inputs(*a, **k, device="cpu"))
    monkeypatch.setattr(bp, "do_bench", lambda fn, return_mode: (fn(), 1.0)[1])
    monkeypatch.setattr(bp, "do_bench_cudagraph", graph)
    monkeypatch.setattr(bp, "copy_ceiling", lambda n: (3000.0, 0.1))
    monkeypatch.setattr(bp, "matmul_rate", lambda: (750.0, 1.0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bp, "POINTS", {"mixed 2x12 + 3x1 @20": (bp.mixed(2, 12, 3, 20), (3, 5))})
    monkeypatch.setattr(bp, "DEFAULT_POINTS", ("mixed 2x12 + 3x1 @20",))
    monkeypatch.setenv("OUT", str(tmp_path))


@pytest.mark.cpu
def test_main_runs_check_time_and_summary_on_the_interpreter(monkeypatch, tmp_path, capsys):
    """The whole flow of `main` on one tiny point: the interpreter's kernel, timers and ceilings
    stubbed (1 ms each, 3000 GB/s, 750 TFLOP/s), the JSON record written."""
    _on_the_interpreter(monkeypatch, tmp_path, lambda fn, return_mode: (fn(), 1.0)[1])
    assert bp.main(["--dtype", "fp16", "--check-rows", "4"]) == 0
    text = capsys.readouterr().out
    assert "== summary" in text and "max/min 1.000 (goal <= 1.05: met)" in text
    rec = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert [r["block_size"] for r in rec["rows"]] == [3, 5]
    flops = bp.prefill_flops(bp.mixed(2, 12, 3, 20))
    assert rec["rows"][0]["prefill_tflops"] == pytest.approx(flops / 1e-3 / 1e12)
    assert rec["rows"][0]["checked_rows"] == 4 + 4 + 4 + 1 + 1


@pytest.mark.cpu
def test_blocks_replace_every_points_block_sizes(monkeypatch, tmp_path, capsys):
    """``--blocks 4,7``: each point runs at those block sizes instead of its own (3, 5); bad
    values stop before anything runs, naming the option."""
    _on_the_interpreter(monkeypatch, tmp_path, lambda fn, return_mode: (fn(), 1.0)[1])
    assert bp.main(["--dtype", "fp16", "--check-rows", "4", "--blocks", "4,7"]) == 0
    rec = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert [r["block_size"] for r in rec["rows"]] == [4, 7]
    assert json.loads((tmp_path / "bench_prefill.json").read_text())["pages"] == "random"
    for bad in ("0", "16,x", "16,,32"):
        with pytest.raises(SystemExit, match="--blocks must be positive integers"):
            bp.main(["--blocks", bad])


@pytest.mark.cpu
def test_rounds_take_the_variants_in_turns_and_report_the_median(monkeypatch, tmp_path, capsys):
    """``--rounds 3``: each point's variants are timed in turns, A B (the check's round), then B
    A, A B (the order rotated each round), each with its switch set; a row's graph time is the
    median of its three rounds."""
    seen = []
    times = iter([5.0, 50.0, 1.0, 10.0, 3.0, 30.0] * 2)  # ms, per call in order

    def graph(fn, return_mode):
        fn()
        seen.append(bp.paged_policy.SM90_PREFILL_V_PAGES_MIN_BOXES == 2)
        return next(times)

    _on_the_interpreter(monkeypatch, tmp_path, graph)
    rates = iter([800.0, 500.0, 600.0, 800.0, 500.0, 600.0])  # TFLOP/s, before each round
    monkeypatch.setattr(bp, "matmul_rate", lambda: (next(rates, 750.0), 1.0))
    argv = ["--dtype", "fp16", "--check-rows", "4", "--schedules", "--variants",
            "policy,v pages 2+", "--rounds", "3"]  # fmt: skip
    assert bp.main(argv) == 0
    assert seen == [False, True, True, False, False, True] * 2  # at each of the two block sizes
    rec = json.loads((tmp_path / "bench_prefill.json").read_text())
    got = {(r["block_size"], r["variant"]): r["graph_us"] for r in rec["rows"]}
    # policy's rounds 5, 10, 3 ms; v pages 2+'s 50, 1, 30
    assert got == {(3, "policy"): 5000.0, (3, "v pages 2+"): 30000.0,
                   (5, "policy"): 5000.0, (5, "v pages 2+"): 30000.0}  # fmt: skip
    assert rec["rows"][0]["graph_rounds"] == [5000.0, 10000.0, 3000.0]
    # the run's ceiling (the first rate, 800) and the rounds' median (600) give two ratios
    seqs = bp.mixed(2, 12, 3, 20)
    flops, nbytes = bp.prefill_flops(seqs), bp.decode_bytes(seqs, 2)
    row = rec["rows"][0]
    assert rec["mm_tflops"] == 800.0 and row["mm_rounds"] == [500.0, 600.0, 800.0]
    assert row["x_roof"] == pytest.approx(5000.0 / bp.roofline_us(flops, nbytes, 800.0, 3000.0))
    assert row["x_roof_turns"] == pytest.approx(
        5000.0 / bp.roofline_us(flops, nbytes, 600.0, 3000.0)
    )
    assert "median of 3 rounds" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--rounds must be >= 1; got 0"):
        bp.main(["--rounds", "0"])


def test_against_policy_divides_by_the_policy_at_the_same_point():
    """Each variant's graph time over the policy's at its scenario and block size; the policy
    itself and points without a policy row are left out."""
    rows = [dict(scenario="a", block_size=16, variant="policy", graph_us=100.0),
            dict(scenario="a", block_size=16, variant="k first", graph_us=95.0),
            dict(scenario="a", block_size=16, variant="policy again", graph_us=101.0),
            dict(scenario="a", block_size=2048, variant="policy", graph_us=50.0),
            dict(scenario="a", block_size=2048, variant="k first", graph_us=60.0),
            dict(scenario="b", block_size=16, variant="k first", graph_us=7.0)]  # fmt: skip
    got = [(a["block_size"], a["variant"], a["ratio"]) for a in bp.against_policy(rows)]
    assert got == [(16, "k first", 0.95), (16, "policy again", 1.01), (2048, "k first", 1.2)]


def test_schedule_variants_hold_a_control():
    """``--schedules`` times the policy's own launch a second time ("policy again")."""
    assert bp.variants([], schedules=True)["policy again"] == {}
    assert "policy again" not in bp.variants([])
