"""The benchmark suite on a CPU: the runner's document (schema), RESULTS.md from a document, the
``--compare`` plumbing, and the suite's import layering. GPU timings are the device's business;
here the runner runs its ``--quick`` rows through the Triton interpreter."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bench.rows import row_entries, row_selected

from bench import core, results, run
from tests.test_import_graph import build_graph, find_cycles

# the `ci` extra (the CPU gate installs it); a GPU cell's environment may lack it
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "bench" / "schema.json").read_text())
FAMILY_MODULES = {f"bench.{f}" for f in run.FAMILIES}


def validate(doc: dict) -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.Draft202012Validator(SCHEMA, format_checker=jsonschema.FormatChecker()).validate(doc)


def bench_run(tmp_path: Path, *args: str) -> dict:
    """``python -m bench.run --quick ARGS`` in a child process (interpreter, CPU); its document."""
    out = tmp_path / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))  # fmt: skip
    cmd = [sys.executable, "-m", "bench.run", "--quick", "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def quick_doc(tmp_path_factory) -> dict:
    return bench_run(tmp_path_factory.mktemp("quick"))


def test_quick_run_on_cpu_follows_the_schema(quick_doc):
    validate(quick_doc)
    assert quick_doc["timing_meaningful"] is False and quick_doc["quick"] is True
    assert quick_doc["method"] == core.METHOD and quick_doc["commit"]
    # every family the CPU can run gave checked rows; the GPU-only ones say why they did not
    ran = {r["family"] for r in quick_doc["rows"]}
    assert ran == {"paged", "prefill", "mla", "cache"}
    assert {s["family"] for s in quick_doc["skipped"]} == {"host", "compile"}
    assert all(r["check"]["passed"] and r["time_us"] is not None for r in quick_doc["rows"])
    assert not quick_doc["errors"]
    # vLLM does not import here: skipped, with the reason in the document
    assert quick_doc["vllm"]["available"] is False and "vllm" in quick_doc["vllm"]["reason"]


def test_a_failed_check_has_no_time():
    doc = fixture_doc()
    doc["rows"][0]["time_us"] = 1.0
    doc["rows"][0]["check"]["passed"] = False
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)


def fixture_doc() -> dict:
    """A GPU run's document in miniature, compared against an older checkout."""

    def row(family, name, us, metrics, anchors, ratio, passed=True):
        return dict(family=family, name=name, params={}, timing="graph", metrics=metrics,
                    time_us=us if passed else None, anchors=anchors,
                    check=dict(kind="tolerance", passed=passed, error=1e-3, error_torch=2e-3),
                    compare=dict(old_time_us=100.0, ratio=ratio, old_check_passed=True,
                                 new_times_us=[us], old_times_us=[100.0]))  # fmt: skip

    ceiling = core.anchor("read ceiling (Triton stream)", 200.0, {"GB/s": 4000.0}, "graph")
    cudnn = core.anchor("SDPA cudnn", 500.0, {"TFLOP/s": 400.0}, "graph")
    flash = core.anchor("SDPA flash", None, note="backend refused: no")
    return dict(
        schema_version=1, device="NVIDIA H200", torch="2.11.0+cu130", triton="3.6.0",
        python="3.12.3", commit="abc1234", date="2026-12-04T12:00:00+00:00",
        command="python -m bench.run --compare .bench-old", method=core.METHOD,
        timing_meaningful=True, quick=False, reps=50, families=["paged", "prefill"],
        vllm=dict(available=False, reason="import vllm failed: ModuleNotFoundError"),
        compare=dict(old_src="/r/.bench-old/src", old_commit="def5678", rounds=1),
        skipped=[], errors=[],
        rows=[row("paged", "decode 64x4k 32/8/128 NHD bs16", 250.0, {"GB/s": 3200.0},
                  [ceiling], 0.98),
              row("prefill", "prefill 8x4096 32/8/128 bs16", 450.0, {"TFLOP/s": 480.0},
                  [cudnn, flash], 1.01),
              row("prefill", "mixed 8x2048+56x1@4k 32/8/128 bs16", None, {}, [], None,
                  passed=False)],
    )  # fmt: skip


def test_results_md_from_a_document(tmp_path):
    doc = fixture_doc()
    validate(doc)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    md_path = tmp_path / "RESULTS.md"
    assert results.main([str(path), "--out", str(md_path)]) == 0
    md = md_path.read_text()
    assert len(md.splitlines()) < 200
    for want in (
        "NVIDIA H200",
        "`abc1234`",
        "2026-12-04",
        core.METHOD,
        "vLLM anchor: skipped",
        "def5678",
        "## Paged decode",
        "## Pure prefill and mixed batches",
    ):
        assert want in md, want
    # anchors: a rate's share of the ceiling, a time ratio to SDPA, and why one did not run
    assert "4,000 GB/s, 80% of it" in md
    assert "row/anchor time 0.90" in md and "SDPA flash: not run (backend refused: no)" in md
    assert "| 0.980 |" in md and "**FAILED**" in md
    assert "history" in md and "session" not in md.lower()


def test_compare_times_each_row_with_both_checkouts(tmp_path):
    """The checkout against itself on one tiny row: both sides ran, and the row has its ratio."""
    doc = bench_run(tmp_path, "--only", "cache", "--rows", "page indices", "--compare", str(ROOT))
    validate(doc)
    assert doc["compare"]["old_src"] == str(ROOT / "src") and doc["compare"]["rounds"] == 1
    (r,) = doc["rows"]
    c = r["compare"]
    assert c["old_check_passed"] is True and len(c["old_times_us"]) == len(c["new_times_us"]) == 1
    assert c["ratio"] == pytest.approx(c["new_times_us"][0] / c["old_times_us"][0])


def test_compare_needs_a_portattn_checkout(tmp_path):
    with pytest.raises(SystemExit, match="no portattn/__init__.py"):
        run.src_dir(str(tmp_path))


