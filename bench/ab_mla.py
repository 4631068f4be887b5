"""An A/B of `portattn.policy.mla`'s boolean switches at the MLA page points, timed in turns.

`bench_mla.py --set` runs one configuration a process, so an A/B of two processes compares a
cooler card with a warmer one (the eighth-to-fourteenth sessions' A/Bs moved 2-5% with the
order). Here every configuration's call is planned, checked against the fp64 reference and
graph-timed at each point, then timed again round after round, the configurations in turns
(a, b, c, a, b, c, ...), with the bf16 matmul rate measured before each round. Each row keeps
the median of its rounds; the ratio to the first configuration is taken within each round (the
configurations of a round run on the same card state), then the median of those.

Each configuration is a space-separated list of ``SWITCH=0|1`` (``""``: the policy as it
stands); the plan cache is emptied around each (the switches are read at planning), and each
timing captures its call afresh under its own switches, as `bench_prefill.py --variants` does.

Usage (a GPU machine, from the repository root)::

    python bench/ab_mla.py --config "" --config "SM90_MASK_LAST_ONLY=1" --rounds 5
    OUT=/tmp/out python bench/ab_mla.py ...   # also writes $OUT/ab_mla.json
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from _common import (
    copy_ceiling,
    git_commit,
    matmul_rate,
    parse_switch,
    roofline_s,
    save_record,
    switched,
)
from bench_mla import Point, bench_policy
from triton.testing import do_bench_cudagraph

from portattn.platform import current_target
from portattn.policy import mla as mla_policy


def parse_config(text: str) -> dict[str, bool]:
    """``"A=1 B=0"`` -> ``{"A": True, "B": False}``, each a boolean switch of the MLA policy
    (`_common.parse_switch`, which exits naming the rule on a bad item)."""
    return dict(parse_switch(mla_policy, item, "--config") for item in text.split())


def time_in_turns(runs_by_point, configs, rounds, rate, timer=None) -> list[float]:
    """Time every point's (row, call) per configuration ``rounds - 1`` more times: per round,
    ``rate()`` first, then each point's configurations in turns, each under its own switches;
    the timings (us) go to each row's ``us_rounds``. ``timer``: ``do_bench_cudagraph``'s median
    in ms unless given. Returns the rounds' rates."""
    timer = timer or (lambda call: do_bench_cudagraph(call, return_mode="median"))
    rates = []
    for _ in range(rounds - 1):
        rates.append(rate())
        for runs in runs_by_point:
            for cfg, (row, call) in zip(configs, runs, strict=True):
                with switched(mla_policy, cfg):
                    row["us_rounds"].append(timer(call) * 1e3)
    return rates


def summarize(rows, copy_gbs, mm_run, mm_turns) -> list[dict]:
    """One point's rows (one a configuration, the first the reference), each given the median
    of its rounds (``us_median``), the median of its round-by-round ratios to the first row
    (``vs_first``), and its ratio to the roofline at the run's and at the rounds' matmul rate."""
    base = rows[0]["us_rounds"]
    for row in rows:
        us = row["us_rounds"]
        row["us_median"] = float(statistics.median(us))
        row["vs_first"] = float(statistics.median(u / b for u, b in zip(us, base, strict=True)))
        row["mm_run"], row["mm_turns"] = mm_run, mm_turns
        row["x_roof_run"] = row["us_median"] * 1e-6 / roofline_s(row, copy_gbs, mm_run)
        row["x_roof_turns"] = row["us_median"] * 1e-6 / roofline_s(row, copy_gbs, mm_turns)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--config",
        action="append",
        required=True,
        help="SWITCH=0|1 items, space-separated (repeat: one per configuration)",
    )
    ap.add_argument("--heads", type=int, nargs="+", default=[128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--page", type=int, nargs="+", default=[64])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="timings a configuration, in turns")
    args = ap.parse_args(argv)  # fmt: skip
    if args.rounds < 1:
        sys.exit(f"ab_mla: --rounds must be >= 1; got {args.rounds}")
    configs = [parse_config(c) for c in args.config]
    if not torch.cuda.is_available():
        sys.exit("ab_mla: needs a CUDA device")
    # what Point reads of bench_mla's arguments
    args.head_dim_k, args.kv_lora_rank, args.resident = 576, 512, 0
    target = current_target()
    dtype = torch.bfloat16
    kv_bytes = args.batch * max(args.contexts) * args.head_dim_k * 2
    copy_gbs, _ = copy_ceiling(2 * kv_bytes)
    mm_run, _ = matmul_rate()
    print(f"device: {torch.cuda.get_device_name()} ({target.arch}), commit {git_commit()}; "
          f"copy {copy_gbs:.0f} GB/s, bf16 mm {mm_run:.0f} TFLOP/s")  # fmt: skip
    points = []  # (point, [(row, call) per configuration])
    for heads in args.heads:
        for ctx in args.contexts:
            for page in args.page:
                p = Point(args, target, dtype, heads, ctx, copy_gbs, mm_run, page)
                runs = []
                for cfg in configs:
                    with switched(mla_policy, cfg):
                        row, _ = bench_policy(p, timed=(timed := []))
                    if row is None:
                        print(f"FAIL: {cfg} at {heads} heads {ctx} page {page}")
                        return 1
                    row["config"] = " ".join(f"{k}={int(v)}" for k, v in cfg.items())
                    row["us_rounds"] = [row["us_graph"]]
                    runs.append(timed[0])
                points.append((p, runs))
    rates = [mm_run] + time_in_turns([runs for _, runs in points], configs, args.rounds,
                                     lambda: matmul_rate()[0])  # fmt: skip
    mm = float(statistics.median(rates))
    print(f"== {args.rounds} rounds in turns; matmul rate before each: "
          f"{', '.join(f'{r:.0f}' for r in rates)} TFLOP/s (median {mm:.0f})")  # fmt: skip
    rows = []
    for _, runs in points:
        rows += summarize([row for row, _ in runs], copy_gbs, mm_run, mm)
    for row in rows:
        print(
            f"  {row['heads']:>4} h {row['context']:>6} page {row['page']:>2} "
            f"[{row['config'] or 'policy'}]: {row['us_median']:.1f} us "
            f"(of {', '.join(f'{u:.1f}' for u in row['us_rounds'])}); "
            f"vs first {row['vs_first']:.4f}; x roofline {row['x_roof_run']:.3f} at the run's "
            f"rate, {row['x_roof_turns']:.3f} at the rounds'; err {row['rel_err_kernel']:.2e}"
        )
    save_record("ab_mla", configs=args.config, mm_rounds=rates, copy_gb_per_s=copy_gbs, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
