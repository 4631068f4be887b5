"""The compile matrix on real kernels: a subset of cells, and the regressions of lessons 1 and 3.

The naive rules of the two upstream bugs live only here:

* lesson 1 (MLA): tile widths taken from the key width, as upstream's grouped decode kernel did
  (``BLOCK_DMODEL`` 512 / ``BLOCK_DPE`` 64 for head_dim_k 576, 256 / 32 for 288, and otherwise
  ``next_pow2(head_dim_k)`` with no rope tile). That rule is right for 576/512 and 288/256 and
  wrong only for 320/256 (Mistral-Small-4), which must be the only cells it breaks.
* lesson 3 (paged): the KV tile taken from the cache's block size (``BLOCK_N = block_size``),
  which asks a 65536 B MI300-class part for far more than 65536 B at block size 2048.

Cells compile in spawned processes through Triton's persistent cache, so re-runs are fast.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from portattn.compile import Case, default_cases, make_case, run_matrix
from portattn.compile.cases import (
    MLA_CONTEXT,
    NUM_SEQS,
    _mla_case,
    build_mla_decode,
    build_paged_attention,
)
from portattn.compile.matrix import MatrixInterrupted
from portattn.kernels._launch import Launch
from portattn.platform import Target, get_target
from portattn.policy.common import next_pow2
from portattn.policy.mla import MlaProblem, mla_decode_tiles
from tests.helpers import compile_in_spawned_workers

pytestmark = pytest.mark.compile

# One NVIDIA and one AMD target for the real-policy subset; the 64 KB LDS part is the tight one.
SUBSET_TARGETS = ("sm_90", "gfx942")
SUBSET_IDS = (
    "paged_attention/hd128 gqa5 bs2048 NHD prefill",
    "paged_attention/hd64 gqa8 bs16 SHUFFLE decode",
    "mla_decode/320/256 h16",
    "write_kv_cache/hd128 bs544 SHUFFLE",
    "gather_kv_cache/hd64 bs80 NHD",
)
MLA_SHAPES = ((576, 512), (320, 256), (288, 256))
NAIVE_MLA_TARGETS = ("sm_90", "gfx942")
PAGED_LIMIT_ARCH = "gfx942"


# -- naive rules (upstream's, reproduced only here) -----------------------------------------------


def naive_mla_widths(head_dim_k: int) -> tuple[int, int]:
    """Upstream's (BLOCK_DMODEL, BLOCK_DPE): special cases for 576 and 288, else the key width."""
    if head_dim_k == 576:
        return 512, 64
    if head_dim_k == 288:
        return 256, 32
    return next_pow2(head_dim_k), 0


def build_portable_mla(
    target: Target,
    *,
    head_dim_k: int,
    kv_lora_rank: int,
    num_q_heads: int,
    block_size: int,
    naive: bool = False,
):
    """`build_mla_decode` with the policy's portable-kernel tiles (those of a cache the sm_90
    kernel cannot run), upstream's widths injected via ``tiles=`` where ``naive``."""
    problem = MlaProblem(
        num_q_heads, head_dim_k, kv_lora_rank, 2, NUM_SEQS, MLA_CONTEXT, sm90_ready=False
    )
    tiles = mla_decode_tiles(target, problem)
    if naive:
        dv, dpe = naive_mla_widths(head_dim_k)
        tiles = dataclasses.replace(tiles, block_dv=dv, block_dpe=dpe)
    return build_mla_decode(
        target,
        head_dim_k=head_dim_k,
        kv_lora_rank=kv_lora_rank,
        num_q_heads=num_q_heads,
        tiles=tiles,
        block_size=block_size,
    )


def with_tile_from_block_size(launch: Launch) -> Launch:
    """Upstream's paged rule: the KV tile is the cache block (BLOCK_N = block_size)."""
    return dataclasses.replace(launch, args={**launch.args, "BLOCK_N": launch.args["block_size"]})


def build_naive_paged(target: Target, **params) -> list[Launch]:
    return [with_tile_from_block_size(x) for x in build_paged_attention(target, **params)]


