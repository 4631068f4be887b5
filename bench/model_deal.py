"""How evenly the sm_90 prefill kernel's persistent programs end, by a model (CPU only).

An item's cost is its K/V tiles (128 keys each; `_item`'s ``n_tiles``); a fused decode item
costs ``--decode-cost`` tiles (a guess: it streams 4k tokens of one KV head while other programs
compute). Two deals of the same items over ``--programs`` programs:

* dealt: round-robin when the launch starts (`program_items`, `SM90_PREFILL_DYNAMIC` off);
* dynamic: the launch's order (`program_items` of one program), each item taken by the program
  that is free first (`SM90_PREFILL_DYNAMIC` on: a counter);
* decodes last: the same, the decode items after every prefill item (not built: a model only).

Prints, per bench_prefill point, the last program's end over the mean (1.0 = all end together).
Usage: ``PYTHONPATH=src python3 bench/model_deal.py [--programs 132] [--decode-cost 6 12 18]``
"""

from __future__ import annotations

import argparse
import heapq
import sys

from portattn.kernels.paged_prefill_sm90 import program_items

BLOCK_N = 128


def items(seqs, block_q: int, slots: int) -> tuple[list[int], list[int]]:
    """(main-list costs, decode-list count) of ``seqs`` ((seq_len, q_len) pairs) as the work-list
    kernel lists them: q tiles heaviest first within a sequence, ``slots`` head slots each."""
    main, decodes = [], 0
    for seq_len, q_len in seqs:
        if q_len == 1:
            decodes += slots
            continue
        ctx = seq_len - q_len
        for t in reversed(range(-(-q_len // block_q))):
            kv_end = min(seq_len, ctx + (t + 1) * block_q)
            main += [-(-kv_end // BLOCK_N)] * slots
    return main, decodes


def greedy(costs: list[float], nprog: int) -> float:
    """When the last program ends, each of ``costs`` (in order) taken by the first free one."""
    free = [(0.0, p) for p in range(nprog)]
    for c in costs:
        t, p = heapq.heappop(free)
        heapq.heappush(free, (t + c, p))
    return max(t for t, _ in free)


def spread(main: list[int], n_b: int, decode_cost: float, nprog: int) -> tuple[float, ...]:
    """(dealt, dynamic, decodes last): the last program's end over the mean, for each deal."""
    cost = lambda second, j: decode_cost if second else main[j]  # noqa: E731
    dealt = [sum(cost(*x) for x in program_items(p, nprog, len(main), n_b)) for p in range(nprog)]
    mean = sum(dealt) / nprog
    dynamic = greedy([cost(*x) for x in program_items(0, 1, len(main), n_b)], nprog)
    last = greedy(main + [decode_cost] * n_b, nprog)
    return max(dealt) / mean, dynamic / mean, last / mean


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, default=132, help="persistent programs (SMs)")
    ap.add_argument("--decode-cost", type=float, nargs="+", default=[6, 12, 18])
    a = ap.parse_args(argv)
    # bench_prefill's points: 32 query / 8 KV heads, head_dim 128 (128 rows = 32 tokens x 4
    # heads, 8 head slots)
    points = {
        "mixed 8x512 + 56x1 @4k": [(4096, 512)] * 8 + [(4096, 1)] * 56,
        "mixed 8x2048 + 56x1 @4k": [(4096, 2048)] * 8 + [(4096, 1)] * 56,
        "prefill 8x4096": [(4096, 4096)] * 8,
    }
    print(f"{'point':26s} {'decode cost':>11s} {'dealt':>7s} {'dynamic':>8s} {'decodes last':>12s}")
    for name, seqs in points.items():
        main_costs, n_b = items(seqs, 32, 8)
        for dc in a.decode_cost if n_b else [0]:
            dealt, dynamic, last = spread(main_costs, n_b, dc, a.programs)
            print(f"{name:26s} {dc:11.0f} {dealt:7.4f} {dynamic:8.4f} {last:12.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
