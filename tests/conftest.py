"""Test configuration: device selection and the `gpu` marker."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_GPU = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA/HIP device (marker gpu)")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """Where CPU-gate kernel tests run: 'cpu' under TRITON_INTERPRET=1, else the GPU."""
    if INTERPRET or not HAS_GPU:
        if not INTERPRET:
            pytest.skip("kernel tests need TRITON_INTERPRET=1 (CPU) or a GPU")
        return "cpu"
    return "cuda"