def _cases(ids) -> list[Case]:
    by_id = {c.id: c for c in default_cases()}
    return [by_id[i] for i in ids]


# -- tests ---------------------------------------------------------------------------------------


def test_real_policies_pass_on_both_vendors():
    cells = run_matrix(_cases(SUBSET_IDS), SUBSET_TARGETS, jobs=2)
    assert len(cells) == len(SUBSET_IDS) * len(SUBSET_TARGETS)
    failing = {c.id: c.reasons for c in cells if not c.passed}
    assert failing == {}
    for c in cells:
        assert c.compiled and c.shared is not None and c.shared <= c.limit
        assert all(r.regs and r.hash for r in c.launches), c.id
    # The long MLA context splits, so the reduce kernel is compiled as well. On sm_90 16-bit
    # launches take the Hopper kernel below 64 heads too (MlaProblem.sm90_ready).
    for c in (c for c in cells if c.kernel == "mla_decode"):
        main = "mla_decode_sm90" if c.arch == "sm_90" else "mla_decode"
        assert [r.name for r in c.launches] == [main, "mla_decode_reduce"], c.id


def test_naive_mla_widths_break_exactly_the_320_256_cells():
    # the portable kernel (the one upstream's widths are about) on every target, sm_90 included
    # (its tiles for a cache the Hopper kernel cannot run)
    params = dict(num_q_heads=16, block_size=64)
    naive = [
        make_case(
            "mla_decode",
            f"naive {dk}/{dv} h16",
            build_portable_mla,
            head_dim_k=dk,
            kv_lora_rank=dv,
            naive=True,
            **params,
        )  # fmt: skip
        for dk, dv in MLA_SHAPES
    ]
    real = [
        dataclasses.replace(_mla_case(f"{dk}/{dv} h16", dk, dv, **params), build=build_portable_mla)
        for dk, dv in MLA_SHAPES
    ]
    cells = {c.id: c for c in compile_in_spawned_workers(naive + real, NAIVE_MLA_TARGETS)}
    broken = sorted(i for i, c in cells.items() if not c.compiled)
    assert broken == [f"mla_decode/naive 320/256 h16@{a}" for a in sorted(NAIVE_MLA_TARGETS)]
    for arch in NAIVE_MLA_TARGETS:
        bad = cells[f"mla_decode/naive 320/256 h16@{arch}"]
        # Caught at compile time on every target: the kernel refuses a value tile that is not
        # next_pow2(kv_lora_rank) (upstream's kernel failed later, in tl.dot's shape check).
        assert bad.reasons[0].startswith("mla_decode: compile: CompileTimeAssertionFailure")
        assert "BLOCK_DV must be next_pow2(kv_lora_rank)" in bad.reasons[0]
        assert cells[f"mla_decode/320/256 h16@{arch}"].passed
        # Where upstream's rule is right, it is the policy's rule: the very same kernel.
        for dk, dv in ((576, 512), (288, 256)):
            a = cells[f"mla_decode/naive {dk}/{dv} h16@{arch}"]
            b = cells[f"mla_decode/{dk}/{dv} h16@{arch}"]
            assert [r.hash for r in a.launches] == [r.hash for r in b.launches]
            assert b.passed, b.reasons


def test_naive_paged_tile_from_block_size_overflows_gfx942():
    params = dict(head_dim=128, num_q_heads=40, num_kv_heads=8, layout="NHD", max_query_len=64)
    # The full backend takes minutes on such a tile; the verdict is the allocated size.
    cases = [
        dataclasses.replace(
            make_case(
                "paged_attention", f"naive bs{bs}", build_naive_paged, block_size=bs, **params
            ),
            shared_only=True,
        )
        for bs in (16, 2048)
    ]
    real = make_case(
        "paged_attention", "real bs2048", build_paged_attention, block_size=2048, **params
    )
    cells = {c.case: c for c in compile_in_spawned_workers([*cases, real], [PAGED_LIMIT_ARCH])}
    limit = get_target(PAGED_LIMIT_ARCH).max_shared_mem
    assert cells["naive bs16"].passed, cells["naive bs16"].reasons
    bad = cells["naive bs2048"]
    assert not bad.passed and bad.shared is not None and bad.shared > limit
    assert bad.reasons == [f"shared memory {bad.shared} B > gfx942 limit {limit} B"]
    assert cells["real bs2048"].passed, cells["real bs2048"].reasons


