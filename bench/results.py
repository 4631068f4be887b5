"""bench/RESULTS.md from the results documents of ``python -m bench.run``.

Usage::

    python -m bench.results results.json              # Markdown to stdout
    python -m bench.results results.json --out bench/RESULTS.md
    python -m bench.results a.json b.json --out bench/RESULTS.md   # runs of one tree, merged
    python -m bench.results old.json new.json --across-trees --out bench/RESULTS.md

Several documents (a GPU call's time limit splits the suite into runs) must share the device,
the versions and the commit; their rows are merged in order, a later run's row replacing an
earlier one of the same family and name, and each run's command, date and comparison is listed.
``--across-trees`` also merges runs of different commits (the rows a change touched re-run on
the new tree, the rest kept from the last full run): each run is listed with its commit and
each row names its run.

    python -m bench.results new.json --page bench/RESULTS.md --out bench/RESULTS.md

``--page`` merges runs into a page this command wrote, whose own run documents need not be at
hand (a GPU call's documents come back to that call only): the page's rows are kept as they are
written, a new run's row replaces the one of its family and name, a run no kept row names any
more is dropped, and the runs are numbered again. The page and the new runs must share the
device, the versions and the method.

A run labelled ``<head>+tree:<hash>`` (a working tree that differed from the ``HEAD`` it ran
on) is named by the commit of this repository whose tree that is, where there is one.

The page is the current table only: the device, commit, date, versions, command and method of
that one run, then a table per family with each row's check, time, metrics and anchors (the
anchors' own figures and the row's ratio to them), and new/old where the run compared two
checkouts. History lives in git. Standard library only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from bench.rows import row_entries, row_selected

TITLES = {
    "paged": "Paged decode",
    "prefill": "Pure prefill and mixed batches",
    "mla": "MLA decode and verification",
    "cache": "KV-cache write, gather, page indices",
    "host": "Host time per call",
    "compile": "Compile vs device time",
}


def _num(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    x = float(x)  # an int past a float's range fails here, once, as an OverflowError
    return f"{x:,.{digits}f}" if abs(x) < 1e6 else f"{x:.3g}"


def _metrics(m: dict) -> str:
    return ", ".join(f"{_num(v, 0 if (v or 0) >= 100 else 1)} {k}" for k, v in m.items()) or "-"


def _anchor(row: dict, a: dict) -> str:
    """An anchor's figures and the row against it: a rate's share of the anchor's (the same
    unit), else the time ratio row / anchor."""
    if a["time_us"] is None:
        return f"{a['name']}: not run ({a['note']})" if a["note"] else f"{a['name']}: not run"
    shared = [k for k in a["metrics"] if k in row["metrics"] and a["metrics"][k]]
    if "GB/s" in shared and row["metrics"].get("GB/s"):
        k = "GB/s"
        rel = f"{100 * row['metrics'][k] / a['metrics'][k]:.0f}% of it"
    elif row["time_us"] and a["time_us"]:
        rel = f"row/anchor time {row['time_us'] / a['time_us']:.2f}"
    else:
        rel = ""
    figures = _metrics(a["metrics"]) if a["metrics"] else ""
    parts = [p for p in (f"{_num(a['time_us'])} µs", figures, rel) if p and p != "-"]
    return f"{a['name']} " + ", ".join(parts)


SAME = ("device", "torch", "triton", "python", "commit", "method", "timing_meaningful", "quick")


def _field(doc: dict, key: str) -> object:
    """``doc``'s value of a `SAME` field (``quick`` absent: not a quick run, as on a page)."""
    return bool(doc.get(key)) if key == "quick" else doc.get(key)


def _family(error: dict) -> str:
    """The family an error belongs to: a `--compare` run's old side names it ``<family> (old)``,
    and a later run of the family clears both sides' failures."""
    return error["family"].removesuffix(" (old)")