def test_unknown_family_is_refused(capsys):
    with pytest.raises(SystemExit):
        run.parse(["--only", "paged,nope"])
    assert "unknown families ['nope']" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--only", ""], "--only must name at least one, comma-separated; got ''"),
        (["--rows", ","], "--rows must name at least one, comma-separated; got ','"),
        (["--out", "{tmp}"], "--out {tmp}: not a file this process can write"),
        (["--out", "{tmp}/a-file/r.json"], "--out {tmp}/a-file/r.json: cannot make its folder"),
    ],
)
def test_selections_and_the_output_are_checked_before_any_row_runs(argv, message, tmp_path, capsys):
    """An empty selection would run every row; an output that cannot be written would lose them
    at the end of the run."""
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit):
        run.parse([a.format(tmp=tmp_path) for a in argv])
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
    opts = run.parse(["--out", str(tmp_path / "new" / "r.json")])
    assert (tmp_path / "new").is_dir() and opts.rows == "" and opts.families == run.FAMILIES


def test_bench_layers_and_no_import_cycle():
    """bench/ has no import cycle; a family imports only the shared layers (core, inputs), never
    another family or the runner; core and results import no bench module but the rows rule
    (bench.rows, which imports none), and results nothing else of the project (no torch)."""
    graph = build_graph()
    assert not [c for c in find_cycles(graph) if c[0].source.startswith("bench")]
    for mod, edges in graph.items():
        targets = {e.target for e in edges if e.target.startswith("bench")}
        if mod in FAMILY_MODULES:
            assert targets <= {"bench.core", "bench.inputs"}, (mod, targets)
        if mod in ("bench.core", "bench.inputs", "bench.results"):
            assert targets <= {"bench.rows"}, (mod, targets)
    assert {e.target for e in graph["bench.results"]} == {"bench.rows"}
    assert not {e.target for e in graph["bench.rows"]}


def test_check_windows_and_work_counts():
    seqs = ((4096, 2048),) * 2 + ((4096, 1),) * 3
    assert core.check_windows(seqs, 128) == [(0, 0, 128), (0, 1920, 128), (1, 1920, 128),
                                             (2, 0, 1), (4, 0, 1)]  # fmt: skip
    assert core.check_windows(((40, 1),), 128) == [(0, 0, 1)]
    # pure causal prefill of n tokens: n (n + 1) / 2 pairs, 4 flops a pair, head and dim
    assert core.paged_flops(((4, 4),), 2, 8) == 4 * 2 * 8 * 10
    assert core.paged_bytes(((10, 1),), 4, 2, 8, 2) == 2 * 10 * 2 * 8 * 2 + 2 * 4 * 8 * 2
    assert core.rate(1e9, 1e6, 1e9) == 1.0 and core.rate(1.0, None, 1.0) is None


def test_results_md_says_forced_policy_rows_are_not_amd_speed(tmp_path):
    """A row run with another target's policy forced gets the page's plain statement that it
    is not that target's speed; a table without such rows gets none."""
    doc = fixture_doc()
    md = results.render(doc)
    assert "absolute AMD speed is unmeasured" not in md
    doc["rows"][0]["params"] = dict(doc["rows"][0]["params"], policy="gfx942")
    md = results.render(doc)
    assert "(gfx942): that target's policy forced" in md
    assert "absolute AMD speed is unmeasured until an AMD GPU runs the rocm cells" in md


def test_results_md_merges_runs_of_one_tree(tmp_path):
    """A suite split over GPU calls: a later run's row replaces the earlier one of its name,
    every run is listed, and runs of different trees are refused by name."""
    a = fixture_doc()
    b = fixture_doc()
    b["families"], b["date"], b["command"] = ["prefill"], "2026-12-04T13:00:00+00:00", "again"
    b["compare"] = dict(old_src="/r/.bench-old/src", old_commit="def5678", rounds=3)
    b["rows"] = [dict(b["rows"][1], time_us=440.0)]
    paths = []
    for name, doc in (("a", a), ("b", b)):
        validate(doc)
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    md_path = tmp_path / "RESULTS.md"
    assert results.main([*map(str, paths), "--out", str(md_path)]) == 0
    md = md_path.read_text()
    assert "2 runs of one tree" in md and "`again`" in md and "3 round(s) a side" in md
    assert "| 440.0 |" in md and "| 450.0 |" not in md
    assert md.count("prefill 8x4096 32/8/128 bs16") == 1 and "## Paged decode" in md
    b["commit"] = "fff0000"
    paths[1].write_text(json.dumps(b))
    with pytest.raises(SystemExit, match="differs from run 1 in commit"):
        results.main([*map(str, paths)])
    # across trees: merged, each run with its commit, each row with its run
    assert results.main([*map(str, paths), "--across-trees", "--out", str(md_path)]) == 0
    md = md_path.read_text()
    assert "2 runs of several trees" in md and "- Commit: `fff0000` (the newest" in md
    assert f"Run 1, {a['date']} at `{a['commit']}`" in md and "Run 2, " in md
    row_b = next(line for line in md.splitlines() if "prefill 8x4096 32/8/128 bs16" in line)
    assert row_b.endswith("| 2 |") and "| 440.0 |" in row_b
    row_a = next(line for line in md.splitlines() if line.startswith("| decode"))
    assert row_a.endswith("| 1 |")
    b["device"] = "NVIDIA H100"
    paths[1].write_text(json.dumps(b))
    with pytest.raises(SystemExit, match="differs from run 1 in device"):
        results.main([*map(str, paths), "--across-trees"])


