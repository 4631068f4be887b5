"""The benchmark runner: every family's rows, one JSON document per run (bench/schema.json).

Usage (repository root; ``PYTHONPATH=src`` or portattn installed)::

    python -m bench.run [--only paged,mla,...] [--rows SUBSTR|=NAME,...] [--quick] [--out F]
                        [--rounds N] [--compare OLD_SRC_DIR]
    python -m bench.results results.json > bench/RESULTS.md

Families (one module each, all on `bench.inputs` and `bench.core`): ``paged`` (decode, NHD and
SHUFFLE), ``prefill`` (pure prefill and mixed batches), ``mla`` (decode, page sizes,
verification), ``cache`` (KV-cache write, gather, page indices), ``host`` (host time per call),
``compile`` (cold and warm compile against device time). Each uses only portattn's public API,
so the same suite times another checkout's ``src/``.

Method, the one statement of it (`core.METHOD`, recorded in the document): every row is checked
against the fp64 reference before it is timed (a failing row is recorded untimed and the run
exits 1); GPU rows are CUDA-graph replays between two events after an L2 flush, median of
``--reps``; anchors (SDPA cuDNN/flash, the read ceiling, vLLM where it imports) in the same run.
On a CPU the runner needs ``TRITON_INTERPRET=1``: the shapes should be ``--quick``'s, the host
and compile families are skipped, and the document says its timings are not meaningful.
A ``--rows`` filter that matches no row of the chosen families, or a choice of families none of
which runs on this device, is a usage error (exit 2) before any row runs; a run that measured no
row writes no document and exits 1.

``--compare OLD`` (``OLD`` holding ``src/portattn`` or ``portattn``, e.g. from
``git archive <rev> src | tar -x -C OLD``) times each family in child processes, this checkout's
``src/`` and ``OLD``'s in turn (the order alternating from family to family and round to round,
so a drift of the card's clock falls on both), and records each row's old time and new/old.
``--rounds N`` runs each family N times in fresh processes (each side's, with ``--compare``)
and keeps each row's median round, listing every round's time: host rows spread by 2x between
runs minutes apart on one machine.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile

import torch
import triton

from bench import core
from bench.rows import row_entries, row_selected

FAMILIES = ("paged", "prefill", "mla", "cache", "host", "compile")
GPU_ONLY = {
    "host": "host times need a GPU: on a CPU every call runs the interpreter",
    "compile": "no compile under TRITON_INTERPRET=1: the interpreter runs the kernels' Python",
}
SCHEMA_VERSION = 1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit_of(root: str = ROOT, *, from_env: bool = True) -> str:
    """``$BENCH_COMMIT`` if set; else ``<root>/COMMIT``'s text (an exported tree); else, where
    ``root`` is a repository's top level, `kubematrix.checkout.describe`'s label (``HEAD``'s
    short hash, or ``HEAD+tree:<hash>`` when the working tree differs from it); ``unknown``
    without git."""
    if from_env and os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    stamp = os.path.join(root, "COMMIT")  # an exported tree names its commit in a file
    if os.path.isfile(stamp):
        with open(stamp) as f:
            return f.read().strip() or "unknown"
    from kubematrix import checkout  # here: a --compare child may import an older kubematrix

    try:
        # a folder inside another repository (an exported old tree) is not that repository's HEAD
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root,
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    if os.path.realpath(top) != os.path.realpath(root):
        return "unknown"
    return checkout.describe(root, short=7)


def row_names(families, quick: bool) -> dict[str, list[str]]:
    """Each family's row names (its module's ``names``), without running any row."""
    return {f: importlib.import_module(f"bench.{f}").names(quick) for f in families}


def _matching(names: dict[str, list[str]], rows: str) -> list[str]:
    """The names that one of the comma-separated entries ``rows`` selects (`row_selected`)."""
    subs = row_entries(rows)
    return [n for ns in names.values() for n in ns if any(row_selected(n, s) for s in subs)]


def triton_interpret() -> bool:
    """Whether Triton runs kernels in its interpreter, by Triton's own reading of
    TRITON_INTERPRET (``true``, ``yes`` ... count as ``1`` does)."""
    return bool(triton.knobs.runtime.interpret)


def _unmatched(names: dict[str, list[str]], rows: str) -> list[str]:
    """The comma-separated entries of ``rows`` that select no name."""
    every = [n for ns in names.values() for n in ns]
    return [s for s in row_entries(rows) if not any(row_selected(n, s) for n in every)]


def run_families(families, ctx: core.Context, log=sys.stderr) -> dict:
    """Each family's rows in this process: ``{rows, skipped, errors}``."""
    out: dict = dict(rows=[], skipped=[], errors=[])
    for fam in families:
        if fam in GPU_ONLY and ctx.device != "cuda":
            out["skipped"].append(dict(family=fam, reason=GPU_ONLY[fam]))
            continue
        module = importlib.import_module(f"bench.{fam}")
        try:
            for r in module.rows(ctx):
                out["rows"].append(r)
                print(_line(r), file=log, flush=True)
        except Exception as err:  # noqa: BLE001 (one family's failure is recorded; others run)
            out["errors"].append(dict(family=fam, error=f"{type(err).__name__}: {err}"[:500]))
            print(f"{fam}: ERROR {type(err).__name__}: {err}", file=log, flush=True)
    return out