def run_date(doc: dict, what: str) -> datetime.datetime:
    """``doc``'s date, an ISO date-time with its zone (bench.run writes UTC); else the command
    ends naming ``what`` (the file) and the rule."""
    try:
        when = datetime.datetime.fromisoformat(doc["date"])
    except (TypeError, ValueError):
        when = None
    if when is None or when.tzinfo is None:
        sys.exit(
            f"bench.results: {what}: date must be an ISO date-time with its zone (as bench.run "
            f"writes, e.g. 2026-12-07T13:20:00+00:00); got {doc['date']!r}"
        )
    return when


def merge(docs: list[dict], across_trees: bool = False) -> dict:
    """One document from runs of one tree: rows merged in order (a later run's row replaces an
    earlier one of the same family and name, and a later run of a family drops an earlier
    run's failure of it); each run's command, date, commit and comparison
    kept under ``runs``, each row's run number under ``run``. Runs that differ in device,
    versions, method or (unless ``across_trees``) commit are refused by name."""
    first = docs[0]
    same = [k for k in SAME if not (across_trees and k == "commit")]
    if not across_trees and len(docs) > 1 and any(d["commit"] == "unknown" for d in docs):
        sys.exit(
            "bench.results: a run's commit is unknown, so the runs cannot be told to be of one "
            "tree: merge them with --across-trees (each row then names its run)"
        )
    for i, d in enumerate(docs[1:], 2):
        diff = [k for k in same if _field(d, k) != _field(first, k)]
        if diff:
            sys.exit(f"bench.results: run {i} differs from run 1 in {', '.join(diff)}: "
                     "only runs of one tree on one device are merged"
                     + ("" if across_trees else " (--across-trees: of one device)"))  # fmt: skip
    rows: dict[tuple[str, str], dict] = {}
    errors: list[dict] = []
    skipped: list[dict] = []
    for i, d in enumerate(docs, 1):
        for r in d["rows"]:
            rows.pop((r["family"], r["name"]), None)  # a later run's row takes its place
            rows[(r["family"], r["name"])] = dict(r, run=i)
        # a family's failure or skip stands until a later run runs that family again
        errors = [e for e in errors if _family(e) not in d["families"]] + d["errors"]
        skipped = [k for k in skipped if k["family"] not in d["families"]] + d["skipped"]
    families = list(dict.fromkeys(f for d in docs for f in d["families"]))
    return dict(first, families=families, rows=list(rows.values()),
                # the table holds vLLM anchors when any run measured them
                vllm=next((d["vllm"] for d in reversed(docs) if d["vllm"]["available"]),
                          docs[-1]["vllm"]),
                skipped=skipped,
                errors=errors,
                commit=docs[-1]["commit"],
                runs=[dict(command=d["command"], date=d["date"], reps=d["reps"],
                           commit=d["commit"], compare=d.get("compare"),
                           rounds=d.get("rounds", 1))
                      for d in docs])  # fmt: skip


class RowError(ValueError):
    """A row the table cannot show: ``row`` and why."""

    def __init__(self, row: dict, why: str) -> None:
        super().__init__(f"row {row.get('name')!r} ({row.get('family')}): {why}")
        self.row = row


def _cells(r: dict, compare: bool, trees: bool) -> list[str]:
    """A row's table cells (a row kept from a page: its cells as the page wrote them)."""
    if "page_cells" in r:
        cells = list(r["page_cells"])
        if compare:
            cells.append(r["page_ratio"])
        if trees:
            cells.append(str(r["run"]))
        return cells
    c = r["check"]
    if not c["passed"]:
        check = "**FAILED**"
    elif c["kind"] == "tolerance" and c["error"] is not None and c["error_torch"]:
        check = f"{c['error'] / c['error_torch']:.2f}x torch"
    elif c["kind"] == "tolerance":
        check = "ok"
    else:
        check = c["kind"] if c["kind"] == "exact" else "-"
    anchors = "; ".join(_anchor(r, a) for a in r["anchors"]) or "-"
    us = _num(r["time_us"])
    if r["time_us"] is not None and r.get("timing", "").startswith("eager"):
        us += " (eager)"  # not captured in a graph: the method says the row says so
    rounds = [t for t in r.get("round_times_us") or [] if t is not None]
    if len(rounds) > 1 and c["passed"]:  # the median round's time, the rounds' range beside it
        us += f" ({_num(min(rounds))}-{_num(max(rounds))})"
    cells = [r["name"], check, us, _metrics(r["metrics"]), anchors]
    if compare:
        ratio = (r.get("compare") or {}).get("ratio")
        cells.append("-" if ratio is None else f"{float(ratio):.3f}")
    if trees:
        cells.append(str(r["run"]))
    return cells


