"""A GPU cell runs on the architecture it names: its first test compares the live device with
``PORTATTN_CELL_ARCH`` (set by every runner of a GPU cell), so a cell scheduled onto the wrong
GPU fails loudly instead of passing with the wrong tiles. The architecture it found is recorded
in the JUnit report (property ``gpu_arch``), where the matrix summary reads it."""

from __future__ import annotations

import os

import pytest
import torch

from portattn.platform import device_arch
from tests.conftest import ARCH_ENV


def _why_no_gpu() -> str:
    """Torch's own reason for seeing no device (driver, toolkit, visible devices)."""
    try:
        torch.cuda.init()
    except Exception as exc:  # torch raises its reason as a RuntimeError or AssertionError
        return str(exc).strip().splitlines()[0]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"torch.cuda.is_available() is False (CUDA_VISIBLE_DEVICES={visible!r})"


@pytest.mark.gpu
@pytest.mark.paged
@pytest.mark.mla
@pytest.mark.hybrid
@pytest.mark.specdec
def test_the_live_gpu_is_the_cells_architecture(record_property):
    wanted = os.environ.get(ARCH_ENV)
    if not torch.cuda.is_available():  # only a GPU cell gets here (conftest skips it elsewhere)
        pytest.fail(f"this cell targets {wanted} but torch sees no GPU: {_why_no_gpu()}")
    found = device_arch()
    record_property("gpu_arch", found)
    if not wanted:
        pytest.skip(f"not a matrix cell ({ARCH_ENV} unset); this GPU is {found}")
    assert found == wanted, (
        f"this cell targets {wanted} but runs on a {found} GPU: its node selector or the pool's "
        f"labels are wrong, and its results would test {found}'s tiles"
    )