def test_a_later_run_of_a_family_drops_its_earlier_failure():
    """A family that failed in one run and ran again later: the later run stands (its rows, no
    failure line); a failure of a family no later run ran stays."""
    a, b = fixture_doc(), fixture_doc()
    a["families"] = ["paged", "prefill", "compile", "host"]
    a["errors"] = [dict(family="compile", error="RuntimeError: child failed"),
                   dict(family="host", error="RuntimeError: host failed")]  # fmt: skip
    b["families"], b["date"], b["rows"] = ["compile"], "2026-12-04T13:00:00+00:00", []
    for doc in (a, b):
        validate(doc)
    merged = results.merge([a, b])
    assert merged["errors"] == [dict(family="host", error="RuntimeError: host failed")]
    md = results.render(merged)
    assert "Family `compile` failed" not in md and "Family `host` failed" in md
    # the other order: the later run's failure stands
    b["errors"] = [dict(family="compile", error="RuntimeError: again")]
    assert [e["error"] for e in results.merge([a, b])["errors"]] == [
        "RuntimeError: host failed", "RuntimeError: again"]  # fmt: skip


def _write(tmp_path: Path, name: str, doc: dict) -> str:
    validate(doc)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_runs_merge_oldest_first_whatever_their_order_on_the_command_line(tmp_path, capsys):
    """`bench.results new.json old.json` let the older row replace the newer one and called the
    older commit the newest run's; a date that is no ISO date-time is refused by name."""
    old, new = fixture_doc(), fixture_doc()
    new["date"], new["commit"] = "2026-12-05T09:00:00+00:00", "new1234"
    new["rows"] = [dict(new["rows"][0], time_us=180.0)]
    out = tmp_path / "R.md"
    argv = [_write(tmp_path, "new", new), _write(tmp_path, "old", old), "--across-trees"]
    assert results.main([*argv, "--out", str(out)]) == 0
    text = out.read_text()
    decode = next(line for line in text.splitlines() if line.startswith("| decode"))
    assert "| 180.0 |" in decode and "- Commit: `new1234` (the newest run's" in text
    # a page holding the newer row refuses the older run's
    page = tmp_path / "P.md"
    assert results.main([_write(tmp_path, "n2", new), "--out", str(page)]) == 0
    with pytest.raises(SystemExit, match=r"the run of 2026-12-04T12:00:00\+00:00 would replace "
                       r"row 'decode 64x4k 32/8/128 NHD bs16', which the page holds from a "
                       r"later run \(2026-12-05T09:00:00\+00:00\)"):  # fmt: skip
        results.main([_write(tmp_path, "o2", old), "--page", str(page), "--out", str(out)])
    for date in ("last tuesday", "2026-12-04 12:00:00"):
        bad = dict(fixture_doc(), date=date)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))  # (the schema's date-time format is not enforced)
        with pytest.raises(SystemExit, match=f"bad.json: date must be an ISO date-time with its "
                           f"zone .*; got '{date}'"):  # fmt: skip
            results.main([str(path), "--out", str(out)])


def test_a_vllm_anchor_measured_by_an_earlier_run_is_not_called_skipped():
    a, b = fixture_doc(), dict(fixture_doc(), date="2026-12-05T09:00:00+00:00")
    a["vllm"] = dict(available=True, reason="")
    md = results.render(results.merge([a, b]))
    assert "- vLLM anchor: measured" in md and "skipped: import vllm failed" not in md


def test_runs_of_unknown_commits_are_not_taken_for_one_tree():
    a, b = fixture_doc(), dict(fixture_doc(), date="2026-12-05T09:00:00+00:00")
    a["commit"] = b["commit"] = "unknown"
    with pytest.raises(SystemExit, match="a run's commit is unknown.*--across-trees"):
        results.merge([a, b])
    assert len(results.merge([a, b], across_trees=True)["runs"]) == 2


def test_a_quick_run_merges_with_no_full_run(tmp_path):
    full, quick = fixture_doc(), dict(fixture_doc(), quick=True, date="2026-12-05T09:00:00+00:00")
    with pytest.raises(SystemExit, match="run 2 differs from run 1 in quick"):
        results.merge([full, quick])


def test_an_old_sides_failure_clears_when_its_family_runs_again():
    """A `--compare` run's old-side failure (`paged (old)`) stood on every later page."""
    a, b = fixture_doc(), fixture_doc()
    a["errors"] = [dict(family="paged (old)", error="RuntimeError: old side failed")]
    b["date"], b["families"], b["compare"] = "2026-12-05T09:00:00+00:00", ["paged"], None
    b["rows"] = [dict(b["rows"][0])]
    del b["rows"][0]["compare"]
    assert results.merge([a, b])["errors"] == []


def test_a_row_timed_eagerly_says_so():
    """The method says a row that could not be captured in a graph says so; no row did."""
    doc = fixture_doc()
    doc["rows"][0]["timing"] = "eager (graph capture failed: operation not permitted)"
    line = next(x for x in results.render(doc).splitlines() if x.startswith("| decode"))
    assert "| 250.0 (eager) |" in line
    assert "(eager)" not in results.render(fixture_doc())


def test_a_failed_row_shows_no_timing_range():
    doc = fixture_doc()
    doc["rows"] = [dict(doc["rows"][2], round_times_us=[1.0, 3.0])]  # failed in one round
    doc["compare"] = None
    del doc["rows"][0]["compare"]
    line = next(x for x in results.render(doc).splitlines() if x.startswith("| mixed"))
    assert "**FAILED** | - |" in line and "1.0-3.0" not in line