def test_shared_only_lowering_matches_the_full_compile():
    """`shared_memory_only` replays make_llir's passes up to allocation: the same figure."""
    full = _cases(["paged_attention/hd128 mha bs16 NHD decode", "mla_decode/576/512 h16"])
    lowered = [dataclasses.replace(c, name=c.name + " lowered", shared_only=True) for c in full]
    cells = {
        (c.kernel, c.case, c.arch): c
        for c in compile_in_spawned_workers(full + lowered, SUBSET_TARGETS)
    }
    for case in full:
        for arch in SUBSET_TARGETS:
            a = cells[case.kernel, case.name, arch]
            b = cells[case.kernel, case.name + " lowered", arch]
            assert a.compiled and b.compiled
            assert [r.shared for r in b.launches] == [r.shared for r in a.launches]
            assert a.shared and a.shared > 0


def test_chunks_keep_a_target_per_chunk_and_let_targets_take_turns():
    """Workers take consecutive cases of one target at a time (a kernel neighbouring cases share
    is compiled once, by one worker), the targets alternating so that workers side by side are
    on different targets; every cell is in exactly one chunk."""
    from portattn.compile.matrix import _chunks

    cases = [make_case("k", f"c{i}", build_portable_mla) for i in range(5)]
    cells = [(c, a) for c in cases for a in ("sm_90", "gfx942")]
    chunks = _chunks(cells, 2)
    assert sorted(i for ch in chunks for i in ch) == list(range(len(cells)))
    archs = [{cells[i][1] for i in ch} for ch in chunks]
    assert all(len(a) == 1 for a in archs)
    assert [a.pop() for a in archs] == ["sm_90", "gfx942"] * 3
    assert [[cells[i][0].name for i in ch] for ch in chunks[:2]] == [["c0", "c1"]] * 2
    assert _chunks([], 8) == []


def test_latent_and_rope_parts_narrower_than_a_dot_compile_on_every_vendor():
    """A rope part or a kv_lora_rank of 1-8 columns gave tiles of that width, which NVIDIA's
    tl.dot refuses (K and N >= 16): the compile failed on every sm_ target. Rows of 520, 600 or
    264 elements (no multiple of 16, which is all Triton sees of an integer's alignment) were
    loaded element by element and spilled 72-11876 B on NVIDIA; the kernel now addresses them in
    units of 8 elements (`KV_VEC`), and they pass the gate."""
    shapes = ((520, 512, 16, 16), (16, 8, 16, 16), (8, 8, 16, 16), (600, 512, 16, 16),
              (264, 256, 128, 1))  # fmt: skip
    cases = [make_case("mla_decode", f"{dk}/{r} h{h} page{bs}", build_mla_decode, head_dim_k=dk,
                       kv_lora_rank=r, num_q_heads=h, block_size=bs)
             for dk, r, h, bs in shapes]  # fmt: skip
    cells = compile_in_spawned_workers(cases, ("sm_80", "sm_90", "gfx942"))
    assert all(c.compiled and c.launches[0].name == "mla_decode" for c in cells)
    assert [c.id for c in cells if not c.passed] == []
    # the rows' unit: 8 elements a 16-byte vector for the 520-wide rows; 1 (no claim) for 16
    wide = [c for c in cases if c.name.startswith("520/")][0].plan(get_target("sm_90"))[0]
    narrow = [c for c in cases if c.name.startswith("16/")][0].plan(get_target("sm_90"))[0]
    assert (wide.args["KV_VEC"], narrow.args["KV_VEC"]) == (8, 1)


