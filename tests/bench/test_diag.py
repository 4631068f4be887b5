"""bench/diag's analyses on synthetic inputs (CPU): a device call costs minutes of a budget, so
what runs after the GPU work must not fail there, and must measure what it names."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from bench.diag import clock, ncu_stalls, trace_mla, trace_prefill

from tests.helpers import in_spawned_workers, target_compile

# -- ncu_stalls ------------------------------------------------------------------------------

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_barrier",
          "stall_long_sb", "stall_barrier (Not Issued)"]  # fmt: skip


def test_ncu_stretches_and_reasons(tmp_path: Path, capsys):
    rows = [
        ["0x0", "  IADD3 R1, R2, R3", "10", "0", "0", "0"],
        ["0x10", "  SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4]", "30", "0", "30", "0"],
        ["0x20", "  FMUL R4, R4, R5", "20", "0", "0", "0"],
        ["0x30", "  BAR.SYNC.DEFER_BLOCKING 0x0", "40", "40", "0", "40"],
        ["0x40", "  EXIT", "", "", "", ""],  # empty cells count as 0
    ]
    path = tmp_path / "s.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])  # ncu's first line names the kernel
        w.writerow(HEADER)
        w.writerows(rows)
    assert ncu_stalls.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("100 samples")
    assert "barrier             40.0%" in out and "long_sb             30.0%" in out
    assert "(Not Issued)" not in out  # the not-issued copies are not counted twice
    assert "    0-    1  40.0%  SYNCS.PHASECHK" in out  # stretches end at each sync point
    assert "    2-    3  60.0%  BAR.SYNC" in out


def test_ncu_waits_by_barrier_count_the_retry_branch(tmp_path: Path, capsys):
    """An mbarrier wait's samples sit on its try-wait and on the retry branch right after it;
    both count for the barrier's operand (over all its sites); a branch on the wait's success
    does not."""
    rows = [
        ["0x0", "  SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR14+0x38550], R206", "5", "0", "5", "0"],
        ["0x10", "@!P2  BRA 0x7f34177e1470", "40", "0", "40", "0"],
        ["0x20", "  WARPGROUP.DEPBAR.LE gsb0, 0x0", "25", "25", "0", "0"],
        ["0x30", "  SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR7+0x38530], R202", "0", "0", "0", "0"],
        ["0x40", "@P1  BRA 0x7f34177e1000", "10", "0", "0", "0"],  # taken when done: no retry
        ["0x50", "  FMUL R4, R4, R5", "10", "0", "0", "0"],
        ["0x60", "  SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR14+0x38550], R206", "0", "0", "0", "0"],
        ["0x70", "@!P2  BRA 0x7f34177e1470", "10", "0", "10", "0"],
    ]
    path = tmp_path / "s.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        w.writerows(rows)
    assert ncu_stalls.main([str(path)]) == 0
    out = capsys.readouterr().out
    waits = out[out.index("mbarrier waits") :].splitlines()
    assert waits[1].split() == ["[UR14+0x38550]", "2", "55.0%"]
    assert waits[2].split() == ["[UR7+0x38530]", "1", "0.0%"]
    assert waits[3] == "wgmma waits (WARPGROUP.DEPBAR): 25.0%"


@pytest.mark.parametrize("share", ["nan", "inf", "-1", "x"])
def test_ncu_refuses_a_share_that_would_hide_everything(share, tmp_path: Path, capsys):
    with pytest.raises(SystemExit):
        ncu_stalls.main([str(tmp_path / "s.csv"), "--min-share", share])
    assert "--min-share: must be a finite percent >= 0" in capsys.readouterr().err


def test_ncu_rejects_a_csv_without_samples(tmp_path: Path):
    path = tmp_path / "bad.csv"
    path.write_text("Address,Source\n0x0,EXIT\n")
    with pytest.raises(SystemExit, match="no 'Warp Stall Sampling"):
        ncu_stalls.main([str(path)])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "{path}: cannot read a CSV ([Errno 2]"),
        ("folder", "{path}: cannot read a CSV ([Errno 21]"),
        (b"\x7fELF\x02\x01\x01\x00\xd0\xff", "{path}: cannot read a CSV ("),
        ("Address,Warp Stall Sampling (All Samples)\n0x0,1\n",
         "{path}: line 1 has no 'Source' column"),
        ("Address,Source,Warp Stall Sampling (All Samples)\n0x0,EXIT,ten\n",
         "{path}: line 2, column 'Warp Stall Sampling (All Samples)': sample counts must be ints "
         ">= 0; got 'ten'"),
        ("Address,Source,Warp Stall Sampling (All Samples),stall_barrier\n0x0,EXIT,30,0\n"
         "0x10,BAR.SYNC,40,-20\n",
         "{path}: line 3, column 'stall_barrier': sample counts must be ints >= 0; got '-20'"),
        ("Address,Source,Warp Stall Sampling (All Samples)\n0x0,EXIT\n",
         "{path}: line 2 has 2 columns; the header has 3"),
    ],
)  # fmt: skip
def test_ncu_names_the_file_line_and_rule_of_what_it_cannot_read(content, message, tmp_path):
    """A missing file, a folder, a binary, a CSV that is no source page: one line each."""
    path = tmp_path / "s.csv"
    if content == "folder":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as info:
        ncu_stalls.main([str(path)])
    assert str(info.value).startswith(f"ncu_stalls: {message.format(path=path)}"), info.value


# -- trace_prefill ---------------------------------------------------------------------------

#: consumer step lengths (cycles) from event 0: K, scores, softmax, V, P V, release, to next
STEP = [10, 500, 400, 20, 500, 30, 40]
PERIOD = sum(STEP)


def synthetic(programs=3, tiles=6, slots=8, passed=(1, 4), idle=1) -> np.ndarray:
    """Stamps ``[programs + idle, 4, slots + 1, 10]``: warpgroups 0 and 1 compute ``tiles``
    tiles (warpgroup 1 passes tiles ``passed`` on: events 0, 1, 4, 6 only), partition 2
    absent, the producer 100 cycles a tile, issuing 300 cycles before warpgroup 0 starts each;
    ``idle`` programs of the buffer (sized for every SM) never ran."""
    st = np.full((programs + idle, 4, slots + 1, 10), -1, dtype=np.int64)
    for p in range(programs):
        t0 = 1000 * (p + 1)
        for t in range(tiles):
            for wg in (0, 1):
                ev = np.cumsum([0] + STEP[:-1]) + t0 + t * PERIOD + 7 * wg
                if wg == 1 and t in passed:
                    st[p, wg, t, [0, 1, 4, 6]] = ev[[0, 1, 4, 6]]
                else:
                    st[p, wg, t, :7] = ev
            st[p, 3, t, :3] = [t0 + t * PERIOD - 400, t0 + t * PERIOD - 350, t0 + t * PERIOD - 300]
        end = t0 + tiles * PERIOD + 100
        for part in (0, 1, 3):
            st[p, part, slots, :4] = [t0 - 500, 10 * (t0 - 500), end, 10 * end]
    return st


def test_trace_steps_measure_what_they_name():
    lines: list[str] = []
    res = trace_prefill.analyse(synthetic(), out=lines.append)
    text = "\n".join(lines)
    for i, (name, _, _) in enumerate(trace_prefill.STEPS):
        assert res[(0, name)] == STEP[i], (name, text)
    assert res[(0, "period")] == PERIOD
    assert res[("producer", "copies issued")] == 50
    assert res["copies issued before WG0 waits"] == 300
    assert res["release skew WG0/WG1"] == 7
    assert res["last release to end"] == 100 + STEP[-1] - 7
    assert "programs 3," in text  # the idle program of the buffer is left out
    assert "12 passed on" not in text and "6 passed on" in text
    assert "clock 0.100 GHz" in text  # 1 cycle per 10 ns in the synthetic timer
    assert not any("warpgroup 2" in line for line in lines)


def test_trace_programs_past_the_buffer_are_reported():
    lines: list[str] = []
    res = trace_prefill.analyse(synthetic(tiles=8, slots=8), out=lines.append)
    assert res["programs past the buffer"] == 3
    assert "3 programs ran past the trace's 8 tiles" in "\n".join(lines)


# -- trace_mla -------------------------------------------------------------------------------

#: each warpgroup's events of a pair, cycles from its event 0 (NaN: not its event); period 1000
MLA_EVENTS = {
    0: [0, 40, 60, 200, 210, 300, np.nan, 320, 500, 520, 560, 600, 800, 850],
    1: [0, 30, 90, 230, 260, 330, 380, 400, np.nan, 560, 620, 650, 880, 930],
}
MLA_PERIOD = 1000


def mla_trace(programs=2, pairs=5, slots=8, idle=1) -> np.ndarray:
    """Stamps ``[programs + idle, 2, slots + 1, 16]``: each program starts at ``1000 p``, ends
    its prologue 300 cycles later and its first pair 50 after that, runs ``pairs`` pairs of
    ``MLA_PERIOD`` cycles (warpgroup 1 5 cycles behind), then exchanges its row sums in 20
    cycles and stores in 70; the global timer runs 10 ns a cycle from 10 p; ``idle`` programs
    of the buffer never ran."""
    st = np.full((programs + idle, 2, slots + 1, 16), -1, dtype=np.int64)
    for p in range(programs):
        start = 1000 * p
        top = start + 350
        for j in range(pairs):
            for wg in (0, 1):
                ev = np.array(MLA_EVENTS[wg]) + top + j * MLA_PERIOD + 5 * wg
                ok = np.isfinite(ev)
                st[p, wg, j, np.flatnonzero(ok)] = ev[ok].astype(np.int64)
        st[p, 0, slots, [4, 5, 6]] = [start, 10 * p + 100, start + 300]
        for wg in (0, 1):
            end = top + pairs * MLA_PERIOD + 5 * wg
            st[p, wg, slots, :4] = [end, end + 20, end + 90, 10 * p + 100 + 10 * (end + 90 - start)]
    return st


def test_mla_trace_steps_measure_what_they_name():
    lines: list[str] = []
    res = trace_mla.analyse(mla_trace(), out=lines.append)
    text = "\n".join(lines)
    for wg, ev in MLA_EVENTS.items():
        for name, a, b in trace_mla.STEPS:
            to = MLA_PERIOD if b == "+0" else ev[b]
            want = to - ev[a]
            if np.isnan(want):  # the other warpgroup's event: no such step
                assert (wg, name.strip()) not in res, (wg, name, text)
            else:
                assert res[(wg, name.strip())] == want, (wg, name, text)
        assert res[(wg, "period")] == MLA_PERIOD
    assert res["prologue"] == 300 and res["to first pair"] == 50
    assert res["first tile"] == MLA_EVENTS[0][2]
    assert res["sums"] == 20 and res["stores"] == 70
    # span: the prologue, the first pair's start, 5 pairs, warpgroup 1's lag, sums and stores
    assert res["unexplained"] == 350 + 5 + 90
    assert "programs 2," in text  # the idle program of the buffer is left out
    assert "clock 0.100 GHz" in text


def test_mla_trace_programs_past_the_buffer_are_reported():
    lines: list[str] = []
    res = trace_mla.analyse(mla_trace(pairs=8, slots=8), out=lines.append)
    assert res["programs past the buffer"] == 2
    assert "2 programs ran past the trace's 8 pairs" in "\n".join(lines)


# -- clock -----------------------------------------------------------------------------------


def test_clock_summary_splits_time_into_cycles_and_clock():
    rows = [dict(point="p", block_size=16, us=[105.0, 106.0, 104.0], mhz=[1800.0] * 3),
            dict(point="p", block_size=2048, us=[100.0] * 3, mhz=[1700.0] * 3)]  # fmt: skip
    (s,) = clock.summarize(rows)
    assert (s["block_size"], s["against"]) == (16, 2048)
    assert s["time"] == pytest.approx(1.05) and s["clock"] == pytest.approx(1800 / 1700)
    assert s["cycles"] == pytest.approx(1.05 * 1800 / 1700)


def test_clock_sampler_reads_during_the_work_and_raises_a_failed_read():
    import time

    got = clock.sample_while(lambda: (1500.0, 600.0), lambda: time.sleep(0.2), ms=5, trim=1)
    assert got and all(s == (1500.0, 600.0) for s in got)

    def broken():
        raise OSError("no NVML")

    with pytest.raises(RuntimeError, match="read failed: no NVML"):
        clock.sample_while(broken, lambda: time.sleep(0.05), ms=5)


# -- host_steps ------------------------------------------------------------------------------


def test_host_steps_read_and_check_what_the_ops_read(monkeypatch, device):
    """The steps that need no launch of the op run on the test device: the host read gives the
    metadata's values, the summary and the checks the maxima (longest q_len, seq_len)."""
    from bench.diag import host_steps

    from portattn.kernels.metadata_summary import finish_metadata_summary
    from portattn.policy.paged import plan_max_seq_len

    monkeypatch.setenv("PORTATTN_TARGET", "sm_90")
    paged = host_steps.paged_steps(device)
    table, lens, qsl = paged["host read"]()
    assert lens.tolist() == [64] * 4 and qsl.tolist() == [0, 1, 2, 3, 4]
    assert table.shape == (4, 4)
    assert paged["summary"]() == (1, 64, 4)  # longest q_len, longest seq_len, tokens
    assert finish_metadata_summary(paged["summary queued"]()) == (1, 64, 4)
    assert paged["checks and maxima"]()[:2] == (1, plan_max_seq_len(64))  # the plan's band
    mla = host_steps.mla_steps(device)
    assert mla["summary"]() == (1, 256, 4)
    assert finish_metadata_summary(mla["summary queued"]()) == (1, 256, 4)
    assert mla["checks and maxima"]()[0] == 1
    gather = host_steps.gather_steps(device)
    assert gather["summary"]().tokens == 4 * 64  # the rows a call without out allocates
    k, v = gather["cached, new outputs"]()
    assert k.shape == v.shape == gather["two new outputs"]()[0].shape == (4 * 64, 8, 128)


