"""The sm_90 MLA kernel on a CPU: which launches it takes, and its compile for sm_90 (shared
memory within the estimate, no spills). Its numerics run on the GPU (test_mla_decode.py,
``-k sm90``): Triton's interpreter cannot run Gluon."""

from __future__ import annotations

import pytest
import torch

from portattn.compile import default_cases, run_matrix
from portattn.kernels.mla_decode_sm90 import sm90_errors, sm90_smem_bytes
from portattn.platform import get_target

SM90 = get_target("sm_90")


def _cache(pages=4, block_size=64, width=576, dtype=torch.bfloat16):
    return torch.empty(pages, block_size, width, dtype=dtype, device="meta")


def test_takes_the_deepseek_shape():
    assert sm90_errors(_cache(), 512, 64, 64, SM90, paged_slots=False) == []
    assert sm90_errors(_cache(width=320), 256, 64, 64, SM90, paged_slots=False) == []


@pytest.mark.parametrize(
    ("kwargs", "rank", "tile", "target", "slots", "why"),
    [
        ({}, 512, (64, 64), get_target("sm_80"), False, "target sm_80 is not sm_90"),
        ({"dtype": torch.float32}, 512, (64, 64), SM90, False, "is not fp16/bf16"),
        ({}, 512, (16, 64), SM90, False, "tile H16 N64 is not H64 N64"),
        ({}, 512, (64, 64), SM90, True, "page_indices"),
        ({"width": 128}, 64, (64, 64), SM90, False, "kv_lora_rank 64 not in 128/256/512"),
        ({"width": 560}, 512, (64, 64), SM90, False, "rope width 48"),
        ({"width": 640}, 512, (64, 64), SM90, False, "shared memory"),
        ({"block_size": 32}, 512, (64, 64), SM90, False, "block_size 32 % 64"),
    ],
)
def test_refuses_what_it_cannot_run(kwargs, rank, tile, target, slots, why):
    errors = sm90_errors(_cache(**kwargs), rank, *tile, target, paged_slots=slots)
    assert any(why in e for e in errors), errors


def test_refuses_interleaved_pages():
    cache = torch.empty(64, 4, 576, dtype=torch.bfloat16, device="meta").transpose(0, 1)
    assert any(
        "not pages one after another" in e for e in sm90_errors(cache, 512, 64, 64, SM90, False)
    )


def test_compiles_for_sm90_within_its_estimate_without_spills():
    """Shared memory at most `sm90_smem_bytes` (and the target's), and no spills: ptxas spilled
    260 B when the loop's shared-memory descriptors were loop-invariant (module doc)."""
    case = {c.id: c for c in default_cases()}["mla_decode/576/512 h128 page64"]
    (cell,) = run_matrix([case], ["sm_90"])  # spawned workers: no interpreter
    (r,) = [launch for launch in cell.launches if launch.name == "mla_decode_sm90"]
    assert r.ok, r.error
    assert r.shared <= sm90_smem_bytes(512, 64) <= SM90.max_shared_mem
    assert r.spills == 0