def test_the_sm90_warpgroup_rows_tile_at_head_dim_256_compiles_within_the_gate():
    """The 128 x 32 tile the sm_90 policy gives the portable kernel at head_dim 129-256 (where
    the sm_90 prefill kernel does not take the batch: here 17-token pages) is bounded by shared
    memory only, past the words model; no default case builds it, so this holds its spills."""
    cases = [make_case("paged_attention", f"hd{hd} gqa8 bs17 NHD prefill", build_paged_attention,
                       head_dim=hd, num_q_heads=32, num_kv_heads=4, block_size=17, layout="NHD",
                       max_query_len=64) for hd in (192, 256)]  # fmt: skip
    for case in cases:  # the tile this test is about (planned on meta tensors)
        (main,) = [x for x in case.plan(get_target("sm_90")) if x.name == "paged_attention"]
        assert (main.args["BLOCK_M"], main.args["BLOCK_N"], main.options.num_warps) == (128, 32, 8)
    cells = compile_in_spawned_workers(cases, ["sm_90"])
    for c in cells:
        (main,) = [r for r in c.launches if r.name == "paged_attention"]
        assert c.passed, (c.id, c.reasons)
        assert main.spills is not None and main.spills <= 16 and main.regs is not None


# -- a worker's failures: each its own cell's result ---------------------------------------------


def build_broken(target: Target, *, fault: str) -> list[Launch]:
    """A case builder that fails as ``fault`` says: a bug (KeyError), a SystemExit, a death of
    its process (SIGKILL, as the OOM killer sends), a hang, or a hang after it sent its parent
    SIGTERM."""
    if fault == "keyerror":
        raise KeyError("bug in a builder")
    if fault == "exit":
        raise SystemExit(0)
    if fault == "hang":  # a compile that never ends
        time.sleep(3600)
    if fault == "cancel":  # the CI job cancelled meanwhile: SIGTERM to the command
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


HEALTHY = "gather_kv_cache/hd64 bs80 NHD"


def test_a_builder_that_raises_fails_its_own_cell_not_its_chunk():
    """One worker, one chunk: a builder's KeyError failed all its chunk-mates (their results
    dropped), and a SystemExit ended the run with exit 0 and no report."""
    broken = [make_case("gather_kv_cache", f, build_broken, fault=f) for f in ("keyerror", "exit")]
    cells = {c.case: c for c in run_matrix([*_cases([HEALTHY]), *broken], ["sm_90"], jobs=1)}
    assert cells[HEALTHY.split("/", 1)[1]].passed
    assert cells["keyerror"].reasons == ["plan: KeyError: 'bug in a builder'"]
    assert cells["exit"].reasons == ["worker: SystemExit: 0"]


def test_a_worker_that_dies_fails_only_the_cell_that_killed_it():
    """A worker killed mid-cell broke the pool, and every pending cell failed with
    BrokenProcessPool, labelled as a plan error; the cells it took down run again one at a
    time, and only the killer fails."""
    dies = make_case("gather_kv_cache", "dies", build_broken, fault="die")
    healthy = _cases([HEALTHY, "gather_kv_cache/hd64 bs16 SHUFFLE"])
    cells = {c.case: c for c in run_matrix([healthy[0], dies, healthy[1]], ["sm_90"], jobs=2)}
    assert cells["dies"].reasons == [
        "worker: the worker process died compiling this cell (a crash, or killed: out of memory?)"
    ]
    assert [cells[c.name].passed for c in healthy] == [True, True]
    assert all(cells[c.name].compiled for c in healthy)


def test_unreadable_resource_figures_fail_the_cell_and_are_not_kept(tmp_path, monkeypatch):
    """cuobjdump or ptxas failing (or output without the figures) gave ``spills=None``, which
    the gate read as no spill, and the Nones were kept for later runs; AMD's likewise for a
    missing ``.vgpr_spill_count``."""
    from triton import knobs

    from portattn.compile import worker

    garbage = types.SimpleNamespace(asm={"cubin": b"not a cubin", "ptx": ""},
                                    metadata=types.SimpleNamespace(hash="h"))  # fmt: skip
    with pytest.raises(RuntimeError, match=r"cuobjdump -res-usage exited \d+ without the figures"):
        worker._nvidia_resources(garbage, 90)
    with pytest.raises(RuntimeError, match="the AMDGPU metadata has no vgpr_count, vgpr_spill"):
        worker._amd_resources(types.SimpleNamespace(asm={"amdgcn": ".text"}))
    # a kept record of unreadable figures is measured again, not served
    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    kept = tmp_path / "portattn_resources" / f"h.{worker._RESOURCES_VERSION}.json"
    kept.parent.mkdir()
    kept.write_text(json.dumps({"regs": None, "spills": None, "scratch": None}))
    with pytest.raises(RuntimeError, match="cuobjdump"):
        worker._resources(garbage, get_target("sm_90"))
    assert json.loads(kept.read_text())["spills"] is None  # nothing new written


