"""Summarise an Nsight Compute source page (SASS with warp-stall samples) of one kernel.

Prints the stall reasons over the whole kernel, then the stretches of SASS between
synchronisation points (wgmma arrive/wait, barriers, bulk copies, mbarrier waits) with their
share of all samples: where the warps spend their time, phase by phase; then the samples spent
waiting on each mbarrier (its try-wait and the retry branch after it, whose samples the stretch
view gives to the next stretch), by the barrier's address operand (a register and an offset:
one barrier, or one per value of the register), and those at wgmma waits. Any kernel's CSV works;
one benchmark row of the suite is the profiled program (the kernel named in full: ``sm90``
alone also matches cuBLAS kernels the reference check runs). Usage (repository root)::

    PYTHONPATH=src ncu --set full --clock-control none -k regex:mla_decode_sm90 \
        --launch-skip 1 --launch-count 1 -o rep \
        python3 -m bench.run --only mla --rows "mla 128h 64x16k page64 q1" --reps 1
    ncu -i rep.ncu-rep --page source --print-source sass --csv > sass.csv
    python3 -m bench.diag.ncu_stalls sass.csv [--min-share 0.3]
"""

from __future__ import annotations

import argparse
import csv
import re
import sys

#: SASS opcodes that end a stretch (the points the schedule synchronises on).
MARKERS = ("WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "BAR.SYNC", "UTMALDG", "SYNCS.PHASECHK",
           "STSM", "MEMBAR")  # fmt: skip
SAMPLES = "Warp Stall Sampling (All Samples)"
#: An mbarrier try-wait and its barrier's address operand as written (``[UR14+0x38558]``).
TRY_WAIT = re.compile(r"SYNCS\.PHASECHK\S*\s.*?(\[[^\]]+\])")
#: The branch back to a try-wait whose phase has not completed (on the try-wait's false).
RETRY = re.compile(r"^\s*@!U?P\d+\s+BRA\b")


def load(path: str) -> tuple[list[str], list[list[str]]]:
    """The header and the data rows of an ncu source page, each row's sample counts (the
    all-samples column and every ``stall_*`` one) checked to be ints >= 0 (an empty cell: 0)."""
    try:
        with open(path, newline="") as f:
            reader = csv.reader(f)
            rows = [(reader.line_num, row) for row in reader if row]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:  # missing, a folder, not text
        raise SystemExit(f"ncu_stalls: {path}: cannot read a CSV ({exc})") from None
    header = next((k for k, (_, row) in enumerate(rows) if SAMPLES in row), None)
    if header is None:  # the header row names the sample column
        raise SystemExit(f"ncu_stalls: {path} has no '{SAMPLES}' column (need --page source --csv)")
    hdr = rows[header][1]
    if "Source" not in hdr:
        raise SystemExit(f"ncu_stalls: {path}: line {rows[header][0]} has no 'Source' column "
                         "(need --print-source sass)")  # fmt: skip
    counts = [i for i, h in enumerate(hdr) if h == SAMPLES or h.startswith("stall_")]
    data = []
    for line, row in rows[header + 1 :]:
        if len(row) < len(hdr):
            raise SystemExit(f"ncu_stalls: {path}: line {line} has {len(row)} columns; the "
                             f"header has {len(hdr)}")  # fmt: skip
        for i in counts:
            if row[i] and not (row[i].isascii() and row[i].isdigit()):
                raise SystemExit(f"ncu_stalls: {path}: line {line}, column '{hdr[i]}': sample "
                                 f"counts must be ints >= 0; got {row[i]!r}")  # fmt: skip
        data.append(row)
    return hdr, data


def _share(text: str) -> float:
    """``--min-share``: a finite percent >= 0 (nan would hide every stretch)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite percent >= 0; got {text!r}")
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument(
        "--min-share", type=_share, default=0.3, help="percent; shorter stretches hidden"
    )
    args = ap.parse_args(argv)
    hdr, data = load(args.csv)
    i_s, i_src = hdr.index(SAMPLES), hdr.index("Source")
    count = lambda r: int(r[i_s] or 0)  # noqa: E731
    total = sum(count(r) for r in data)
    if total == 0:
        raise SystemExit("ncu_stalls: no stall samples in the report")
    reasons = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    print(f"{total} samples; stall reasons (share of all samples):")
    sums = {hdr[i]: sum(int(r[i] or 0) for r in data) for i in reasons}
    for name, v in sorted(sums.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {name[6:]:18s} {100 * v / total:5.1f}%")
    print("stretches ending at a synchronisation point (first-last SASS line, share, end):")
    first = 0
    for j, r in enumerate(data):
        if any(m in r[i_src] for m in MARKERS) or j == len(data) - 1:
            share = 100 * sum(count(x) for x in data[first : j + 1]) / total
            if share >= args.min_share:
                print(f"  {first:5d}-{j:5d} {share:5.1f}%  {r[i_src].strip()[:60]}")
            first = j + 1
    by_barrier: dict[str, list[int]] = {}
    for j, r in enumerate(data):
        m = TRY_WAIT.search(r[i_src])
        if m:
            n = count(r)
            if j + 1 < len(data) and RETRY.match(data[j + 1][i_src]):
                n += count(data[j + 1])
            site = by_barrier.setdefault(m.group(1), [0, 0])
            site[0] += 1
            site[1] += n
    if by_barrier:
        print("mbarrier waits (try-wait and its retry branch) by address (sites, share):")
        for operand, (sites, n) in sorted(by_barrier.items(), key=lambda kv: -kv[1][1]):
            print(f"  {operand:18s} {sites:3d} {100 * n / total:5.1f}%")
    depbar = sum(count(r) for r in data if "WARPGROUP.DEPBAR" in r[i_src])
    print(f"wgmma waits (WARPGROUP.DEPBAR): {100 * depbar / total:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