def test_results_merge_new_runs_into_a_page(tmp_path):
    """A page whose run documents are gone takes a new run: the new run's rows replace the page's
    of the same name in place, the page's other rows stay exactly as written, a run no row names
    any more is dropped, the runs are numbered again; a page of another device, or one that is
    not a page of several runs, is refused by name."""
    a, b = fixture_doc(), fixture_doc()
    b["commit"], b["date"], b["command"] = "bbb2222", "2026-12-04T13:00:00+00:00", "again"
    b["rows"] = [dict(b["rows"][1], time_us=440.0)]
    page = tmp_path / "RESULTS.md"
    assert results.main([_write(tmp_path, "a", a), _write(tmp_path, "b", b), "--across-trees",
                         "--out", str(page)]) == 0  # fmt: skip
    before = page.read_text().splitlines()
    kept = next(line for line in before if line.startswith("| prefill 8x4096"))
    c = fixture_doc()
    c["commit"], c["date"], c["command"] = "ccc3333", "2026-12-05T09:00:00+00:00", "third"
    c["compare"] = None  # a run without --compare: its rows have no new/old
    c["rows"] = [dict(c["rows"][0], time_us=230.0), c["rows"][2]]  # decode, and mixed run again
    for r in c["rows"]:
        del r["compare"]
    out = tmp_path / "NEW.md"
    assert results.main([_write(tmp_path, "c", c), "--page", str(page), "--out", str(out)]) == 0
    after = out.read_text().splitlines()
    # run a (abc1234) has no row left: dropped; b is run 1 now, c run 2
    assert not any("`abc1234`" in line for line in after)
    assert any(line.startswith("- Run 1, 2026-12-04T13:00:00+00:00 at `bbb2222`: `again`")
               for line in after)  # fmt: skip
    assert any(line.startswith("- Run 2, 2026-12-05T09:00:00+00:00 at `ccc3333`: `third`")
               for line in after)  # fmt: skip
    assert "- Commit: `ccc3333` (the newest run's" in out.read_text()
    # the kept row as the page wrote it, its run renumbered; the new rows in their places
    assert kept.rsplit("|", 2)[0] + "| 1 |" in after

    def names(lines):
        rows = [line for line in lines if line.startswith(("| decode", "| prefill", "| mixed"))]
        return [line.split(" | ")[0] for line in rows]

    assert names(after) == names(before)
    decode, mixed = (next(line for line in after if line.startswith(f"| {n}"))
                     for n in ("decode", "mixed"))  # fmt: skip
    assert "| 230.0 |" in decode and decode.endswith("| - | 2 |") and mixed.endswith("| 2 |")
    # the merged page is a page too: merging the same run again changes nothing
    again = tmp_path / "AGAIN.md"
    assert results.main([str(tmp_path / "c.json"), "--page", str(out), "--out", str(again)]) == 0
    assert again.read_text() == out.read_text()
    c["device"] = "NVIDIA H100"
    with pytest.raises(SystemExit, match="the runs differ from the page in device"):
        results.main([_write(tmp_path, "c", c), "--page", str(page)])
    broken = tmp_path / "BROKEN.md"  # a row with a cell too few
    broken.write_text(page.read_text().replace(" | 1 |\n", " |\n", 1))
    with pytest.raises(SystemExit, match=f"--page {broken}: not a page of several runs: line "
                       r"\d+: a row of 6 cells .* names each row's run"):  # fmt: skip
        results.main([str(tmp_path / "b.json"), "--page", str(broken)])
    with pytest.raises(SystemExit, match="--page .*missing.md: cannot read"):
        results.main([str(tmp_path / "b.json"), "--page", str(tmp_path / "missing.md")])


def test_a_quick_run_is_not_merged_into_a_page(tmp_path):
    """A GPU --quick smoke run (tiny shapes) merged into the device's page as if measured."""
    page = tmp_path / "RESULTS.md"
    assert results.main([_write(tmp_path, "a", fixture_doc()), "--out", str(page)]) == 0
    quick = fixture_doc()
    quick["quick"] = True
    path = _write(tmp_path, "q", quick)
    with pytest.raises(SystemExit) as info:
        results.main([path, "--page", str(page), "--out", str(tmp_path / "NEW.md")])
    assert str(info.value) == (f"bench.results: {path}: a --quick run (a smoke test of tiny "
                               f"shapes) is not merged into a page (--page {page})")  # fmt: skip
    assert not (tmp_path / "NEW.md").exists()
    assert results.main([path, "--out", str(tmp_path / "QUICK.md")]) == 0  # a page of its own


def test_results_merge_a_run_into_a_page_of_one_tree(tmp_path):
    """A page of one tree (runs unnumbered, no run column) takes a run of another tree: each
    kept row belongs to the last of the page's runs whose command ran its family, and the
    merged page names every row's run; a row no run of the page ran is refused by name."""
    a, p = fixture_doc(), fixture_doc()
    a["commit"], a["command"] = "aaa1111", "python -m bench.run --only paged"
    a["families"], a["rows"] = ["paged"], [r for r in a["rows"] if r["family"] == "paged"]
    p["commit"], p["date"] = "aaa1111", "2026-12-04T13:00:00+00:00"
    p["command"] = "python -m bench.run --only prefill"
    p["families"], p["rows"] = ["prefill"], [r for r in p["rows"] if r["family"] == "prefill"]
    page = tmp_path / "ONE.md"
    assert results.main([_write(tmp_path, "a", a), _write(tmp_path, "p", p),
                         "--out", str(page)]) == 0  # fmt: skip
    assert "2 runs of one tree" in page.read_text()
    c = fixture_doc()
    c["commit"], c["date"], c["command"] = "ccc3333", "2026-12-05T09:00:00+00:00", "third"
    c["families"], c["rows"] = ["prefill"], [dict(p["rows"][0], time_us=999.0)]
    out = tmp_path / "NEW.md"
    assert results.main([_write(tmp_path, "c", c), "--page", str(page), "--out", str(out)]) == 0
    text = out.read_text()
    assert re.search(r"^- Run 1, \S+ at `aaa1111`: `python -m bench.run --only paged`", text, re.M)
    assert re.search(r"^- Run 2, 2026-12-04T13:00:00\+00:00 at `aaa1111`: `python -m bench.run "
                     r"--only prefill`", text, re.M)  # fmt: skip
    assert re.search(r"^- Run 3, 2026-12-05T09:00:00\+00:00 at `ccc3333`: `third`", text, re.M)
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines()
            if line.startswith(("| decode", "| prefill", "| mixed"))}  # fmt: skip
    runs = {n: line.rsplit("|", 2)[1].strip() for n, line in rows.items()}
    # the paged rows: the page's --only paged run; the prefill row run again: the new run
    assert {runs[r["name"]] for r in a["rows"]} == {"1"}
    assert runs[p["rows"][0]["name"]] == "3" and "| 999.0 |" in rows[p["rows"][0]["name"]]
    assert all(runs[r["name"]] == "2" for r in p["rows"][1:])
    orphan = tmp_path / "ORPHAN.md"  # a table no run of the page ran
    orphan.write_text(page.read_text().replace("--only paged", "--only cache"))
    with pytest.raises(SystemExit, match=r"row '.*' of family 'paged', which no run of the page"):
        results.main([str(tmp_path / "c.json"), "--page", str(orphan)])