def test_sm90_diagnostics_run_the_policys_config_with_the_changes_given():
    """`prefill_tiles.changed_config` (both `prefill_tiles` and `trace_prefill` launch it; the
    trace's summary takes its tile and warpgroups): the policy's config for the row, changed as
    ``--sm90`` says; a row the sm_90 kernel does not serve is refused."""
    from bench.diag import prefill_tiles

    from portattn.platform import get_target
    from portattn.policy.paged import PagedProblem

    sm90 = get_target("sm_90")
    hd256 = PagedProblem(32, 8, 256, 2, 4096, 16, 8, 4096)
    cfg = prefill_tiles.changed_config(sm90, hd256, {})
    assert (cfg.block_n, cfg.warpgroups, cfg.turns) == (64, 2, True)
    cfg = prefill_tiles.changed_config(sm90, hd256, dict(stages=3, late_release=False))
    assert (cfg.block_n, cfg.stages, cfg.late_release) == (64, 3, False)
    hd64 = PagedProblem(32, 8, 64, 2, 4096, 16, 8, 4096)
    assert prefill_tiles.changed_config(sm90, hd64, {}).warpgroups == 3
    with pytest.raises(SystemExit, match="does not serve this row"):
        prefill_tiles.changed_config(get_target("sm_80"), hd256, {})