STOPPED = "worker: stopped before its result came back (interrupted)"


@pytest.mark.timeout(600)
def test_an_interrupted_matrix_keeps_what_finished_and_stops_its_workers():
    """Ctrl-C (or SIGTERM raised as it) while a compile hangs: the finished cell is kept, the
    hung one fails as stopped, and no worker process is left (the pool's exit would have waited
    for the hung compile)."""
    hang = make_case("gather_kv_cache", "hangs", build_broken, fault="hang")

    def interrupt(done: int, total: int, cell) -> None:
        raise KeyboardInterrupt  # after the first cell's result: the healthy one's

    before = set(multiprocessing.active_children())  # e.g. the shared compile workers
    with pytest.raises(MatrixInterrupted) as info:
        run_matrix([*_cases([HEALTHY]), hang], ["sm_90"], jobs=2, progress=interrupt)
    cells = {c.case: c for c in info.value.cells}
    assert cells[HEALTHY.split("/", 1)[1]].passed
    assert cells["hangs"].reasons == [STOPPED]
    assert set(multiprocessing.active_children()) <= before


_QUEUED_AT_INTERRUPT = """
import multiprocessing, threading, time
from concurrent.futures import ProcessPoolExecutor
from portattn.compile.matrix import _stops_workers

def hang():
    time.sleep(60)

if __name__ == "__main__":
    errors = []
    threading.excepthook = lambda args: errors.append(repr(args.exc_value))
    pool = ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn"))
    futures = [pool.submit(hang) for _ in range(40)]
    time.sleep(0.5)
    try:
        with _stops_workers(futures, pool):
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    pool.shutdown(wait=True)
    assert all(f.done() for f in futures)
    print("thread errors:", errors)
"""


@pytest.mark.timeout(120)
def test_stopping_the_workers_leaves_no_traceback_for_queued_cells(tmp_path):
    """Chunks still queued when an interrupt ended the workers were cancelled first; the
    executor's own thread then failed them as broken and printed an InvalidStateError traceback
    to stderr (a SIGTERM'd full run showed it). They are left to that thread instead. Run as a
    script: its workers start as a matrix run's do (spawned from ``__main__``)."""
    script = tmp_path / "queued.py"
    script.write_text(_QUEUED_AT_INTERRUPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=100)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "thread errors: []", out.stdout


@pytest.mark.timeout(600)
def test_sigterm_writes_the_reports_and_exits_143(tmp_path, monkeypatch, capsys):
    """A cancelled CI job's SIGTERM ended the command at once: no report, not even of the
    cells that had finished; now the reports are written and the exit status is 143."""
    from portattn.compile import __main__ as cli

    before = set(multiprocessing.active_children())
    cancel = make_case("gather_kv_cache", "cancelled", build_broken, fault="cancel")
    monkeypatch.setattr(cli, "default_cases", lambda kernels=None: [cancel])
    out = tmp_path / "out"
    argv = ["--targets", "sm_90", "--jobs", "1", "--no-png", "--out", str(out),
            "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    assert cli.main(argv) == 143
    doc = json.loads((out / "compile_matrix.json").read_text())
    assert [(c["case"], c["passed"], c["reasons"]) for c in doc["cells"]] == [
        ("cancelled", False, [STOPPED])
    ]
    assert "compile: interrupted (SIGTERM): 1 cells stopped without a result; exit status 143" in (
        capsys.readouterr().err
    )
    assert set(multiprocessing.active_children()) <= before