def test_a_one_tree_page_credits_each_row_to_the_run_its_rows_filter_ran(tmp_path):
    """A page of one tree: a later run of the same family that ran one row (``--rows``) owns
    that row only; the family's other rows stay with the run that measured them (they were
    credited to the later run, whose date then guarded them)."""
    a, b = fixture_doc(), fixture_doc()
    paged = [r for r in a["rows"] if r["family"] == "paged"]
    paged.append(dict(paged[0], name=paged[0]["name"] + " again"))  # its name holds the first's
    a["command"], a["families"], a["rows"] = "python -m bench.run --only paged", ["paged"], paged
    one = paged[0]["name"]
    b["date"] = "2026-12-04T13:00:00+00:00"
    b["command"] = f"python -m bench.run --only paged --rows '={one},nothing else'"
    b["families"], b["rows"] = ["paged"], [dict(paged[0], time_us=111.0)]
    page = tmp_path / "ONE.md"
    assert results.main([_write(tmp_path, "a", a), _write(tmp_path, "b", b),
                         "--out", str(page)]) == 0  # fmt: skip
    assert "2 runs of one tree" in page.read_text() and "| run |" not in page.read_text()
    got = results.read_page(page.read_text())
    runs = {r["name"]: r["run"] for r in got["rows"]}
    assert runs[one] == 2 and {runs[r["name"]] for r in paged[1:]} == {1}
    # the --rows=... form and an exact entry that names no row of the page
    text = page.read_text().replace(f"--rows '={one},nothing else'", "--rows==nothing")
    with pytest.raises(results.PageError, match="of family 'paged', which no run of the page"):
        results.read_page(text.replace("--only paged`", "--only cache`", 1))
    assert {r["run"] for r in results.read_page(text)["rows"]} == {1}


def test_a_pages_failures_and_skips_stand_until_their_family_runs_again(tmp_path):
    """Merging a run of another family into a page keeps the page's failure and skip lines
    (they were dropped, and the failed family vanished from the page); a run of that family
    replaces them."""
    a, b = fixture_doc(), fixture_doc()
    a["families"] = ["paged", "prefill", "compile", "host"]
    a["errors"] = [dict(family="compile", error="RuntimeError: child failed")]
    a["skipped"] = [dict(family="host", reason="no GPU")]
    b["commit"], b["date"], b["rows"] = "bbb2222", "2026-12-04T13:00:00+00:00", b["rows"][:1]
    page = tmp_path / "RESULTS.md"
    assert results.main([_write(tmp_path, "a", a), _write(tmp_path, "b", b), "--across-trees",
                         "--out", str(page)]) == 0  # fmt: skip
    fail = "- **Family `compile` failed**: RuntimeError: child failed"
    skip = "- Family `host` skipped: no GPU"
    assert fail in page.read_text() and skip in page.read_text()
    c = fixture_doc()
    c["commit"], c["date"], c["families"] = "ccc3333", "2026-12-05T09:00:00+00:00", ["paged"]
    c["rows"] = c["rows"][:1]
    out = tmp_path / "NEW.md"
    assert results.main([_write(tmp_path, "c", c), "--page", str(page), "--out", str(out)]) == 0
    assert fail in out.read_text() and skip in out.read_text()
    d = dict(fixture_doc(), commit="ddd4444", date="2026-12-05T10:00:00+00:00",
             families=["compile"], rows=[])  # fmt: skip
    again = tmp_path / "AGAIN.md"
    assert results.main([_write(tmp_path, "d", d), "--page", str(out), "--out", str(again)]) == 0
    assert fail not in again.read_text() and skip in again.read_text()


def test_a_run_labelled_by_a_stale_head_takes_its_trees_commit(tmp_path):
    """A GPU machine's copy of the checkout may keep an older .git: its runs are labelled
    ``<older HEAD>+tree:<hash>``. The page names the commit whose tree that is; a label no
    commit matches, and a plain commit, stay as they are."""
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args: str) -> str:
        cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
        done = subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True)
        return done.stdout.strip()

    git("init", "-q")
    (repo / "f").write_text("1")
    git("add", "-A")
    git("commit", "-qm", "one")
    old = git("rev-parse", "--short", "HEAD")
    (repo / "f").write_text("2")
    git("add", "-A")
    git("commit", "-qm", "two")
    new, tree = git("rev-parse", "--short", "HEAD"), git("rev-parse", "HEAD^{tree}")
    unknown = f"{old}+tree:{'0' * 12}"
    docs = [dict(commit=f"{old}+tree:{tree[:12]}"), dict(commit=unknown), dict(commit=old)]
    results.resolve_commits(docs, repo)
    assert [d["commit"] for d in docs] == [new, unknown, old]
    assert results.tree_commits(tmp_path / "nowhere") == {}


def test_an_exported_tree_names_its_commit(tmp_path):
    """An old tree exported inside this repository is not its HEAD: its COMMIT file names it,
    and without one it is unknown (not this checkout's commit)."""
    old = ROOT / "build" / "bench-commit-probe"
    old.mkdir(parents=True, exist_ok=True)
    try:
        assert run.commit_of(str(old), from_env=False) == "unknown"
        (old / "COMMIT").write_text("e34392a\n")
        assert run.commit_of(str(old), from_env=False) == "e34392a"
    finally:
        shutil.rmtree(old)


