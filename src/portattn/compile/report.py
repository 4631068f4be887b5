"""Reports of a compile-matrix run: terminal table, JSON, Markdown and a PNG heatmap.

The heatmap shows, for every kernel case (rows, grouped by kernel) and target (columns), the
compiled shared memory as a fraction of that target's limit: green is comfortable, red is near
the limit, a crossed cell failed the gate (its reason is in the Markdown and JSON).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from portattn.compile.matrix import ESTIMATE_TOLERANCE, SPILL_THRESHOLD, CellResult


def _archs(cells: Sequence[CellResult]) -> list[str]:
    return list(dict.fromkeys(c.arch for c in cells))


def _rows(cells: Sequence[CellResult]) -> list[tuple[str, str]]:
    return list(dict.fromkeys((c.kernel, c.case) for c in cells))


def _fmt_cell(c: CellResult) -> str:
    if c.refused:
        return "refused"
    if not c.compiled:
        return "ERR"
    frac = (c.shared or 0) / c.limit
    mark = "" if c.passed else "!"
    return f"{frac:4.0%}{mark}"


def summary_table(cells: Sequence[CellResult], *, max_rows: int | None = None) -> str:
    """A plain-text table: per kernel case, shared memory as % of each target's limit.

    ``ERR`` marks a compile, plan or worker failure, ``!`` any other gate failure, ``refused``
    a problem the op refuses on that target. Below it, per-target totals and every failing cell
    with its reasons.
    """
    archs = _archs(cells)
    by = {(c.kernel, c.case, c.arch): c for c in cells}
    rows = _rows(cells)
    width = max([len(f"{k}/{n}") for k, n in rows] + [10])
    lines = [f"{'case':<{width}} " + " ".join(f"{a:>7}" for a in archs)]
    shown = rows if max_rows is None else rows[:max_rows]
    for k, n in shown:
        vals = [_fmt_cell(by[k, n, a]) if (k, n, a) in by else "-" for a in archs]
        lines.append(f"{f'{k}/{n}':<{width}} " + " ".join(f"{v:>7}" for v in vals))
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more rows in the Markdown/JSON report")
    lines.append("")
    passed = [sum(c.passed for c in cells if c.arch == a) for a in archs]
    total = [sum(1 for c in cells if c.arch == a) for a in archs]
    lines.append(
        f"{'passed':<{width}} "
        + " ".join(f"{p}/{t}".rjust(7) for p, t in zip(passed, total, strict=True))
    )
    failures = [c for c in cells if not c.passed]
    refused = [c for c in cells if c.refused]
    notes = [c for c in cells if c.notes and c.launches]
    lines.append(
        f"{len(cells) - len(failures)}/{len(cells)} cells pass; {len(failures)} fail; "
        f"{len(refused)} refused by the op (no tile fits: nothing to compile); "
        f"{len(notes)} with a policy-estimate note"
    )
    for c in failures:
        lines.append(f"FAIL {c.id}: " + "; ".join(c.reasons))
    return "\n".join(lines)


def to_json(cells: Sequence[CellResult], meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "meta": meta,
        "gate": {
            "shared_memory": "compiled metadata.shared <= target max_shared_mem",
            "spill_threshold": SPILL_THRESHOLD,
            "estimate_tolerance": list(ESTIMATE_TOLERANCE),
        },
        "cells": [c.to_dict() for c in cells],
    }


def write_json(cells: Sequence[CellResult], path: str, meta: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(to_json(cells, meta), f, indent=1)


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def markdown(cells: Sequence[CellResult], meta: dict[str, Any]) -> str:
    archs = _archs(cells)
    by = {(c.kernel, c.case, c.arch): c for c in cells}
    failures = [c for c in cells if not c.passed]
    out = [
        "# Compile matrix",
        "",
        f"{len(cells) - len(failures)}/{len(cells)} cells pass "
        f"({len(_rows(cells))} kernel cases x {len(archs)} targets). "
        + ", ".join(f"{k}: {v}" for k, v in meta.items()),
        "",
        "Each cell: compiled shared memory as a share of the target's limit, then "
        "registers/spills (NVIDIA: registers per thread / spill-store bytes; AMD: VGPRs / spilled "
        "registers). **FAIL** cells are listed below the table.",
        "",
        "| case | " + " | ".join(f"{a} ({by_limit(cells, a)} B)" for a in archs) + " |",
        "|---|" + "---|" * len(archs),
    ]
    for k, n in _rows(cells):
        vals = []
        for a in archs:
            c = by.get((k, n, a))
            if c is None:
                vals.append("")
                continue
            if c.refused:
                vals.append("refused")
                continue
            if not c.compiled:
                vals.append("**ERR**")
                continue
            regs = max((r.regs or 0) for r in c.launches)
            spills = max((r.spills or 0) for r in c.launches)
            v = f"{(c.shared or 0) / c.limit:.0%} · {regs}/{spills}"
            vals.append(v if c.passed else f"**FAIL** {v}")
        out.append(f"| {k}/{n} | " + " | ".join(vals) + " |")
    if failures:
        out += ["", "## Failures", ""]
        out += [f"- `{c.id}`: " + _md_escape("; ".join(c.reasons)) for c in failures]
    refused = [c for c in cells if c.refused]
    if refused:
        out += ["", "## Refused by the op (nothing to compile)", ""]
        out += [f"- `{c.id}`: " + _md_escape(c.plan_error or "") for c in refused]
    noted = [c for c in cells if c.notes and not c.refused]
    if noted:
        out += ["", "## Policy estimate vs compiler", ""]
        out += [f"- `{c.id}`: " + _md_escape("; ".join(c.notes)) for c in noted]
    return "\n".join(out) + "\n"


def by_limit(cells: Sequence[CellResult], arch: str) -> int:
    return next(c.limit for c in cells if c.arch == arch)


def write_markdown(cells: Sequence[CellResult], path: str, meta: dict[str, Any]) -> None:
    with open(path, "w") as f:
        f.write(markdown(cells, meta))


def write_heatmap(cells: Sequence[CellResult], path: str, title: str = "") -> None:
    """PNG heatmap: shared memory / target limit, kernel cases (rows) x targets (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    archs = _archs(cells)
    rows = _rows(cells)
    by = {(c.kernel, c.case, c.arch): c for c in cells}
    data = np.full((len(rows), len(archs)), np.nan)
    failed = np.zeros_like(data, dtype=bool)
    for i, (k, n) in enumerate(rows):
        for j, a in enumerate(archs):
            c = by.get((k, n, a))
            if c is None:
                continue
            if c.compiled:
                data[i, j] = (c.shared or 0) / c.limit
            failed[i, j] = not c.passed
    height = max(3.0, 0.16 * len(rows) + 1.5)
    fig, ax = plt.subplots(figsize=(2.2 + 0.75 * len(archs), height))
    cmap = plt.get_cmap("RdYlGn_r").with_extremes(bad="#444444")
    im = ax.imshow(
        np.clip(data, 0, 1.2), aspect="auto", cmap=cmap, vmin=0, vmax=1.2, interpolation="nearest"
    )
    for i, j in zip(*np.nonzero(failed), strict=True):
        ax.text(j, i, "X", ha="center", va="center", color="black", fontsize=7, weight="bold")
    ax.set_xticks(range(len(archs)), archs, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{k}/{n}" for k, n in rows], fontsize=5)
    # Lines between kernels.
    kernels = [k for k, _ in rows]
    for i in range(1, len(rows)):
        if kernels[i] != kernels[i - 1]:
            ax.axhline(i - 0.5, color="black", linewidth=1.0)
    cb = fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
    cb.set_label("shared memory / target limit (>1: overflow; grey: did not compile)", fontsize=7)
    n_fail = int(failed.sum())
    ax.set_title(
        title
        or f"Compile matrix: {len(cells) - n_fail}/{len(cells)} cells pass (X = gate failure)",
        fontsize=9,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