def render(doc: dict) -> str:
    runs = doc.get("runs") or [dict(command=doc["command"], date=doc["date"], reps=doc["reps"],
                                    compare=doc.get("compare"),
                                    rounds=doc.get("rounds", 1))]  # fmt: skip
    compare = any(r["compare"] for r in runs)
    trees = len({r.get("commit", doc["commit"]) for r in runs}) > 1
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python -m bench.results` from "
        + (
            "one run"
            if len(runs) == 1
            else f"{len(runs)} runs of {'several trees' if trees else 'one tree'}"
        )
        + " of `python -m bench.run`; do not edit by hand"
        " (history: this page's `git log -p`).",
        "",
        f"- Device: **{doc['device']}**; torch {doc['torch']}, Triton {doc['triton']}, "
        f"Python {doc['python']}",
        f"- Commit: `{doc['commit']}`"
        + (" (the newest run's; each run's below, each row's run in the table)" if trees else ""),
        f"- Method: {doc['method']}",
    ]
    for n, run in enumerate(runs, 1):
        name = f"Run {n}, {run['date']} at `{run['commit']}`" if trees else f"Run {run['date']}"
        if "page_line" in run:  # a run kept from a page: its line as the page wrote it
            lines.append(f"- {name}: {run['page_line']}")
            continue
        line = f"- {name}: `{run['command']}`; {run['reps']} repetitions per device-timed row"
        c = run["compare"]
        if c:
            line += (f"; compared with `{c['old_src']}` (commit `{c['old_commit']}`), "
                     f"{c['rounds']} round(s) a side, new/old < 1 is faster")  # fmt: skip
        elif run.get("rounds", 1) > 1:
            line += (
                f"; each row the median of {run['rounds']} rounds in fresh processes "
                "(their range in brackets)"
            )
        lines.append(line + ".")
    if not doc["timing_meaningful"]:
        lines.append("- **Timings not meaningful** (no GPU: the Triton interpreter ran).")
    vllm = doc["vllm"]
    lines.append(
        f"- vLLM anchor: {'measured' if vllm['available'] else 'skipped: ' + vllm['reason']}"
    )
    for s in doc["skipped"]:
        lines.append(f"- Family `{s['family']}` skipped: {s['reason']}")
    for e in doc["errors"]:
        lines.append(f"- **Family `{e['family']}` failed**: {e['error']}")
    for fam in doc["families"]:
        rows = [r for r in doc["rows"] if r["family"] == fam]
        if not rows:
            continue
        lines += ["", f"## {TITLES.get(fam, fam)}", ""]
        head = "| row | check | µs | metrics | anchors |"
        rule = "|---|---|---:|---|---|"
        if compare:
            head, rule = head + " new/old |", rule + "---:|"
        if trees:
            head, rule = head + " run |", rule + "---:|"
        lines += [head, rule]
        for r in rows:
            try:  # a value the table cannot show names its row, not a line of this module
                lines.append("| " + " | ".join(_cells(r, compare, trees)) + " |")
            except (TypeError, ValueError, ArithmeticError, KeyError, AttributeError) as exc:
                raise RowError(r, f"{type(exc).__name__}: {exc}") from None
        forced = sorted({str(r["params"]["policy"]) for r in rows if r["params"].get("policy")})
        if forced:
            lines += ["", f"Rows named `<arch> tiles` ({', '.join(forced)}): that target's policy "
                      f"forced, its tiles compiled for and run on the {doc['device']}. They show "
                      "how those tiles scale, not how fast an AMD GPU is: absolute AMD speed is "
                      "unmeasured until an AMD GPU runs the rocm cells."]  # fmt: skip
    lines += ["", "Check: the error against the fp64 reference over torch's own error in the "
              "same precision (the rule: <= 2), or bit-exact for copies."]  # fmt: skip
    return "\n".join(lines) + "\n"


_DEVICE = re.compile(r"^- Device: \*\*(.+)\*\*; torch (\S+), Triton (\S+), Python (\S+)$")
_RUN = re.compile(r"^- Run (\d+), (\S+) at `([^`]+)`: (.+)$")
#: A run line of a page of one tree (`render`: no number, no commit) and that page's commit.
_RUN_ONE_TREE = re.compile(r"^- Run (\S+): (`[^`]+`.*)$")
_COMMIT = re.compile(r"^- Commit: `([^`]+)`")


def _selection(command: str) -> tuple[set[str] | None, tuple[str, ...]]:
    """The families (None: every one) and the ``--rows`` entries of a bench.run command line."""
    try:
        args = shlex.split(command)
    except ValueError:  # an unbalanced quote: the words as they stand
        args = command.split()
    only: set[str] | None = None
    rows: tuple[str, ...] = ()
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key in ("--only", "--rows"):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if key == "--only":
                only = {f for f in value.split(",") if f}
            else:
                rows = row_entries(value)
    return only, rows


def _ran_row(selection: tuple[set[str] | None, tuple[str, ...]], family: str, name: str) -> bool:
    """Whether a run of this `_selection` ran row ``name`` of ``family``."""
    families, entries = selection
    in_family = families is None or family in families
    return in_family and (not entries or any(row_selected(name, e) for e in entries))


_FORCED = re.compile(r" (\S+) tiles$")
#: A family's failure and skip lines (`render`), which a page keeps until a run of the family.
_FAILED = re.compile(r"^- \*\*Family `([^`]+)` failed\*\*: (.*)$")
_SKIPPED = re.compile(r"^- Family `([^`]+)` skipped: (.*)$")


class PageError(ValueError):
    """A page `read_page` cannot take apart: the line and why."""


def read_page(text: str) -> dict:
    """What a page `render` wrote gives a later merge: the device, versions and method, each
    run's line (by its number) and each family's rows (their cells as written, their run, a
    forced policy from a ``<arch> tiles`` name). A page of several trees names each row's run;
    on a page of one tree (its runs unnumbered, its commit on the Commit line) a row belongs to
    the last run whose command ran it (its family by ``--only`` or every family, and the row by
    ``--rows`` or every row).

    Raises:
        PageError: not such a page (a line it needs is missing or malformed).
    """
    titles = {v: k for k, v in TITLES.items()}
    page: dict = dict(runs={}, rows=[], families=[], timing_meaningful=True, errors=[],
                      skipped=[])  # fmt: skip
    family, cols, commit = None, [], None
    # a one-tree page's runs: their families (None: all) and --rows entries (none: every row)
    ran: dict[int, tuple[set[str] | None, tuple[str, ...]]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if (m := _COMMIT.match(line)) and commit is None:
            commit = m[1]
        if m := _DEVICE.match(line):
            page.update(zip(("device", "torch", "triton", "python"), m.groups(), strict=True))
        elif line.startswith("- Method: "):
            page["method"] = line.removeprefix("- Method: ")
        elif line.startswith("- **Timings not meaningful**"):
            page["timing_meaningful"] = False
        elif m := _FAILED.match(line):
            page["errors"].append(dict(family=m[1], error=m[2]))
        elif m := _SKIPPED.match(line):
            page["skipped"].append(dict(family=m[1], reason=m[2]))
        elif m := _RUN.match(line):
            page["runs"][int(m[1])] = dict(date=m[2], commit=m[3], page_line=m[4],
                                           compare="; compared with `" in m[4])  # fmt: skip
        elif (m := _RUN_ONE_TREE.match(line)) and commit is not None:
            number = len(page["runs"]) + 1
            page["runs"][number] = dict(date=m[1], commit=commit, page_line=m[2],
                                        compare="; compared with `" in m[2])  # fmt: skip
            ran[number] = _selection(m[2].split("`")[1])
        elif line.startswith("## "):
            family = titles.get(line[3:], line[3:])
            page["families"].append(family)
            cols = []
        elif line.startswith("| row |"):
            cols = [c.strip() for c in line.strip("|").split("|")]
        elif line.startswith("| ") and family is not None and cols:
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if len(cells) != len(cols) or ("run" not in cols and not ran):
                raise PageError(f"line {n}: a row of {len(cells)} cells under the columns {cols} "
                                "(a page of several trees names each row's run; one of one "
                                "tree lists its runs first)")  # fmt: skip
            row = dict(zip(cols, cells, strict=True))
            if "run" not in cols:  # one tree: the last run that ran the row
                owners = [k for k, sel in ran.items() if _ran_row(sel, family, cells[0])]
                if not owners:
                    raise PageError(f"line {n}: row {cells[0]!r} of family {family!r}, which no "
                                    "run of the page ran")  # fmt: skip
                row["run"] = str(owners[-1])
            if not row["run"].isdigit() or int(row["run"]) not in page["runs"]:
                raise PageError(f"line {n}: row {cells[0]!r} names run {row['run']!r}, which the "
                                "page does not list")  # fmt: skip
            forced = _FORCED.search(row["row"])
            page["rows"].append(dict(
                family=family, name=row["row"], run=int(row["run"]),
                page_cells=[row[c] for c in ("row", "check", "µs", "metrics", "anchors")],
                page_ratio=row.get("new/old", "-"),
                params=dict(policy=forced[1]) if forced else {},
            ))  # fmt: skip
    missing = [k for k in ("device", "method") if k not in page] + ["runs"] * (not page["runs"])
    if missing:
        raise PageError(f"no {', '.join(missing)} line (a page bench.results wrote from runs of "
                        "several trees has them)")  # fmt: skip
    return page


def merge_into_page(page: dict, docs: list[dict]) -> dict:
    """``docs`` (runs of any trees) merged into ``page`` (`read_page`): their rows replace the
    page's of the same family and name; the page's runs that no kept row names are dropped;
    runs numbered again, the page's first. The page and the runs must share the device, the
    versions and the method (refused by name)."""
    new = merge(docs, across_trees=True)
    diff = [k for k in SAME if k != "commit" and _field(page, k) != _field(new, k)]
    if diff:
        sys.exit(f"bench.results: the runs differ from the page in {', '.join(diff)}: only runs "
                 "of one device, versions and method are merged")  # fmt: skip
    fresh = {(r["family"], r["name"]): r for r in new["rows"]}
    used = sorted({r["run"] for r in page["rows"] if (r["family"], r["name"]) not in fresh})
    number = {old: i for i, old in enumerate(used, 1)}
    for r in page["rows"]:  # a newer measurement replaces an older one, never the other way
        n = fresh.get((r["family"], r["name"]))
        if n is not None:
            was = page["runs"][r["run"]]["date"]
            now = new["runs"][n["run"] - 1]["date"]
            if run_date(dict(date=now), "a run") < run_date(dict(date=was), "the page"):
                sys.exit(f"bench.results: the run of {now} would replace row {r['name']!r}, "
                         f"which the page holds from a later run ({was})")  # fmt: skip
    rows = []
    for r in page["rows"]:  # a new row takes the place of the page's row it replaces
        n = fresh.pop((r["family"], r["name"]), None)
        if n is None:
            rows.append(dict(r, run=number[r["run"]]))
        else:
            rows.append(dict(n, run=n["run"] + len(used)))
    rows += [dict(r, run=r["run"] + len(used)) for r in fresh.values()]
    families = list(dict.fromkeys(page["families"] + new["families"]))
    # the page's failures and skips stand until a run of their family (as in `merge`)
    ran = {f for d in docs for f in d["families"]}
    errors = [e for e in page["errors"] if _family(e) not in ran] + new["errors"]
    skipped = [k for k in page["skipped"] if k["family"] not in ran] + new["skipped"]
    return dict(new, families=families, rows=rows, page_runs=len(used), errors=errors,
                skipped=skipped, runs=[page["runs"][n] for n in used] + new["runs"])  # fmt: skip


_TREE_LABEL = re.compile(r"^[0-9a-f]+\+tree:([0-9a-f]{12})$")
#: The repository whose commits name the trees runs were labelled with (`resolve_commits`).
REPO = Path(__file__).resolve().parents[1]


def tree_commits(root: str | os.PathLike[str]) -> dict[str, str]:
    """``{first 12 digits of a tree hash: the newest commit with that tree}`` over every commit
    of the repository at ``root``; empty where git or a repository is missing."""
    try:
        out = subprocess.run(["git", "log", "--all", "--format=%h %T"], cwd=root,
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return {}
    found: dict[str, str] = {}
    for line in out.splitlines():
        commit, tree = line.split()
        found.setdefault(tree[:12], commit)
    return found


def resolve_commits(docs: list[dict], root: str | os.PathLike[str] = REPO) -> None:
    """Each run labelled ``<head>+tree:<hash>`` (its tree differed from the ``HEAD`` it ran on)
    takes the name of the commit of ``root``'s repository whose tree that is, where there is
    one: a GPU machine whose copy of the checkout keeps an older ``.git`` labels every later
    tree by that older ``HEAD``. Labels without such a commit stay as they are."""
    found = None
    for d in docs:
        m = _TREE_LABEL.match(d["commit"])
        if m is not None:
            found = tree_commits(root) if found is None else found
            d["commit"] = found.get(m[1], d["commit"])


SCHEMA = Path(__file__).with_name("schema.json")


def _first_non_finite(value, at: str = "") -> tuple[str, float] | None:
    """The path (``rows/0/time_us``) and value of the document's first NaN or infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return at or "(top)", value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(
        value, list) else ()  # fmt: skip
    for key, item in items:
        found = _first_non_finite(item, f"{at}/{key}" if at else str(key))
        if found is not None:
            return found
    return None


_JSON_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool,
               "null": type(None)}  # fmt: skip


def _has_type(value, name: str) -> bool:
    if name in ("number", "integer"):  # JSON's numbers, not its booleans
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok and (name == "number" or float(value).is_integer())
    return isinstance(value, _JSON_TYPES[name])


def _shape_error(value, schema: dict, root: dict, at: str = "(top)") -> str | None:
    """Where ``value`` breaks ``schema``'s keys or types (its ``$ref``, ``oneOf``, ``type``,
    ``required``, ``properties`` and ``items``; bounds are the table's to find), or None: what
    bench.results checks of a document where jsonschema is not installed."""
    while "$ref" in schema:  # "#/$defs/<name>"
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    if "oneOf" in schema:
        errors = [_shape_error(value, s, root, at) for s in schema["oneOf"]]
        if all(errors):
            return errors[-1]
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if types and not any(_has_type(value, t) for t in types):
        return f"{at} is {type(value).__name__}, not {' or '.join(types)}"
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            if key not in value:
                return f"{at} has no {key!r}"
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                where = key if at == "(top)" else f"{at}/{key}"
                wrong = _shape_error(value[key], sub, root, where)
                if wrong:
                    return wrong
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            wrong = _shape_error(item, schema["items"], root, f"{at}/{i}")
            if wrong:
                return wrong
    return None


def _load(path: str) -> dict:
    """A results document, checked against bench/schema.json (with jsonschema where installed,
    else its keys and types, `_shape_error`); what is wrong ends the command naming the file."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        sys.exit(f"bench.results: {path}: cannot read a results document ({exc})")
    if not isinstance(doc, dict) or doc.get("schema_version") != 1:
        got = doc.get("schema_version") if isinstance(doc, dict) else type(doc).__name__
        sys.exit(f"bench.results: {path}: schema_version must be 1; got {got!r}")
    # NaN passes every bound of the schema (each comparison with it is false): found here
    where = _first_non_finite(doc)
    if where is not None:
        at, value = where
        sys.exit(f"bench.results: {path}: {at} is {value}, not a finite number")
    schema = json.loads(SCHEMA.read_text())
    try:
        import jsonschema
    except ImportError:  # the GPU machines need not have it: the schema's keys and types by hand
        wrong = _shape_error(doc, schema, schema)
        if wrong:
            sys.exit(f"bench.results: {path}: not a results document of bench/schema.json: "
                     f"{wrong} (checked without jsonschema: keys and types only)")  # fmt: skip
        return doc
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=str)
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path) or "(top)"
        why = errors[0].message  # shortened: a 400-digit number would fill the terminal
        why = why if len(why) <= 200 else f"{why[:90]} ... {why[-90:]}"
        sys.exit(f"bench.results: {path}: not a results document of bench/schema.json at {where}: "
                 f"{why}")  # fmt: skip
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.results", description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", help="JSON documents written by python -m bench.run")
    ap.add_argument("--out", default=None, help="write the Markdown here (default: stdout)")
    ap.add_argument("--across-trees", action="store_true",
                    help="merge runs of different commits (each row names its run)")  # fmt: skip
    ap.add_argument("--page", default=None,
                    help="merge the runs into this page (bench/RESULTS.md) instead of only each "
                         "other (any trees)")  # fmt: skip
    opts = ap.parse_args(argv)
    for name in ("out", "page"):  # given empty (an unset variable), not "not given"
        if getattr(opts, name) is not None and not getattr(opts, name).strip():
            ap.error(f"--{name} must name a file; got {getattr(opts, name)!r}")
    if opts.out and (os.path.isdir(opts.out) or not os.path.isdir(os.path.dirname(
            os.path.abspath(opts.out)))):  # fmt: skip
        ap.error(f"--out {opts.out}: must be a file in an existing folder")
    docs = [_load(path) for path in opts.results]
    # runs merge oldest first, whatever the command line's order: a later run's row replaces
    paths, docs = map(list, zip(*sorted(
        zip(opts.results, docs, strict=True), key=lambda pd: run_date(pd[1], pd[0])
    ), strict=True))  # fmt: skip
    resolve_commits(docs)
    if opts.page:
        quick = [path for path, d in zip(paths, docs, strict=True) if d.get("quick")]
        if quick:  # its tiny shapes' rows would stand in the device's page as measurements
            sys.exit(f"bench.results: {quick[0]}: a --quick run (a smoke test of tiny shapes) "
                     f"is not merged into a page (--page {opts.page})")  # fmt: skip
        try:
            with open(opts.page) as f:
                page = read_page(f.read())
        except OSError as exc:
            sys.exit(f"bench.results: --page {opts.page}: cannot read ({exc.strerror})")
        except UnicodeDecodeError:
            sys.exit(f"bench.results: --page {opts.page}: not UTF-8 text (not a page)")
        except PageError as exc:
            sys.exit(f"bench.results: --page {opts.page}: not a page of several runs: {exc}")
        doc = merge_into_page(page, docs)
    else:
        doc = merge(docs, opts.across_trees) if len(docs) > 1 else docs[0]
        if not doc["rows"] and not doc["errors"]:  # bench.run writes no such document
            sys.exit(f"bench.results: {', '.join(paths)}: no row and no failure: a page "
                     "of them would read as a finished run")  # fmt: skip
    try:
        text = render(doc)
    except RowError as exc:  # the document the row came from (a merged row knows its run)
        path = paths[exc.row.get("run", 1) - doc.get("page_runs", 0) - 1]
        sys.exit(f"bench.results: {path}: {exc}")
    if opts.out:
        try:
            with open(opts.out, "w") as f:
                f.write(text)
        except OSError as exc:
            sys.exit(f"bench.results: --out {opts.out}: cannot write ({exc.strerror})")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