# -- prefill_tiles ---------------------------------------------------------------------------


def test_prefill_tiles_builds_the_named_row_and_names_the_rows_it_knows():
    from bench.diag import prefill_tiles

    from bench import prefill

    b, flops = prefill_tiles._batch("prefill 2x48 4/2/64 bs16", "cpu", prefill.QUICK)
    assert tuple(b.query.shape) == (2 * 48, 4, 64) and b.key_cache.shape[1] == 16
    assert flops == 4 * 4 * 64 * 2 * (48 * 49 // 2)
    with pytest.raises(SystemExit, match="--row must be one of .*'prefill 2x16384 32/8/128 bs16'"):
        prefill_tiles._batch("prefill 9x9", "cpu")
    with pytest.raises(SystemExit):
        prefill_tiles.main(["--reps", "0"])
    ptx = "\n".join(["wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {...};"] * 3
                     + ["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {...};",
                        "wgmma.fence.sync.aligned;"])  # fmt: skip
    assert prefill_tiles.mma_shapes(ptx) == "m64n128k16 x1 m64n16k16 x3"
    assert prefill_tiles.mma_shapes("mma.sync.aligned.m16n8k16") == "no wgmma"


def test_prefill_tiles_candidates_name_the_kernel_they_time():
    """Portable candidates go with ``config=PagedConfig()`` (else the sm_90 kernel would serve a
    row it takes, head_dim 256 among them); sm_90 candidates are the policy's config changed."""
    import torch
    from bench.diag import prefill_tiles

    from portattn.kernels.paged_attention import plan_paged_attention
    from portattn.platform import get_target
    from portattn.policy.paged import PagedConfig, PagedProblem

    sm90 = get_target("sm_90")
    problem = PagedProblem(32, 8, 256, 2, 4096, 16, 8, 4096)
    portable = prefill_tiles.candidates(sm90, problem, [])
    assert portable[0][0].startswith("policy m128 n32 w8") and len(portable) == 17
    assert all(kw["config"] == PagedConfig() for _, kw, _ in portable)
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(8 * 4096, 32, 256, **meta)
    cache = torch.empty(8 * 256 + 1, 16, 8, 256, **meta)
    args = (q, cache, cache, torch.empty(8, 256, dtype=torch.int32, device="meta"),
            torch.empty(8, dtype=torch.int32, device="meta"),
            torch.empty(9, dtype=torch.int32, device="meta"))  # fmt: skip
    bounds = dict(max_query_len=4096, max_seq_len=4096, target=sm90)
    (launch,) = plan_paged_attention(*args, **bounds, **portable[1][1])
    assert launch.name == "paged_attention" and launch.args["BLOCK_N"] == 32
    sm = prefill_tiles.candidates(sm90, problem, [dict(block_n=32, stages=3)])
    assert [label for label, _, _ in sm] == ["policy", "block_n=32,stages=3"]
    assert (sm[0][2].block_n, sm[1][2].block_n, sm[1][2].stages) == (64, 32, 3)
    names = [x.name for x in plan_paged_attention(*args, **bounds, **sm[1][1])]
    assert names == ["paged_attention:work_list", "paged_prefill_sm90"]
    with pytest.raises(SystemExit, match="does not serve this row"):
        prefill_tiles.candidates(get_target("sm_80"), problem, [dict(stages=3)])


def test_prefill_tiles_reads_sm90_config_changes_and_refuses_bad_ones():
    from bench.diag import prefill_tiles

    got = prefill_tiles.parse_changes("block_n=32,stages=3,turns=1,query_by_tma=0")
    assert got == dict(block_n=32, stages=3, turns=True, query_by_tma=False)
    # no change (the policy's tile again) and a field given twice (the last one won)
    for bad, rule in (
        ("", "field=int items of"),
        ("block_n=32,block_n=64", "block_n is given twice"),
    ):
        with pytest.raises(ValueError, match=rule):
            prefill_tiles.parse_changes(bad)
    with pytest.raises(ValueError, match="field=int items of .*'block_n'.*got 'warps=8'"):
        prefill_tiles.parse_changes("warps=8")
    with pytest.raises(ValueError, match="turns takes 0 or 1; got '2'"):
        prefill_tiles.parse_changes("turns=2")
    with pytest.raises(SystemExit):
        prefill_tiles.main(["--sm90", "stages=x"])


@pytest.mark.cpu
def test_prefill_tiles_checks_each_candidate_then_times_them_together():
    """Under the interpreter (CPU, host clock): a line per candidate in the candidates' order,
    each checked candidate with its time, a refused one with why and no time; the timed ones
    go to one `core.Context.time_together` (its repetitions interleave them)."""
    import dataclasses

    from bench.diag import prefill_tiles

    from bench import core, prefill
    from portattn.platform import target_for_tensor

    b, flops = prefill_tiles._batch("prefill 2x48 4/2/64 bs16", "cpu", prefill.QUICK)
    cands = prefill_tiles.candidates(target_for_tensor(b.query), prefill_tiles.problem_of(b), [])
    label, kw, tiles = cands[0]
    # a tile the kernel refuses: block_n not a power of two
    bad = dataclasses.replace(tiles, block_n=24)
    picked = [cands[0], ("n24", dict(kw, tiles=bad), bad), cands[1]]
    together = []

    class Ctx(core.Context):
        def time_together(self, fns, graph=True):
            together.append(len(fns))
            return super().time_together(fns, graph)

    lines = prefill_tiles.report(Ctx("cpu", quick=True), b, flops, picked)
    assert [line.split()[0] for line in lines] == ["policy", "n24", cands[1][0].split()[0]]
    assert " µs " in lines[0] and " µs " in lines[2], lines
    assert "failed:" in lines[1] and " µs " not in lines[1], lines[1]
    assert together == [2]


# -- mla_splits ------------------------------------------------------------------------------


def test_mla_splits_counts_and_tiles(capsys):
    """The counts are read with their rule named; a count replaces only the policy's split."""
    from bench.diag import mla_splits

    from portattn.platform import get_target

    assert mla_splits.parse_splits("policy,1,8") == [None, 1, 8]
    for bad in ("0", "x", "33", ""):
        with pytest.raises(ValueError, match="neither 'policy' nor an int in \\[1, 32\\]"):
            mla_splits.parse_splits(bad)
    sm90 = get_target("sm_90")
    policy = mla_splits.tiles_for(sm90, 16, 64, 1024, None)
    four = mla_splits.tiles_for(sm90, 16, 64, 1024, 4)
    assert policy.num_kv_splits == 2  # 132 SMs, one program each: 64 sequences split twice
    assert four.num_kv_splits == 4 and {**vars(four), "num_kv_splits": 2} == vars(policy)
    # --narrow: 16 heads take the narrow tile (the portable kernel), split as the wide one
    narrow = mla_splits.tiles_for(sm90, 16, 64, 1024, None, narrow=True)
    assert (policy.block_h, policy.sm90_kernel) == (64, True)
    assert (narrow.block_h, narrow.sm90_kernel, narrow.num_kv_splits) == (16, False, 2)
    # --tiles: a narrow tile's shape in place of the policy's, prefetching from 3 stages
    assert mla_splits.parse_tiles("policy,32:3:4") == [None, (32, 3, 4)]
    for bad in ("48:2:4", "64:0:8", "64:2:2", "64:2", "x"):
        with pytest.raises(ValueError, match="neither 'policy' nor BLOCK_N:STAGES:WARPS"):
            mla_splits.parse_tiles(bad)
    t32 = mla_splits.tiles_for(sm90, 16, 64, 1024, 4, shape=(32, 3, 4))
    assert (t32.block_n, t32.options.num_stages, t32.options.num_warps) == (32, 3, 4)
    assert (t32.prefetch_rows, t32.num_kv_splits, t32.block_h) == (True, 4, 16)
    # past the target's 4-stage cap: the shape's own depth reaches the launch
    deep = mla_splits.tiles_for(sm90, 16, 64, 1024, None, shape=(32, 6, 4))
    assert (deep.options.num_stages, deep.prefetch_rows) == (6, True)
    assert deep.smem_bytes == 5 * 32 * 576 * 2 + 16 * 576 * 2 + 16 * 32 * 2
    two = mla_splits.tiles_for(sm90, 16, 64, 1024, None, shape=(64, 2, 8))
    assert not two.prefetch_rows and two.smem_bytes < narrow.smem_bytes + 64 * 576 * 2
    with pytest.raises(ValueError, match="past sm_90's"):
        mla_splits.tiles_for(sm90, 16, 64, 1024, None, shape=(64, 4, 8))
    with pytest.raises(ValueError, match="narrow tile only"):
        mla_splits.tiles_for(sm90, 64, 64, 1024, None, shape=(64, 2, 8))
    assert mla_splits.main(["--splits", "0"]) == 2
    assert mla_splits.main(["--splits", "²"]) == 2
    with pytest.raises(SystemExit):
        mla_splits.main(["--contexts", "²"])
    capsys.readouterr()
    assert mla_splits.main(["--tiles", "64:9:8"]) == 2
    assert mla_splits.main(["--narrow", "--tiles", "64:2:8"]) == 2
    counts_rule = "--contexts must be comma-separated token counts"
    for argv, rule in ((["--contexts", "1024,x"], counts_rule), (["--contexts", "0"], counts_rule),
                       (["--heads", "0"], "--heads must be >= 1; got 0")):  # fmt: skip
        with pytest.raises(SystemExit):
            mla_splits.main(argv)
        assert rule in capsys.readouterr().err


def test_every_diagnostic_that_times_stops_without_a_gpu(monkeypatch):
    """Each names itself and the rule, instead of timing the interpreter."""
    import importlib

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("clock", "host_steps", "trace_prefill", "prefill_tiles", "mla_splits",
                 "mla_hip_tiles", "shared_reads", "gather_copies", "trace_mla"):  # fmt: skip
        module = importlib.import_module(f"bench.diag.{name}")
        with pytest.raises(SystemExit, match=f"^bench.diag.{name}: needs a CUDA/HIP device"):
            module.main([])


@pytest.mark.parametrize(
    ("name", "argv", "rule"),
    [
        ("clock", ["--seconds", "nan"], "--seconds must be a finite number > 0; got nan"),
        ("clock", ["--seconds", "inf"], "--seconds must be a finite number > 0; got inf"),
        ("clock", ["--rounds", "0"], "argument --rounds: must be an int >= 1; got '0'"),
        ("mla_hip_tiles", ["--archs", "bogus"], "--archs must be comma-separated HIP targets of"),
        ("mla_hip_tiles", ["--archs", "gfx942,sm_90"], "HIP targets of ['gfx90a', 'gfx942'"),
        ("mla_hip_tiles", ["--q-lens", "x"], "--q-lens must be comma-separated ints >= 1; got 'x'"),
        ("mla_hip_tiles", ["--q-lens", "1,0"], "--q-lens must be comma-separated ints >= 1"),
        ("mla_hip_tiles", ["--q-lens", "1"], "--q-lens must hold a length > 1"),
        ("mla_hip_tiles", ["--heads", "0"], "argument --heads: must be an int >= 1; got '0'"),
        ("host_steps", ["--calls", "0"], "argument --calls: must be an int >= 1; got '0'"),
        ("host_steps", ["--repeats", "-1"], "argument --repeats: must be an int >= 1; got '-1'"),
        ("trace_prefill", ["--blocks", "0"], "argument --blocks: must be an int >= 1; got '0'"),
        ("trace_prefill", ["--sm90", "warps=8"], "--sm90 takes field=int items of"),
        ("trace_prefill", ["--sm90", "turns=2"], "--sm90: turns takes 0 or 1; got '2'"),
        ("prefill_tiles", ["--row", "x"], "--row must be one of ['prefill 8x4096 32/8/128 bs16'"),
        ("shared_reads", ["--layouts", "64x0"], "--layouts: '64x0' is neither 'ceiling' nor"),
        ("shared_reads", ["--mbytes", "0"], "--mbytes: '0' is not an int >= 1"),
        ("shared_reads", ["--mbytes", "302,302"], "--mbytes: '302,302' repeats an item"),
        ("shared_reads", ["--mbytes", "302,4097"], "--mbytes: 4097 is past 4096"),
        ("shared_reads", ["--reps", "0"], "argument --reps: must be an int >= 1; got '0'"),
        ("gather_copies", ["--layouts", "ceiling,64x2"], "--layouts: takes STREAMSxREADERS items"),
        ("gather_copies", ["--layouts", "64x2,64x2"], "--layouts: '64x2,64x2' repeats an item"),
        ("gather_copies", ["--mbytes", "4097"], "--mbytes: 4097 is past 4096"),
        ("gather_copies", ["--reps", "0"], "argument --reps: must be an int >= 1; got '0'"),
        ("gather_copies", ["--lags", "0,-1"], "--lags: '-1' is not an int >= 0"),
        ("gather_copies", ["--lags", "2,2"], "--lags: '2,2' repeats an item"),
        ("gather_copies", ["--windows", "1"], "--windows: '1' is not an int >= 2"),
        ("trace_mla", ["--contexts", "4096,0"], "--contexts: '0' is not an int >= 1"),
        ("trace_mla", ["--pages", "x"], "--pages: 'x' is not an int >= 1"),
        ("trace_mla", ["--heads", "0"], "argument --heads: must be an int >= 1; got '0'"),
        ("shared_reads", ["--rows", "paged"], "--rows: 'paged' is not one of ['ordered', 'scatt"),
        ("shared_reads", ["--rows", "ordered,ordered"], "--rows: 'ordered,ordered' repeats an"),
    ],
)  # fmt: skip
def test_diagnostic_arguments_are_checked_before_the_device(name, argv, rule, monkeypatch, capsys):
    """On a GPU these would crash, or replay forever, after the device work began: here, with
    no device, the rule is what stops them (not the device check), as it would on a GPU."""
    import importlib

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = importlib.import_module(f"bench.diag.{name}")
    with pytest.raises(SystemExit) as info:
        module.main(argv)
    assert info.value.code == 2
    assert rule in capsys.readouterr().err


# -- flush -------------------------------------------------------------------------------------


def test_flush_parses_its_lists_and_fits_a_line():
    from bench.diag import flush

    assert flush.parse_list("75,302", "mbytes") == [75, 302]
    assert flush.parse_list("read,none", "flush", flush.MODES) == ["read", "none"]
    with pytest.raises(ValueError, match=r"--mbytes: '0' is not an int >= 1"):
        flush.parse_list("75,0", "mbytes")
    with pytest.raises(ValueError, match=r"--flush: 'zero' is not one of \['write'"):
        flush.parse_list("write,zero", "flush", flush.MODES)
    # a repeat (the fit after all the timing needs distinct sizes), a non-ASCII digit
    with pytest.raises(ValueError, match=r"--mbytes: '75,75' repeats an item"):
        flush.parse_list("75,75", "mbytes")
    with pytest.raises(ValueError, match=r"--mbytes: '²' is not an int >= 1"):
        flush.parse_list("²", "mbytes")
    fixed, slope = flush.fit([(1.0, 12.0), (2.0, 14.0), (4.0, 18.0)])
    assert fixed == pytest.approx(10.0) and slope == pytest.approx(2.0)
    with pytest.raises(ValueError, match="two distinct x"):
        flush.fit([(3.0, 1.0), (3.0, 2.0)])
    with pytest.raises(SystemExit):
        flush.main(["--reps", "0"])


@pytest.mark.cpu
def test_mla_splits_checks_each_count_then_times_them_together():
    """Under the interpreter (CPU, host clock): a line per candidate in order, a refused tile
    with why and no time, each checked count with its time (a split one with its attention
    launch alone too), all timed calls in one `core.Context.time_together`."""
    import dataclasses

    import torch
    from bench.diag import mla_splits

    from bench import core, inputs, mla
    from portattn.platform import target_for_tensor

    b = inputs.mla_batch(batch=2, context=40, heads=16, head_dim_k=mla.DK, page=16, q_len=1,
                         dtype=torch.float16, device="cpu")  # fmt: skip
    out = torch.empty(2, 16, mla.RANK, dtype=torch.float16)
    target = target_for_tensor(b.query)
    one = mla_splits.tiles_for(target, 16, 2, 40, 1)
    two = dataclasses.replace(one, num_kv_splits=2)
    cands = [("splits 1", one, ""), ("tile 24:1:4 ", None, "not a tile"), ("splits 2", two, "")]
    together = []

    class Ctx(core.Context):
        def time_together(self, fns, graph=True):
            together.append(len(fns))
            return super().time_together(fns, graph)

    lines = mla_splits.report(Ctx("cpu", quick=True), b, out, mla.DK**-0.5, 1 << 20, 1.0, cands)
    assert [line.split()[0] for line in lines] == ["splits", "tile", "splits"], lines
    assert " µs " in lines[0] and "attention alone" not in lines[0], lines[0]
    assert "refused: not a tile" in lines[1], lines[1]
    assert " µs " in lines[2] and "attention alone" in lines[2], lines[2]
    assert together == [3]


# -- shared_reads ------------------------------------------------------------------------------


def test_shared_reads_layouts_are_read_with_their_rule():
    from bench.diag import shared_reads

    assert shared_reads.parse_layouts("ceiling,128x1,64x2") == [None, (128, 1), (64, 2)]
    for bad in ("64", "0x2", "64x", "x2", "６4x2", "64x2x1"):
        with pytest.raises(ValueError, match="is neither 'ceiling' nor STREAMSxREADERS"):
            shared_reads.parse_layouts(bad)
    with pytest.raises(ValueError, match="repeats an item"):
        shared_reads.parse_layouts("64x2,64x2")


@pytest.mark.cpu
def test_shared_reads_every_reader_sums_its_whole_stream():
    """Under the interpreter: each of a stream's readers returns that stream's exact sum (the
    check the launch runs before it is timed), over whole chunks of the buffer asked for."""
    import torch
    from bench.diag import shared_reads

    block = shared_reads.BLOCK
    fn, nbytes = shared_reads.streams(3 * 2 * 4 * block, 2, 3, "cpu")
    assert nbytes == 3 * 2 * 4 * block  # 2 streams of 3 chunks, each read by 3 programs
    fn, nbytes = shared_reads.streams(100, 4, 2, "cpu")
    assert nbytes == 4 * 4 * block  # at least one chunk a stream
    # the check's comparison tells a read that stops a chunk short from a whole one
    x = torch.arange(2 * 3 * block, dtype=torch.int32).reshape(2, -1) % 7
    out = torch.empty(2, dtype=torch.int32)
    shared_reads._streams_kernel[(2,)](x, out, 2, READERS=1, BLOCK=block)
    assert not torch.equal(out, x.sum(dim=1, dtype=torch.int32))
    shared_reads._streams_kernel[(2,)](x, out, 3, READERS=1, BLOCK=block)
    assert torch.equal(out, x.sum(dim=1, dtype=torch.int32))


@pytest.mark.cpu
def test_shared_reads_rows_are_summed_where_they_lie():
    """Under the interpreter: a stream read as cache rows sums exactly the rows its indices name,
    in either order (the check its launch runs before it is timed), over whole chunks; and the
    kernel reads the rows the indices name, not the rows that follow one another."""
    import torch
    from bench.diag import shared_reads

    chunk = shared_reads.ROW_BYTES * shared_reads.ROWS
    for order in shared_reads.ROW_ORDERS:
        fn, nbytes = shared_reads.row_streams(2 * 3 * chunk, 3, 2, order, "cpu")
        assert nbytes == 3 * 2 * chunk  # 3 streams of 2 chunks, each read by 2 programs
    rows, ints = 2 * shared_reads.ROWS, shared_reads.ROW_INTS
    x = torch.zeros(rows, ints, dtype=torch.int32)
    x[rows // 2 :] = 1  # the second half's rows sum to ROW_INTS each
    out = torch.empty(1, dtype=torch.int32)
    args = dict(READERS=1, ROWS=shared_reads.ROWS, HEAD=shared_reads.ROW_HEAD,
                TAIL=ints - shared_reads.ROW_HEAD)  # fmt: skip
    back = torch.arange(rows - 1, rows // 2 - 1, -1, dtype=torch.int32)  # the second half, reversed
    shared_reads._rows_kernel[(1,)](x, back, out, 1, **args)
    assert out.item() == shared_reads.ROWS * ints
    ahead = torch.arange(rows // 2, dtype=torch.int32)  # the first half
    shared_reads._rows_kernel[(1,)](x, ahead, out, 1, **args)
    assert out.item() == 0


# -- gather_copies -----------------------------------------------------------------------------


def _gather_copies_ptx(tma_engine: bool) -> tuple[str, int]:
    """`bench.diag.gather_copies`' kernel compiled for sm_90 (meta tensors, no GPU): its PTX and
    shared memory (in a spawned process: `tests.helpers.in_spawned_workers`)."""
    import torch
    from bench.diag import gather_copies as gc
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from portattn.compile.worker import compile_kernel
    from portattn.kernels._launch import Launch
    from portattn.platform import get_target
    from portattn.policy.common import LaunchOptions

    sm90 = get_target("sm_90")
    kv = torch.empty(1 << 16, gc.WIDTH, dtype=torch.bfloat16, device="meta")
    desc = TensorDescriptor.from_tensor(kv, [gc.ROWS, 64], gc._SWIZZLED)
    rows = torch.empty(1 << 16, dtype=torch.int32, device="meta")
    out = torch.empty(8, gc.ROWS, gc.WIDTH, dtype=torch.bfloat16, device="meta")
    args = dict(desc=desc, kv_ptr=kv, idx_ptr=rows, out_ptr=out, tiles=64, lag=2, READERS=2,
                TMA=tma_engine)  # fmt: skip
    launch = Launch(gc._gather_copies_kernel, (4,), args, LaunchOptions(4, 1), sm90,
                    name="gather_copies")  # fmt: skip
    compiled = compile_kernel(launch, sm90)
    return compiled.asm["ptx"], compiled.metadata.shared


@target_compile
def test_gather_copies_compiles_each_engine_for_sm90():
    """The cp.async kernel copies in 16-byte pieces and no TMA box; the TMA kernel in nine boxes a
    tile and no cp.async; both hold two tiles (147456 bytes and the barriers) in shared memory."""
    got = in_spawned_workers(_gather_copies_ptx, [(False,), (True,)])
    gather, gather_smem = got[(False,)]
    boxes, boxes_smem = got[(True,)]
    assert "cp.async.cg.shared.global" in gather and "cp.async.bulk.tensor" not in gather
    assert "cp.async.bulk.tensor" in boxes and "cp.async.cg.shared.global" not in boxes
    assert boxes.count("cp.async.bulk.tensor") >= 9
    assert 2 * 9 * 64 * 64 * 2 <= min(gather_smem, boxes_smem) <= 232448


def test_windowed_rows_stay_in_their_windows():
    """Each window of the permutation holds exactly its own rows (the last one short), in an
    order that is not the identity; windows do not come in their own order."""
    import itertools

    import torch
    from bench.diag import gather_copies

    g = torch.Generator().manual_seed(3)
    rows = gather_copies.scattered_rows(1000, 64, g, "cpu")
    assert sorted(rows.tolist()) == list(range(1000))
    runs = [(w, len(list(group))) for w, group in itertools.groupby(r // 64 for r in rows.tolist())]
    assert sorted(w for w, _ in runs) == list(range(16))  # each window in one run
    assert all(n == (1000 - 15 * 64 if w == 15 else 64) for w, n in runs)
    assert [w for w, _ in runs] != list(range(16))
    assert not torch.equal(rows, torch.arange(1000))
    whole = gather_copies.scattered_rows(1000, None, g, "cpu")
    assert sorted(whole.tolist()) == list(range(1000))


def test_sorted_streams_hold_their_scattered_rows_in_address_order():
    """``sorted`` deals out the same permutation as ``scattered`` (same seed), each stream's
    rows then ascending; ``ordered`` streams are whole 64-row pages."""
    import torch
    from bench.diag import gather_copies

    def rows(order):
        return gather_copies.stream_rows(order, 4, 8, torch.Generator().manual_seed(5), "cpu")

    scattered, sorted_, ordered = rows("scattered"), rows("sorted"), rows("ordered")
    assert sorted_.dtype == torch.int32 and sorted(sorted_.tolist()) == list(range(4 * 8 * 64))
    for mine, theirs in zip(sorted_.view(4, -1), scattered.view(4, -1), strict=True):
        assert torch.equal(mine, theirs.sort().values)
    assert not torch.equal(sorted_, scattered)
    pages = ordered.view(-1, 64)
    assert torch.equal(pages - pages[:, :1], torch.arange(64).expand(32, 64).int())
    assert (pages[:, 0] % 64 == 0).all()


def test_gather_copies_refuses_a_window_without_scattered_rows():
    from bench.diag import gather_copies

    with pytest.raises(ValueError, match="window 64 needs scattered rows"):
        gather_copies.copies(1 << 20, 2, 1, False, "ordered", device="cpu", window=64)


def test_gather_copies_refuses_a_box_over_scattered_rows():
    from bench.diag import gather_copies

    with pytest.raises(ValueError, match="a TMA box copies rows that lie one after another"):
        gather_copies.copies(1 << 20, 2, 1, True, "scattered", device="cpu")
