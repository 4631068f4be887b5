"""bench/model_deal.py: the item costs it models are the work list's, and its two deals are the
kernel's (`program_items`), so the figures quoted in `SM90_PREFILL_DYNAMIC`'s comment come from
the code that runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "model_deal.py"
_SPEC = importlib.util.spec_from_file_location("model_deal", _PATH)
md = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(md)


def test_items_are_the_work_lists_tiles():
    """A 300-token chunk at context 1000 (q tiles of 32 tokens, heaviest first) and a decode: the
    chunk's last q tile sees all 1000 keys (8 tiles), its first the 700 + 32 before it (6)."""
    main, decodes = md.items([(1000, 300), (500, 1)], 32, 2)
    assert decodes == 2
    assert len(main) == 2 * 10
    assert main[:2] == [8, 8] and main[-2:] == [6, 6]
    assert main == sorted(main, reverse=True)


def test_pure_prefill_ends_unevenly_when_dealt_and_evenly_from_a_counter():
    """The policy comment's figures for pure prefill 8x4096: 2.7% dealt, 0.1% dynamic."""
    main, n_b = md.items([(4096, 4096)] * 8, 32, 8)
    dealt, dynamic, last = md.spread(main, n_b, 0, 132)
    assert dealt == pytest.approx(1.0273, abs=5e-4)
    assert dynamic == pytest.approx(1.0010, abs=5e-4)
    assert last == dynamic  # no decodes: the same order


def test_one_program_is_its_own_mean():
    main, n_b = md.items([(4096, 2048)] * 2 + [(4096, 1)] * 3, 32, 8)
    assert md.spread(main, n_b, 12, 1) == pytest.approx((1.0, 1.0, 1.0))
