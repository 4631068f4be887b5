"""bench/diag_tma.py on a CPU: at each block size the copies kernel compiles for sm_90 to the TMA
copies a tile it says it times (the prefill kernel's: 2-D K halves, 3-D V page boxes at block
16), with no spills, in the prefill kernel's shared memory for K and V; its reference gathers
the cache's rows through the block table; bad arguments stop it, naming them."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import in_spawned_workers

_BENCH = Path(__file__).resolve().parents[1] / "bench"
_COPY = re.compile(r"cp\.async\.bulk\.tensor\.(\d)d")


def _load():
    sys.path.insert(0, str(_BENCH))  # the script imports _common from there
    import diag_tma

    return diag_tma


def _compile(block_size: int, check: bool, k_only: bool) -> tuple[str, int, int]:
    """(the dimensions of the PTX's tensor copies in program order, spills, shared bytes)."""
    from portattn.compile.worker import _nvidia_resources, compile_kernel
    from portattn.platform import get_target

    d = _load()
    target = get_target("sm_90")
    launch = d.make_launch(block_size, 100, 132, target, "meta", check=check, k_only=k_only)
    compiled = compile_kernel(launch, target)
    dims = "".join(_COPY.findall(compiled.asm["ptx"]))
    return dims, _nvidia_resources(compiled, 90)[1], compiled.metadata.shared


@pytest.mark.compile
def test_each_block_size_compiles_to_the_prefill_kernels_copies():
    jobs = [(16, False, False), (16, True, False), (544, False, False), (2048, False, False),
            (16, False, True)]  # fmt: skip
    got = in_spawned_workers(_compile, jobs)
    d = _load()
    want = {
        (16, False, False): "223" * 8,  # 8 page boxes: K in two halves, V in one 3-D copy
        (16, True, False): "223" * 8,  # (CHECK only adds the consumer's stores)
        (544, False, False): "2222" * 4,  # 4 boxes of 32 rows, K and V in halves
        (2048, False, False): "2222",
        (16, False, True): "22" * 8,
    }
    for job, (dims, spills, shared) in got.items():
        assert dims == want[job], job
        assert len(dims) == d.copies_a_tile(job[0], job[2]), job
        assert spills == 0, job
        # the prefill kernel's 3 stages of [128, 128] bf16 K and V (K only: V's buffers are
        # never used, and dropped), and barriers
        ring = (1 if job[2] else 2) * 3 * 128 * 128 * 2
        assert ring <= shared <= ring + 1024, job


def test_copies_a_tile():
    d = _load()
    assert [d.copies_a_tile(b) for b in (16, 32, 544, 2048)] == [24, 16, 16, 4]
    assert d.copies_a_tile(16, k_only=True) == 16


def test_expected_tiles_follow_the_block_table():
    """The reference against a row-by-row gather: tile ``i`` holds tokens ``128 i ..`` of KV
    head 0, token ``p`` at page ``table[p // bs]``, slot ``p % bs``; tiles wrap past the
    sequence's 32."""
    d = _load()
    bs = 16
    n_pages = d.CTX // bs
    g = torch.Generator().manual_seed(3)
    k = torch.randn(n_pages, bs, d.HKV, d.D, generator=g)
    v = torch.randn(n_pages, bs, d.HKV, d.D, generator=g)
    table = torch.randperm(n_pages, generator=g).to(torch.int32)
    want_k, want_v = d.expected(k, v, table, bs, 34)
    assert want_k.shape == (34, 128, d.D)
    for tile, row in ((0, 0), (5, 77), (31, 127), (33, 3)):
        p = (tile % 32) * 128 + row
        page, slot = int(table[p // bs]), p % bs
        assert torch.equal(want_k[tile, row], k[page, slot, 0])
        assert torch.equal(want_v[tile, row], v[page, slot, 0])


@pytest.mark.parametrize("argv", [["--tiles", "0"], ["--blocks", "8"], ["--blocks", "24"]])
def test_bad_arguments_stop_naming_them(argv):
    with pytest.raises(SystemExit, match="--tiles must be >= 1 and --blocks multiples of 16"):
        _load().main(argv)