def test_rounds_without_compare_keep_each_rows_median_round(tmp_path):
    """``--rounds 2`` alone: each family ran twice in fresh processes; a row is its median round
    (the lower one of two), every round's time listed, and RESULTS.md says so."""
    doc = bench_run(tmp_path, "--only", "cache", "--rows", "page indices", "--rounds", "2")
    validate(doc)
    assert doc["rounds"] == 2 and doc["compare"] is None
    (r,) = doc["rows"]
    assert len(r["round_times_us"]) == 2 and r["time_us"] == min(r["round_times_us"])
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))
    md = tmp_path / "RESULTS.md"
    assert results.main([str(path), "--out", str(md)]) == 0
    text = md.read_text()
    assert "each row the median of 2 rounds in fresh processes" in text
    lo, hi = min(r["round_times_us"]), max(r["round_times_us"])
    assert f"({results._num(lo)}-{results._num(hi)})" in text  # the rounds' range


def test_compare_rounds_keep_one_whole_round():
    """``--rounds N``: a side's row is one real round, its median (the lower middle one for an
    even N), so its metrics are those of the time it reports; a round that failed its check
    makes the row fail."""
    from bench.run import _median_round

    def row(us):
        return dict(time_us=us, metrics={"host µs/call": us})

    assert _median_round([row(3.0), row(1.0), row(2.0)]) == row(2.0)
    assert _median_round([row(114.0), row(95.4)]) == row(95.4)
    assert _median_round([row(None), row(7.0)]) == row(7.0)
    assert _median_round([]) is None
    # a round that failed its check is the row, whatever the others timed
    failed = dict(time_us=None, metrics={}, check=dict(passed=False))
    passed = dict(row(2.0), check=dict(passed=True))
    assert _median_round([passed, failed, passed]) == failed


def test_a_rows_filter_that_matches_nothing_is_an_error(tmp_path, monkeypatch, capsys):
    """Not an empty document that passes: the filter names the rows by substring, and is
    checked against the families' row names before any row runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "r.json"
    argv = ["--quick", "--only", "host", "--rows", "no such row", "--out", str(out)]
    with pytest.raises(SystemExit) as info:
        run.main(argv)
    assert info.value.code == 2 and not out.exists()
    assert "no row matches --rows 'no such row' in ['host']" in capsys.readouterr().err


def test_row_names_are_the_names_of_the_rows_that_run(quick_doc):
    """``--rows`` is checked against each family's ``names``: they must be its rows' names."""
    ran: dict[str, list[str]] = {}
    for r in quick_doc["rows"]:
        ran.setdefault(r["family"], []).append(r["name"])
    assert run.row_names(ran, quick=True) == ran


class _Asked(core.Context):
    """A context that runs no row: it notes every name a family asks about."""

    def __init__(self, quick: bool):
        super().__init__("cpu", quick=quick)
        self.asked: list[str] = []

    def want(self, name: str) -> bool:
        self.asked.append(name)
        return False


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("family", ["paged", "prefill", "mla", "cache"])
def test_row_names_are_the_names_each_family_asks_about(family, quick):
    """The full-size names too (a GPU's rows, which a CPU cannot run): a ``--rows`` filter
    refused against a stale ``names`` would stop a GPU run before it starts."""
    import importlib

    module = importlib.import_module(f"bench.{family}")
    ctx = _Asked(quick)
    assert list(module.rows(ctx)) == []
    assert module.names(quick) == ctx.asked


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--only", "host,compile"], "--only host,compile: no family runs here (host: host "),
        (["--only", "host,cache", "--rows", "host"],
         "--rows 'host' matches only rows of families that do not run here (host: "),
    ],
)  # fmt: skip
def test_a_run_that_can_measure_nothing_here_writes_no_document(argv, message, tmp_path):
    """On a CPU the host and compile families are skipped: a run of only those would write a
    document with no rows and exit 0."""
    out = tmp_path / "r.json"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))  # fmt: skip
    cmd = [sys.executable, "-m", "bench.run", "--quick", "--out", str(out), *argv]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2 and not out.exists(), proc.stderr
    assert proc.stderr.startswith(f"bench.run: {message}") and "Traceback" not in proc.stderr


def test_a_run_whose_families_all_failed_writes_no_document(tmp_path, monkeypatch, capsys):
    """Every family raised before its first row (here: the family run replaced by its result)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    failed = dict(rows=[], skipped=[], errors=[dict(family="cache", error="RuntimeError: x")])
    monkeypatch.setattr(run, "run_families", lambda families, ctx: failed)
    out = tmp_path / "r.json"
    assert run.main(["--quick", "--only", "cache", "--out", str(out)]) == 1
    assert not out.exists()
    assert "bench.run: no row was measured; no document written" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "cannot read a results document ([Errno 2]"),
        ("{not json", "cannot read a results document (Expecting property name"),
        ("[]", "schema_version must be 1; got 'list'"),
        ('{"schema_version": 2}', "schema_version must be 1; got 2"),
        ('{"schema_version": 1, "rows": []}', "not a results document of bench/schema.json at"),
    ],
)
def test_results_names_a_document_it_cannot_use(text, message, tmp_path):
    """Instead of a traceback (or a KeyError deep in the table) for a file bench.run never wrote."""
    path = tmp_path / "doc.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as info:
        results.main([str(path)])
    assert str(info.value).startswith(f"bench.results: {path}: {message}"), info.value


def test_rounds_report_what_any_round_found(monkeypatch):
    """A child that crashes in a later round is an error of the run, and a row its first round
    lost is still a row (each round's child process is replaced by its result here: the rounds'
    bookkeeping is what is under test; `test_rounds_without_compare_...` runs real children)."""
    results = iter([
        dict(rows=[], skipped=[], errors=[dict(family="cache", error="child exited -11")]),
        dict(rows=[dict(name="a", time_us=3.0, check=dict(passed=True))], skipped=[],
             errors=[]),
        dict(rows=[dict(name="a", time_us=1.0, check=dict(passed=True))], skipped=[],
             errors=[dict(family="cache", error="child exited -11")]),
    ])  # fmt: skip
    monkeypatch.setattr(run, "run_child", lambda fam, src, opts: next(results))
    opts = run.parse(["--only", "cache", "--rounds", "3"])
    merged, record = run.run_rounds(["cache"], opts)
    assert record is None
    assert merged["errors"] == [dict(family="cache", error="child exited -11")]
    (row,) = merged["rows"]
    assert row["round_times_us"] == [3.0, 1.0] and row["time_us"] == 1.0


