"""Does the compile matrix see what the GPU sees? Shared memory of a few cells, CPU vs H100.

The compile matrix (`portattn.compile`) compiles each launch for sm_90 from meta tensors on a
machine with no GPU. This script compiles a few of its cells both ways and prints them side by
side:

* ``matrix``: the matrix's own path (meta tensors, Triton's binder built for sm_90, no device);
  optionally also the figures a CPU-only machine recorded (``--cpu-json``).
* ``device``: the real JIT on a CUDA device: the same plan on real CUDA tensors (same shapes and
  strides), ``kernel.warmup(...)`` (compile, no launch), then the loaded kernel's
  ``metadata.shared``, ``n_regs`` and ``n_spills`` as the driver reports them.

Usage::

    python bench/compile_vs_device.py --write-json bench/compile_vs_device_cpu.json  # CPU machine
    python bench/compile_vs_device.py --cpu-json bench/compile_vs_device_cpu.json    # on an H100

Exit status 1 when any launch's shared memory differs between the columns.
"""

from __future__ import annotations

import argparse
import json
import sys

ARCH = "sm_90"
CELLS = (
    "paged_attention/hd128 gqa5 bs16 NHD decode",
    "paged_attention/hd64 gqa8 bs2048 SHUFFLE prefill",
    "mla_decode/576/512 h16",
    "mla_decode/320/256 h128",
    "write_kv_cache/hd128 bs544 SHUFFLE",
    "gather_kv_cache/hd256 bs80 NHD",
)


def matrix_figures(ids: list[str]) -> dict[str, dict]:
    """``{cell/launch: {shared, regs, spills, hash}}`` from the compile matrix's path."""
    from portattn.compile import default_cases, run_matrix

    by_id = {c.id: c for c in default_cases()}
    out = {}
    for cell in run_matrix([by_id[i] for i in ids], [ARCH]):
        for r in cell.launches:
            out[f"{cell.kernel}/{cell.case}/{r.name}"] = {
                "ok": r.ok,
                "shared": r.shared,
                "regs": r.regs,
                "local": r.scratch,
                "spills": r.spills,
                "hash": r.hash,
                "error": r.error,
            }
    return out


def _on_device(t, device):
    import torch

    if isinstance(t, torch.Tensor) and t.device.type == "meta":
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return t


def device_figures(ids: list[str]) -> dict[str, dict]:
    """The same launches JIT-compiled on the CUDA device (no launch: ``warmup``)."""
    import torch

    from portattn.compile import default_cases
    from portattn.platform import get_target

    major, minor = torch.cuda.get_device_capability()
    if f"sm_{major}{minor}" != ARCH:
        raise SystemExit(f"compile_vs_device: needs an {ARCH} GPU; got sm_{major}{minor}")
    target = get_target(ARCH)
    by_id = {c.id: c for c in default_cases()}
    out = {}
    for cid in ids:
        case = by_id[cid]
        for launch in case.plan(target):
            args = {k: _on_device(v, "cuda") for k, v in launch.args.items()}
            kernel = launch.kernel.warmup(grid=launch.grid, **args, **launch.options.kwargs(target))
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            kernel._init_handles()  # load on the device: the driver's register figures
            out[f"{case.kernel}/{case.name}/{launch.name}"] = {
                "ok": True,
                "shared": int(kernel.metadata.shared),
                "regs": int(kernel.n_regs),
                # Triton's n_spills is the driver's local-memory bytes / 4.
                "local": 4 * int(kernel.n_spills),
                "spills": None,
                "hash": kernel.metadata.hash,
                "error": None,
            }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write-json", help="write the matrix-path figures to this file")
    p.add_argument("--cpu-json", help="figures a CPU-only machine recorded (--write-json)")
    args = p.parse_args()

    ids = list(CELLS)
    columns: dict[str, dict[str, dict]] = {}
    if args.cpu_json:
        with open(args.cpu_json) as f:
            columns["cpu machine"] = json.load(f)["launches"]
    columns["matrix here"] = matrix_figures(ids)
    if args.write_json:
        import triton

        with open(args.write_json, "w") as f:
            json.dump(
                {"arch": ARCH, "triton": triton.__version__, "launches": columns["matrix here"]},
                f,
                indent=1,
            )
    import torch

    if torch.cuda.is_available():
        columns["device JIT"] = device_figures(ids)
    else:
        print("no CUDA device here: matrix figures only", file=sys.stderr)

    names = list(columns)
    keys = list(dict.fromkeys(k for col in columns.values() for k in col))
    width = max(len(k) for k in keys)
    head = " | ".join(f"{n:>26}" for n in names)
    print(f"{'cell/launch (' + ARCH + ')':<{width}} | {head} | same shared | same hash")
    print(f"{'':<{width}} | " + " | ".join(f"{'shared  regs local':>26}" for _ in names))
    mismatch = False
    for k in keys:
        vals = [columns[n].get(k) for n in names]
        cells = [
            f"{v['shared']:>8} {v['regs'] or 0:>5} {v['local'] or 0:>5}".rjust(26)
            if v and v["ok"]
            else f"{'error' if v else 'absent':>26}"
            for v in vals
        ]
        shared = {v["shared"] for v in vals if v and v["ok"]}
        hashes = {v["hash"] for v in vals if v and v["ok"]}
        same = len(shared) == 1 and all(v and v["ok"] for v in vals)
        mismatch |= not same
        print(
            f"{k:<{width}} | " + " | ".join(cells) + f" | {'yes' if same else 'NO':>11} | "
            f"{'yes' if len(hashes) == 1 else 'no'}"
        )
    print(
        "regs / local (bytes of local memory per thread): matrix columns from cuobjdump on the "
        "cubin (REG, STACK+LOCAL); device column from the driver (n_regs, 4 x n_spills)."
    )
    return 1 if mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
