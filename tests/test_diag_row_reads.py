"""bench/diag_row_reads.py on a CPU: the index orders it times and its kernel's sums (under the
interpreter), which the GPU run checks against torch before it reports a rate."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(_BENCH))  # the script imports _common from there
_SPEC = importlib.util.spec_from_file_location("diag_row_reads", _BENCH / "diag_row_reads.py")
drr = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(drr)


def test_orders_are_permutations_of_every_row_pages_kept_whole():
    gen = torch.Generator().manual_seed(0)
    rows = 4 * drr.ROWS
    got = drr.orders(rows, gen)
    assert list(got) == ["sequential", "pages 64", "rows 1"]
    for idx in got.values():
        assert idx.dtype == torch.int32 and sorted(idx.tolist()) == list(range(rows))
    pages = got["pages 64"].view(-1, drr.ROWS)
    assert torch.equal(pages - pages[:, :1], torch.arange(drr.ROWS).expand_as(pages))
    assert pages[:, 0].tolist() != list(range(0, rows, drr.ROWS))  # shuffled (seed 0)


@pytest.mark.cpu
@pytest.mark.parametrize("readers", [1, 2])
def test_each_program_sums_its_row_group(readers):
    """Program p sums rows ``idx[(p // readers) * 64 : ... + 64]`` over all 576 columns."""
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(3 * drr.ROWS, drr.ROW, generator=gen, dtype=torch.float16)
    idx = drr.orders(3 * drr.ROWS, gen)["rows 1"]
    out = torch.empty(3 * readers)
    drr._row_sums[(3 * readers,)](cache, idx, out, cache.stride(0), drr.ROWS, drr.ROW, drr.CHUNK,
                                  readers)  # fmt: skip
    ref = cache[idx.long()].double().view(3, -1).sum(1).repeat_interleave(readers)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-3)