def _anchor_time_zero(doc):
    doc["rows"][1]["anchors"][0]["time_us"] = 0  # SDPA cuDNN: the row's time is divided by it


def _passed_tolerance_without_error(doc):
    doc["rows"][0]["check"].update(error=None, error_torch=1)


def _huge_time(doc):
    doc["rows"][0]["time_us"] = 10**400


def _huge_metric(doc):
    doc["rows"][0]["metrics"]["GB/s"] = 10**400


def _policy_list(doc):
    doc["rows"][0]["params"]["policy"] = ["gfx942"]


def _policy_int_and_str(doc):
    doc["rows"][0]["params"]["policy"] = 942
    doc["rows"][1]["params"]["policy"] = "gfx942"


@pytest.mark.parametrize(
    ("spoil", "where", "rule"),
    [
        (_anchor_time_zero, "rows/1/anchors/0/time_us", "0 is less than or equal to the minimum"),
        (_passed_tolerance_without_error, "rows/0/check/error", "None is not of type 'number'"),
        (_huge_time, "rows/0/time_us", "is greater than the maximum of 1000000000000.0"),
        (_huge_metric, "rows/0/metrics/GB/s", "is greater than the maximum"),
        (_policy_list, "rows/0/params/policy", "['gfx942'] is not of type 'string'"),
        (_policy_int_and_str, "rows/0/params/policy", "942 is not of type 'string'"),
    ],
)
def test_results_refuses_meaningless_values_by_document_row_and_field(spoil, where, rule,
                                                                      tmp_path):  # fmt: skip
    """Values the schema used to pass and the table then crashed on (a zero time divided by,
    a number past a float's range, a policy that is no name): refused where they are."""
    doc = fixture_doc()
    spoil(doc)
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)
    with pytest.raises(SystemExit) as info:
        results.main([str(path)])
    message = str(info.value)
    assert message.startswith(f"bench.results: {path}: not a results document of bench/schema.json"
                              f" at {where}: ") and rule in message, message  # fmt: skip
    assert len(message) < 400 and "\n" not in message


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("field", ["time", "metric", "anchor"])
def test_results_refuses_a_non_finite_number_by_document_and_field(value, field, tmp_path):
    """JSON's NaN passed every bound of the schema (each comparison with NaN is false) and was
    written into the page as "nan"."""
    doc = fixture_doc()
    target, key, where = {
        "time": (doc["rows"][0], "time_us", "rows/0/time_us"),
        "metric": (doc["rows"][0]["metrics"], "GB/s", "rows/0/metrics/GB/s"),
        "anchor": (doc["rows"][1]["anchors"][0], "time_us", "rows/1/anchors/0/time_us"),
    }[field]
    target[key] = value
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))  # json writes NaN and Infinity by default
    with pytest.raises(SystemExit) as info:
        results.main([str(path)])
    assert str(info.value) == f"bench.results: {path}: {where} is {value}, not a finite number"


@pytest.mark.parametrize(
    ("spoil", "shown"),
    [(_anchor_time_zero, True), (_passed_tolerance_without_error, True), (_huge_time, False),
     (_huge_metric, False), (_policy_list, "rows/0/params/policy is list, not string"),
     (_policy_int_and_str, "rows/0/params/policy is int, not string")],
)  # fmt: skip
def test_results_without_jsonschema_renders_or_names_the_row(spoil, shown, tmp_path, monkeypatch,
                                                             capsys):  # fmt: skip
    """The GPU machines may lack jsonschema: the table shows what it can, names the place of a
    value of the wrong type, and names the row of a value it cannot show, instead of a
    traceback."""
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # import jsonschema fails here
    doc = fixture_doc()
    spoil(doc)
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    paths[0].write_text(json.dumps(fixture_doc()))
    paths[1].write_text(json.dumps(doc))
    if shown is True:
        assert results.main([*map(str, paths)]) == 0
        return
    with pytest.raises(SystemExit) as info:
        results.main([*map(str, paths)])
    if isinstance(shown, str):
        assert str(info.value) == (f"bench.results: {paths[1]}: not a results document of "
                                   f"bench/schema.json: {shown} (checked without jsonschema: "
                                   "keys and types only)")  # fmt: skip
        return
    # the row came from the second document: that document and the row are named
    row = "row 'decode 64x4k 32/8/128 NHD bs16' (paged)"
    assert str(info.value).startswith(f"bench.results: {paths[1]}: {row}: OverflowError: int ")


@pytest.mark.parametrize(
    ("out", "message"),
    [("{tmp}", "--out {tmp}: must be a file in an existing folder"),
     ("{tmp}/nonexistent/x.md", "--out {tmp}/nonexistent/x.md: must be a file in an existing")],
)  # fmt: skip
def test_results_checks_its_output_before_reading(out, message, tmp_path, capsys):
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(fixture_doc()))
    with pytest.raises(SystemExit) as info:
        results.main([str(path), "--out", out.format(tmp=tmp_path)])
    assert info.value.code == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


def test_empty_paths_and_a_document_without_rows_are_refused(tmp_path, capsys):
    """An unset variable's "" is no path (``--page ""`` replaced the page with the new run
    alone, ``--compare ""`` ran no comparison, ``--out ""`` printed); a document with no row
    and no failure is no finished run."""
    doc = _write(tmp_path, "a", fixture_doc())
    for option in ("--page", "--out"):
        with pytest.raises(SystemExit):
            results.main([doc, option, ""])
        assert f"--{option[2:]} must name a file; got ''" in capsys.readouterr().err
    for option in ("--compare", "--out"):
        with pytest.raises(SystemExit):
            run.parse(["--quick", option, " "])
        assert f"--{option[2:]} must name a path; got ' '" in capsys.readouterr().err
    empty = _write(tmp_path, "e", dict(fixture_doc(), rows=[], errors=[]))
    with pytest.raises(SystemExit, match="no row and no failure"):
        results.main([empty])


