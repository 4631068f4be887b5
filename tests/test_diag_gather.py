"""bench/diag_gather.py on a CPU: each mode compiles for sm_90 (no GPU; a spawned process, as the
compile matrix does) to the copies it says it times, with no register spills, and the reference
the GPU run checks against weights each column (so a swizzle that lands 16-byte pieces in the
wrong place is seen, which a plain sum would not)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import in_spawned_workers

_BENCH = Path(__file__).resolve().parents[1] / "bench"
_TMA = re.compile(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global")


def _load():
    sys.path.insert(0, str(_BENCH))  # the script imports _common from there
    spec = importlib.util.spec_from_file_location("diag_gather", _BENCH / "diag_gather.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _compile(mode: str) -> dict:
    from portattn.compile.worker import _resources, compile_kernel
    from portattn.kernels._launch import Launch
    from portattn.platform import get_target
    from portattn.policy.common import LaunchOptions

    d = _load()
    target = get_target("sm_90")
    meta = dict(device="meta")
    cache = torch.empty(64 * 512, d.ROW_, dtype=torch.bfloat16, **meta)
    lat, pe = d.layouts()
    names = ["lat_desc", "pe_desc", "row_lat", "row_pe"]
    descs = dict(zip(names, d.descriptors(cache), strict=True))
    args = dict(
        kv_ptr=cache,
        idx_ptr=torch.empty(64 * 512, dtype=torch.int32, **meta),
        out_ptr=torch.empty(64, dtype=torch.float32, **meta),
        cyc_ptr=torch.empty(64, dtype=torch.int64, **meta),
        **descs,
        tiles_per=8,
        MODE=d.MODES[mode],
        LAYOUT=lat,
        PE_LAYOUT=pe,
    )
    launch = Launch(d._kernel, (64,), args, LaunchOptions(num_warps=4, num_stages=1), target)
    compiled = compile_kernel(launch, target)
    ptx = compiled.asm["ptx"]
    _, spills, _ = _resources(compiled, target)
    return dict(
        tma=len(_TMA.findall(ptx)), cp_async=ptx.count("cp.async.cg.shared.global"), spills=spills
    )


@pytest.fixture(scope="module")
def compiled() -> dict:
    got = in_spawned_workers(_compile, [(mode,) for mode in _load().MODES])
    return {job[0]: result for job, result in got.items()}


# copies in the PTX, over the kernel's two issue sites (the first tile, then each next one):
# cp.async: 9 64-column parts of 32 elements a thread (4 copies each); 1-row TMA boxes: 64 rows x
# 9 boxes; pages: two [64, 256] latent boxes and the rope box, one instruction each
@pytest.mark.compile
@pytest.mark.parametrize(
    ("mode", "tma", "cp_async"),
    [("cp.async", 0, 2 * 9 * 4), ("tma-rows", 2 * 64 * 9, 0), ("tma-pages", 2 * 3, 0)],
)
def test_modes_compile_to_their_copies(compiled, mode, tma, cp_async):
    got = compiled[mode]
    assert (got["tma"], got["cp_async"], got["spills"]) == (tma, cp_async, 0), got


def test_reference_weights_each_column():
    d = _load()
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2 * d.ROWS_, d.ROW_, generator=gen)
    idx = torch.randperm(2 * d.ROWS_, generator=gen).to(torch.int32)
    got = d.reference(cache, idx, programs=2, tiles_per=1)
    w = torch.arange(1, 65, dtype=torch.float32)
    for p in range(2):
        rows = cache[idx[p * d.ROWS_ : (p + 1) * d.ROWS_].long()]
        want = ((rows[:, 0:64] + rows[:, 448:512] + rows[:, 512:576]) * w).sum()
        torch.testing.assert_close(got[p], want)
    swapped = cache.clone()
    swapped[:, 0:8], swapped[:, 8:16] = cache[:, 8:16], cache[:, 0:8]  # two 16-byte pieces
    assert not torch.allclose(d.reference(swapped, idx, 2, 1), got)