def _line(r: dict) -> str:
    t = "-" if r["time_us"] is None else f"{r['time_us']:.1f} µs"
    m = ", ".join(f"{v:.0f} {k}" for k, v in r["metrics"].items() if v is not None)
    ok = "ok" if r["check"]["passed"] else "CHECK FAILED"
    return f"{r['family']:8} {r['name']:44} {ok:12} {t:>12}  {m}"


def src_dir(path: str) -> str:
    """The folder to put on ``PYTHONPATH`` for a checkout ``path``: ``path/src`` or ``path``
    itself, whichever holds ``portattn/__init__.py``."""
    for cand in (os.path.join(path, "src"), path):
        if os.path.isfile(os.path.join(cand, "portattn", "__init__.py")):
            return os.path.abspath(cand)
    raise SystemExit(f"bench.run: --compare {path!r}: no portattn/__init__.py in it or its src/")


def run_child(fam: str, src: str, opts) -> dict:
    """One family in a child process importing portattn from ``src``: its `run_families`
    result, plus the portattn it imported (checked to be ``src``'s)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "bench.run", "--only", fam, "--child-json", path,
               "--reps", str(opts.reps)] + (["--quick"] if opts.quick else []) + (
                   ["--rows", opts.rows] if opts.rows else [])  # fmt: skip
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, ROOT]))
        manager = env.get("TRITON_CACHE_MANAGER", "")
        if manager.startswith("kubematrix.") and not os.path.isfile(
            os.path.join(src, "kubematrix", "compile_cache.py")
        ):  # an older checkout without the layered cache: Triton's own file cache
            del env["TRITON_CACHE_MANAGER"]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=sys.stderr, stderr=sys.stderr)
        if proc.returncode not in (0, 1) or not os.path.exists(path):
            return dict(rows=[], skipped=[], errors=[dict(
                family=fam, error=f"child for {src} exited {proc.returncode}")])  # fmt: skip
        with open(path) as f:
            got = json.load(f)
    if os.path.realpath(os.path.dirname(os.path.dirname(got["portattn"]))) != os.path.realpath(src):
        raise SystemExit(f"bench.run: the child imported {got['portattn']}, not {src}'s portattn")
    return got


def run_rounds(families, opts) -> tuple[dict, dict | None]:
    """Each family in child processes, ``--rounds`` times: with ``--compare`` new and old in
    alternating order, the new rows with ``compare`` filled in, and the document's ``compare``
    record (else ``None``). A row is its median round's (the lower middle one for an even count),
    whole: its time and the metrics computed from it come from one measurement; every round's
    time is listed (``compare``'s ``new_times_us`` / ``old_times_us``, else the row's
    ``round_times_us`` when there is more than one round)."""
    new_src = src_dir(ROOT)
    old_src = src_dir(opts.compare) if opts.compare else None
    merged: dict = dict(rows=[], skipped=[], errors=[])
    for i, fam in enumerate(families):
        rows: dict = {"new": {}, "old": {}}  # name -> that row in each round, first-seen order
        for rnd in range(opts.rounds):
            sides = ("new",) if old_src is None else (
                ("new", "old") if (i + rnd) % 2 == 0 else ("old", "new"))  # fmt: skip
            for side in sides:
                got = run_child(fam, new_src if side == "new" else old_src, opts)
                for r in got["rows"]:
                    rows[side].setdefault(r["name"], []).append(r)
                if side == "new" and rnd == 0:
                    merged["skipped"] += got["skipped"]
                # every round's errors: a child that crashed in a later round is reported too
                for e in got["errors"]:
                    e = e if side == "new" else dict(e, family=f"{e['family']} (old)")
                    if e not in merged["errors"]:
                        merged["errors"].append(e)
        for name, news in rows["new"].items():
            olds = rows["old"].get(name, [])
            r = _median_round(news)
            if old_src is None:
                if opts.rounds > 1:
                    r["round_times_us"] = [x["time_us"] for x in news]
                merged["rows"].append(r)
                continue
            o = _median_round(olds)
            new_t, old_t = r["time_us"], None if o is None else o["time_us"]
            r["compare"] = dict(
                old_time_us=old_t,
                ratio=new_t / old_t if new_t and old_t else None,
                old_check_passed=None if o is None else o["check"]["passed"],
                new_times_us=[x["time_us"] for x in news],
                old_times_us=[x["time_us"] for x in olds],
            )
            merged["rows"].append(r)
    if old_src is None:
        return merged, None
    record = dict(old_src=old_src, old_commit=os.environ.get("BENCH_COMPARE_COMMIT") or
                  commit_of(opts.compare, from_env=False), rounds=opts.rounds)  # fmt: skip
    return merged, record


def _median_round(rows: list) -> dict | None:
    """The round whose time is the median of ``rows`` (the lower middle one for an even count;
    untimed rows last); a round whose check failed wins instead, so no failure hides behind a
    passing round; ``None`` for no rows."""
    if not rows:
        return None
    failed = [r for r in rows if not r.get("check", {}).get("passed", True)]
    if failed:
        return failed[0]
    timed = sorted(rows, key=lambda r: (r["time_us"] is None, r["time_us"] or 0.0))
    n = sum(r["time_us"] is not None for r in timed) or len(timed)
    return timed[(n - 1) // 2]


def document(result: dict, opts, device: str, compare_record: dict | None) -> dict:
    """The results document (bench/schema.json)."""
    _, vllm_why = core.vllm_unified_attention()
    return dict(
        schema_version=SCHEMA_VERSION,
        device=torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.machine()})",
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        commit=commit_of(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="python -m bench.run " + shlex.join(sys.argv[1:]),
        method=core.METHOD,
        timing_meaningful=device == "cuda",
        quick=opts.quick,
        reps=opts.reps,
        families=list(opts.families),
        vllm=dict(available=not vllm_why, reason=vllm_why),
        compare=compare_record,
        rounds=opts.rounds,
        skipped=result["skipped"],
        errors=result["errors"],
        rows=result["rows"],
    )


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only", default=None, help=f"comma-separated families of {','.join(FAMILIES)} (all)"
    )
    ap.add_argument(
        "--rows",
        default=None,
        help="comma-separated substrings of row names to run, or =NAME for one row (all)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter, smoke)")
    ap.add_argument("--out", default=None, help="write the JSON document here (default: stdout)")
    ap.add_argument(
        "--compare",
        default=None,
        metavar="OLD_SRC_DIR",
        help="also time every row with this checkout's src/ (child processes)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each family in fresh processes (a side's, with --compare); median kept",
    )
    ap.add_argument("--reps", type=int, default=50, help="timed repetitions per GPU row")
    ap.add_argument("--child-json", default="", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    for name in ("only", "rows"):  # given empty, they would select everything
        value = getattr(opts, name)
        if value is not None and not [x for x in value.split(",") if x]:
            ap.error(f"--{name} must name at least one, comma-separated; got {value!r}")
    for name in ("out", "compare"):  # given empty (an unset variable), not "not given"
        if getattr(opts, name) is not None and not getattr(opts, name).strip():
            ap.error(f"--{name} must name a path; got {getattr(opts, name)!r}")
        setattr(opts, name, getattr(opts, name) or "")
    fams = [f for f in (opts.only or "").split(",") if f] or list(FAMILIES)
    unknown = sorted(set(fams) - set(FAMILIES))
    if unknown:
        ap.error(f"--only: unknown families {unknown}; choose from {list(FAMILIES)}")
    if opts.rounds < 1 or opts.reps < 1:
        ap.error(f"--rounds and --reps must be >= 1; got {opts.rounds}, {opts.reps}")
    if opts.out:  # before hours of rows, not after them
        folder = os.path.dirname(os.path.abspath(opts.out))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            ap.error(f"--out {opts.out}: cannot make its folder: {exc}")
        exists_unwritable = os.path.exists(opts.out) and not os.access(opts.out, os.W_OK)
        if os.path.isdir(opts.out) or not os.access(folder, os.W_OK) or exists_unwritable:
            ap.error(f"--out {opts.out}: not a file this process can write")
    opts.rows = opts.rows or ""
    opts.families = tuple(f for f in FAMILIES if f in fams)
    # before any row runs; a --compare child gets the whole filter with one family of several
    names = row_names(opts.families, opts.quick) if opts.rows and not opts.child_json else None
    if names is not None and not _matching(names, opts.rows):
        ap.error(f"no row matches --rows {opts.rows!r} in {list(opts.families)} "
                 "(substrings of the row names in bench/RESULTS.md, or =NAME)")  # fmt: skip
    unmatched = [] if names is None else _unmatched(names, opts.rows)
    if unmatched:  # a typo would leave its rows out of a run taken as complete
        ap.error(f"--rows: {unmatched} match no row in {list(opts.families)} (substrings of "
                 "the row names in bench/RESULTS.md, or =NAME)")  # fmt: skip
    return opts


def main(argv=None) -> int:
    opts = parse(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    interpret = triton_interpret()
    if device == "cuda" and interpret:  # the kernels would run in the interpreter: no timing
        sys.exit("bench.run: TRITON_INTERPRET is on and a GPU is here: the kernels would run in "
                 "Triton's interpreter and be timed as GPU rows; unset it")  # fmt: skip
    if device == "cpu" and not interpret:
        sys.exit("bench.run: no GPU here; set TRITON_INTERPRET=1 to run the kernels on the CPU "
                 "(with --quick: full-size rows take hours in the interpreter)")  # fmt: skip
    if device == "cpu" and not opts.quick:  # full-size rows run for hours, silently
        sys.exit("bench.run: no GPU here: the interpreter runs --quick's shapes only (full-size "
                 "rows take hours); pass --quick")  # fmt: skip
    if not opts.child_json:  # a run that can measure nothing here stops before it starts
        runnable = [f for f in opts.families if f not in GPU_ONLY or device == "cuda"]
        why = "; ".join(f"{f}: {GPU_ONLY[f]}" for f in opts.families if f not in runnable)
        if not runnable:
            print(f"bench.run: --only {','.join(opts.families)}: no family runs here ({why})",
                  file=sys.stderr)  # fmt: skip
            return 2
        if opts.rows and not _matching(row_names(runnable, opts.quick), opts.rows):
            print(f"bench.run: --rows {opts.rows!r} matches only rows of families that do not run "
                  f"here ({why})", file=sys.stderr)  # fmt: skip
            return 2
    ctx = core.Context(device, quick=opts.quick, reps=opts.reps,
                       only_rows=row_entries(opts.rows))  # fmt: skip
    if opts.child_json:
        import portattn

        result = run_families(opts.families, ctx)
        result["portattn"] = os.path.abspath(portattn.__file__)
        with open(opts.child_json, "w") as f:
            json.dump(result, f)
        return 0
    compare_record = None
    if opts.compare or opts.rounds > 1:
        result, compare_record = run_rounds(opts.families, opts)
    else:
        result = run_families(opts.families, ctx)
    if not result["rows"]:  # no document: one without rows would read as a finished run
        print(f"bench.run: no row was measured; no document written; errors {result['errors']}",
              file=sys.stderr)  # fmt: skip
        return 1
    doc = document(result, opts, device, compare_record)
    text = json.dumps(doc, indent=1, ensure_ascii=False)
    if opts.out:
        try:
            with open(opts.out, "w") as f:
                f.write(text + "\n")
        except OSError as exc:  # the rows are not lost: the document goes to stdout instead
            print(text)
            sys.exit(f"bench.run: --out {opts.out}: cannot write ({exc.strerror}); the document "
                     "went to stdout")  # fmt: skip
        print(f"bench.run: {len(doc['rows'])} rows -> {opts.out}", file=sys.stderr)
    else:
        print(text)
    failed = [r["name"] for r in doc["rows"] if not r["check"]["passed"]]
    if failed or doc["errors"]:
        print(f"bench.run: failed checks {failed}; errors {doc['errors']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