def test_every_part_of_rows_must_match_a_row(capsys):
    """A typo in one part of ``--rows`` was dropped without a word."""
    opts = run.parse(["--quick", "--only", "cache", "--rows", "page indices"])
    assert opts.rows == "page indices"
    with pytest.raises(SystemExit):
        run.parse(["--quick", "--only", "cache", "--rows", "page indices,pgae idx"])
    assert "--rows: ['pgae idx'] match no row in ['cache']" in capsys.readouterr().err


def test_an_entry_with_a_leading_equals_selects_one_row_by_its_whole_name(capsys):
    """A substring selects every row that holds it (the 16-head 4k q1 row's name is held by the
    HIP tiles' q1 rows and the 520-wide cache's row too); ``=NAME`` selects that row alone, and
    names no row but a whole name."""
    names = run.row_names(["mla"], quick=False)
    q1 = "mla 16h 64x4k page64 q1"
    assert run._matching(names, q1) == [
        q1, f"{q1} gfx942 tiles", f"{q1} gfx950 tiles", f"{q1} 520/512"
    ]  # fmt: skip
    assert run._matching(names, f"={q1}") == [q1]
    assert run._matching(names, f"={q1},=mla 8h 64x4k page64 q2") == [
        q1, "mla 8h 64x4k page64 q2"
    ]  # fmt: skip
    assert row_selected("mla 128h 64x4k page64 q1", "8h")
    assert not row_selected("mla 128h 64x4k page64 q1", "=8h")
    opts = run.parse(["--only", "mla", "--rows", f"={q1}"])
    ctx = core.Context("cpu", only_rows=row_entries(opts.rows))
    assert [n for n in names["mla"] if ctx.want(n)] == [q1]
    with pytest.raises(SystemExit):
        run.parse(["--only", "mla", "--rows", f"{q1},=mla 16h 64x4k"])
    assert "--rows: ['=mla 16h 64x4k'] match no row in ['mla']" in capsys.readouterr().err


def test_a_gpu_run_under_the_interpreter_is_refused(monkeypatch):
    """TRITON_INTERPRET on (any value Triton reads as on) where a GPU is: the rows would be
    interpreter timings recorded as GPU ones."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "true")
    with pytest.raises(SystemExit, match="TRITON_INTERPRET is on and a GPU is here"):
        run.main(["--quick", "--only", "cache"])


def test_an_existing_out_file_that_cannot_be_written_is_refused_first(tmp_path, monkeypatch,
                                                                      capsys):  # fmt: skip
    """Refused before any row runs (it was found after all of them, by a traceback)."""
    out = tmp_path / "bench.json"
    out.write_text("{}")
    real = os.access
    monkeypatch.setattr(run.os, "access", lambda p, m: False if str(p) == str(out) else real(p, m))
    with pytest.raises(SystemExit):
        run.parse(["--quick", "--out", str(out)])
    assert "not a file this process can write" in capsys.readouterr().err


def test_the_cpu_needs_quick_shapes_and_a_page_must_be_text(tmp_path, monkeypatch, capsys):
    """Full-size rows in the interpreter ran for hours printing nothing; a binary --page gave
    a UnicodeDecodeError traceback."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit, match="the interpreter runs --quick's shapes only"):
        run.main(["--only", "cache"])
    page = tmp_path / "bin.md"
    page.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(SystemExit, match="not UTF-8 text"):
        results.main([_write(tmp_path, "a", fixture_doc()), "--page", str(page)])


def _compared(doc):
    doc["compare"] = {"old_src": "/old/src", "old_commit": "abc", "rounds": 2}
    return doc["compare"]


@pytest.mark.parametrize(
    ("where", "key", "named"),
    [(lambda d: d, "vllm", "(top) has no 'vllm'"),
     (lambda d: d["vllm"], "available", "vllm has no 'available'"),
     (lambda d: d["vllm"], "reason", "vllm has no 'reason'"),
     (_compared, "rounds", "compare has no 'rounds'"),
     (_compared, "old_src", "compare has no 'old_src'"),
     (lambda d: d["rows"][0], "family", "rows/0 has no 'family'"),
     (lambda d: d["rows"][1], "params", "rows/1 has no 'params'"),
     (lambda d: d["rows"][0]["anchors"][0], "time_us", "rows/0/anchors/0 has no 'time_us'")],
)  # fmt: skip
def test_without_jsonschema_a_document_missing_keys_is_named(where, key, named, tmp_path,
                                                             monkeypatch):  # fmt: skip
    """The GPU machines have no jsonschema: a document without a key the schema requires, at
    any depth, ended in a KeyError traceback in the table; now the place is named, as
    jsonschema (which refuses the same document) would."""
    doc = fixture_doc()
    del where(doc)[key]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    path = tmp_path / "d.json"
    path.write_text(json.dumps(doc))
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    with pytest.raises(SystemExit) as info:
        results.main([str(path)])
    assert str(info.value) == (f"bench.results: {path}: not a results document of "
                               f"bench/schema.json: {named} (checked without jsonschema: keys "
                               "and types only)")  # fmt: skip


def test_without_jsonschema_a_valid_document_passes_the_shape_check():
    """The hand check finds nothing in the documents jsonschema accepts (the fixture, with and
    without a comparison)."""
    compared = fixture_doc()
    _compared(compared)
    for doc in (fixture_doc(), compared):
        jsonschema.Draft202012Validator(SCHEMA).validate(doc)
        assert results._shape_error(doc, SCHEMA, SCHEMA) is None
