"""Run the policy's MLA decode launches once per point, for a profiler (ncu) to attach to.

Usage (on the GPU machine)::

    ncu --clock-control none --section SpeedOfLight -k regex:_mla_decode_kernel \
        python3 bench/profile_mla.py 16:4096 128:16384
        python3 bench/profile_mla.py 128:16384:64 128:16384:1   # page sizes (TMA, gather)

A spec is ``heads:context[:page]`` (page size 64 by default).
"""

from __future__ import annotations

import math
import sys

import torch
from bench_mla import make_inputs

from portattn.kernels._launch import run_all
from portattn.kernels.mla_decode import plan_mla_decode

for spec in sys.argv[1:] or ["16:4096", "128:16384"]:
    heads, ctx, page = ([int(x) for x in spec.split(":")] + [64])[:3]
    q, cache, bt, sl = make_inputs(64, ctx, heads, 576, page, torch.bfloat16)
    launches = plan_mla_decode(q, cache, bt, sl, kv_lora_rank=512, scale=1 / math.sqrt(576))
    run_all(launches)
    torch.cuda.synchronize()
    print(spec, [(ln.name, ln.grid, ln.options) for ln in launches], flush=True)
