"""The compile matrix's gate, filters and reports, on hand-made cell results (no compiling)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from portattn.compile import (
    ESTIMATE_TOLERANCE,
    SPILL_THRESHOLD,
    CellResult,
    LaunchResult,
    default_cases,
    evaluate,
    parse_targets,
    select_cases,
)
from portattn.compile.__main__ import main
from portattn.compile.report import markdown, summary_table, write_heatmap, write_json
from portattn.platform import TARGETS

pytestmark = pytest.mark.compile

GFX942_LIMIT = TARGETS["gfx942"].max_shared_mem


def _cell(*launches: LaunchResult, arch: str = "gfx942", plan_error: str | None = None):
    t = TARGETS[arch]
    cell = CellResult("paged_attention", "hd128 case", arch, t.vendor, t.max_shared_mem)
    cell.launches = list(launches)
    cell.plan_error = plan_error
    return cell


def _ok(shared: int, spills: int = 0, estimate: int | None = None, name: str = "k"):
    return LaunchResult(
        name, "_k", True, shared=shared, regs=64, spills=spills, policy_shared=estimate
    )


def test_fitting_cell_passes():
    cell = evaluate(_cell(_ok(GFX942_LIMIT, estimate=GFX942_LIMIT)))
    assert cell.passed and cell.reasons == [] and cell.notes == []


def test_shared_memory_over_the_limit_fails():
    cell = evaluate(_cell(_ok(GFX942_LIMIT + 1)))
    assert not cell.passed
    assert cell.reasons == [f"shared memory {GFX942_LIMIT + 1} B > gfx942 limit {GFX942_LIMIT} B"]


def test_compile_error_fails_with_the_compiler_message():
    err = LaunchResult("k", "_k", False, error="CompilationError: incompatible dimensions")
    cell = evaluate(_cell(err))
    assert not cell.passed
    assert cell.reasons == ["compile: CompilationError: incompatible dimensions"]


def test_plan_error_fails():
    cell = evaluate(_cell(plan_error="TypeError: plan_paged_attention: query must be a tensor"))
    assert not cell.passed
    assert cell.reasons == ["plan: TypeError: plan_paged_attention: query must be a tensor"]


def test_policy_refusal_is_a_note_not_a_failure():
    """The op refuses the problem with a clear ValueError: the API does not accept it there
    (tests/compile/test_refusals.py pins which cells refuse)."""
    cell = evaluate(_cell(plan_error="ValueError: paged_tiles: no tile fits gfx942's 65536 B"))
    assert cell.passed and cell.reasons == []
    assert cell.notes == ["refused: ValueError: paged_tiles: no tile fits gfx942's 65536 B"]


def test_spills_over_the_threshold_fail_unless_allowed():
    nv = SPILL_THRESHOLD["cuda"]
    assert evaluate(_cell(_ok(1024, spills=nv), arch="sm_86")).passed
    cell = evaluate(_cell(_ok(1024, spills=nv + 8), arch="sm_86"))
    assert cell.reasons == [f"{nv + 8} B spilled > threshold {nv}"]
    allowed = evaluate(_cell(_ok(1024, spills=nv + 8), arch="sm_86"), spill_allowance=8)
    assert allowed.passed
    assert allowed.notes == [f"{nv + 8} B spilled, within the case's allowance (+8)"]
    amd = evaluate(_cell(_ok(1024, spills=1), arch="gfx942"))
    assert amd.reasons == [f"1 VGPRs spilled > threshold {SPILL_THRESHOLD['hip']}"]


def test_multi_launch_cell_names_the_failing_launch():
    cell = evaluate(_cell(_ok(1024, name="main"), _ok(GFX942_LIMIT * 2, name="reduce")))
    assert cell.reasons == [
        f"reduce: shared memory {GFX942_LIMIT * 2} B > gfx942 limit {GFX942_LIMIT} B"
    ]


def test_large_estimate_disagreement_is_a_note_not_a_failure():
    lo, hi = ESTIMATE_TOLERANCE
    compiled = 40000
    under = int(compiled / hi) - 100  # compiler needs more than the policy budgeted
    cell = evaluate(_cell(_ok(compiled, estimate=under)))
    assert cell.passed
    assert cell.notes == [
        f"policy estimate {under} B vs compiled {compiled} B (x{compiled / under:.2f})"
    ]
    within = evaluate(_cell(_ok(compiled, estimate=int(compiled / ((lo + hi) / 2)))))
    assert within.notes == []


def test_parse_targets_rejects_unknown_arch():
    assert parse_targets(["gfx942", "sm_90", "gfx942"]) == ["gfx942", "sm_90"]
    with pytest.raises(ValueError, match=r"compile: targets must be among .*; got \['sm_75'\]"):
        parse_targets(["sm_75"])


def test_kernel_filter_and_case_regex():
    cases = default_cases(["write_kv_cache"])
    assert cases and {c.kernel for c in cases} == {"write_kv_cache"}
    picked = select_cases(cases, r"hd64 bs(80|544) SHUFFLE$")
    assert [c.name for c in picked] == ["hd64 bs80 SHUFFLE", "hd64 bs544 SHUFFLE"]
    with pytest.raises(ValueError, match=r"compile: kernels must be among .*; got \['flash'\]"):
        default_cases(["flash"])


def test_case_table_covers_mla_widths_block_sizes_and_layouts():
    ids = {c.id for c in default_cases()}
    for dk, dv in ((576, 512), (320, 256), (288, 256)):
        assert {f"mla_decode/{dk}/{dv} h{h}" for h in (1, 128)} <= ids
    for bs in (16, 80, 544, 2048):
        for layout in ("NHD", "SHUFFLE"):
            assert f"paged_attention/hd256 gqa5 bs{bs} {layout} prefill" in ids
            assert f"write_kv_cache/hd128 bs{bs} {layout}" in ids
            assert f"gather_kv_cache/hd64 bs{bs} {layout}" in ids


def test_cli_usage_errors_exit_2(capsys):
    assert main(["--targets", "sm_75", "--list"]) == 2
    assert "targets must be among" in capsys.readouterr().err
    assert main(["--kernels", "write_kv_cache", "--cases", "no such case"]) == 2
    assert main(["--kernels", "write_kv_cache", "--cases", "no such case", "--list"]) == 2
    assert "no case matches the filters" in capsys.readouterr().err


def test_cli_refuses_filters_that_leave_no_cell(tmp_path, capsys):
    """HIP-only cases on an NVIDIA target: cases match but no (case, target) cell compiles, so
    the run stops before compiling instead of reporting 0 of 0 cells passed with exit 0."""
    argv = ["--kernels", "mla_decode", "--cases", " hip$", "--targets", "sm_90", "--no-png",
            "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "compile: no cell: the" in err and "compile only for hip targets" in err
    assert "--targets sm_90 has none" in err and not (tmp_path / "out").exists()
    # --list lists what the run would compile: nothing here (it listed the 26 cases, exit 0)
    assert main([*argv, "--list"]) == 2
    assert "--targets sm_90 has none" in capsys.readouterr().err
    assert (
        main(["--kernels", "mla_decode", "--cases", " hip$", "--targets", "gfx942", "--list"]) == 0
    )
    assert len(capsys.readouterr().out.split("\n")) > 1


def test_cli_a_run_whose_every_cell_is_refused_compiled_nothing_and_exits_4(tmp_path, capsys):
    """fp32 MLA 576/512 fits no gfx942 tile: the op refuses the cell, which passes the gate as
    a refusal; a run of only such cells compiled nothing and exited 0 as "1/1 cells pass"."""
    argv = ["--kernels", "mla_decode", "--cases", "576/512 h1 page16 fp32$", "--targets",
            "gfx942", "--no-png", "--jobs", "1", "--out", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    assert main(argv) == 4
    captured = capsys.readouterr()
    assert "1 refused by the op (no tile fits: nothing to compile); 0 with a" in captured.out
    assert "none of the 1 cells compiled a kernel (each refused by its op); exit status 4" in (
        captured.err
    )


def test_cli_list_applies_filters(capsys):
    assert main(["--kernels", "gather_kv_cache", "--cases", "hd256 bs2048", "--list"]) == 0
    out = capsys.readouterr().out.split()
    assert out == [
        "gather_kv_cache/hd256",
        "bs2048",
        "NHD",
        "gather_kv_cache/hd256",
        "bs2048",
        "SHUFFLE",
    ]


def test_reports_from_results(tmp_path):
    cells = [
        evaluate(_cell(_ok(32768, estimate=30000), arch="gfx942")),
        evaluate(_cell(_ok(GFX942_LIMIT * 4), arch="gfx90a")),
        evaluate(_cell(LaunchResult("k", "_k", False, error="CompilationError: x"), arch="sm_90")),
    ]
    table = summary_table(cells)
    assert "50%" in table and "400%!" in table and "ERR" in table
    assert "1/3 cells pass; 2 fail" in table
    md = markdown(cells, {"triton": "3.6.0"})
    assert "**FAIL**" in md and "## Failures" in md and "CompilationError: x" in md
    write_json(cells, str(tmp_path / "m.json"), {"wall_s": 1.0})
    data = json.loads((tmp_path / "m.json").read_text())
    assert [c["passed"] for c in data["cells"]] == [True, False, False]
    assert data["gate"]["spill_threshold"] == SPILL_THRESHOLD
    write_heatmap(cells, str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_refused_cell_is_drawn_as_refused_not_as_an_error():
    """A cell its op refuses passes the gate; the table and the Markdown drew it as ERR /
    **ERR** ("a compile or plan failure") and listed it with the policy-estimate notes."""
    refused = evaluate(_cell(plan_error="ValueError: mla_decode_tiles: no tile fits gfx942"))
    failed = evaluate(_cell(plan_error="TypeError: bad", arch="gfx950"))
    table = summary_table([refused, failed])
    assert "refused" in table.splitlines()[1] and "ERR" in table.splitlines()[1]
    md = markdown([refused, failed], {})
    assert "| refused | **ERR** |" in md
    assert "## Refused by the op (nothing to compile)" in md
    assert "## Policy estimate vs compiler" not in md


def test_an_arch_allowance_wins_over_its_vendors():
    from portattn.compile.cases import make_case

    case = dataclasses.replace(
        make_case("paged_attention", "x", print), spill_allowance=(("cuda", 8), ("sm_90", 256))
    )
    assert case.allowance("cuda", "sm_90") == 256
    assert case.allowance("cuda", "sm_86") == 8
    assert case.allowance("hip", "gfx942") == 0


def test_only_the_sm90_prefill_cases_at_head_dim_256_and_64_are_allowed_spills():
    """The sm_90 prefill kernel's head_dim-256 cases (16-bit NHD prefill with a 128-row tile of
    work: GQA 5:1 and 8:1 at 64 query tokens, not MHA's 64 rows) and its head_dim-64 cases on
    three warpgroups (GQA 8:1; GQA 5:1's query cannot come by TMA: two warpgroups, no
    allowance), on sm_90 alone: the portable tiles every other target and problem compiles keep
    no allowance."""
    from portattn.compile import default_cases
    from portattn.compile.cases import SM90_HD64_SPILL_ALLOWANCE, SM90_HD256_SPILL_ALLOWANCE

    cases = default_cases(["paged_attention"])
    allowed = {c.name: c.allowance("cuda", "sm_90") for c in cases if c.allowance("cuda", "sm_90")}
    hd256 = dict(SM90_HD256_SPILL_ALLOWANCE)["sm_90"]
    hd64 = dict(SM90_HD64_SPILL_ALLOWANCE)["sm_90"]
    assert allowed == {
        **{f"hd256 {g} bs{bs} NHD prefill": hd256 for g in ("gqa5", "gqa8")
           for bs in (16, 80, 544, 2048)},
        "hd256 gqa5 bs16 NHD prefill fp16": hd256,
        "hd256 gqa5 bs2048 NHD prefill fp16": hd256,
        **{f"hd64 gqa8 bs{bs} NHD prefill": hd64 for bs in (16, 80, 544, 2048)},
    }  # fmt: skip
    for case in cases:
        assert case.allowance("cuda", "sm_80") == case.allowance("hip", "gfx942") == 0, case.id


def test_the_mla_estimate_counts_the_buffers_the_policy_counts():
    """A 16-bit tile that prefetches its rows has num_stages - 1 KV buffers in the policy; the
    matrix's estimate counted num_stages (117504 B for sm_89 520/512 against the policy's
    84224), so its estimate notes were wrong for every such NVIDIA tile."""
    from portattn.compile.cases import build_mla_decode, policy_estimate
    from portattn.policy.mla import MlaProblem, mla_decode_tiles

    for arch in ("sm_80", "sm_89"):
        (main, *_) = build_mla_decode(TARGETS[arch], head_dim_k=576, kv_lora_rank=512,
                                      num_q_heads=16)  # fmt: skip
        assert main.args["PREFETCH_ROWS"]
        tiles = mla_decode_tiles(TARGETS[arch], MlaProblem(16, 576, 512, 2, 8, 4096, 1))
        assert policy_estimate(main) == tiles.smem_bytes
