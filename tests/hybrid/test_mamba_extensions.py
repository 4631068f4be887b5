"""mamba-ssm and causal-conv1d, where they import: their CUDA kernels against torch references.

They are source-only CUDA/HIP extensions (built into the GPU images, pinned in pyproject.toml's
``[tool.portattn] mamba-extensions``); without them these tests skip with the reason, which
pytest's summary (``-ra``) shows. They are `hybrid` tests, not `gpu` ones, so that a CPU machine
reports the missing package rather than only the missing device.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_low_precision_close

pytestmark = pytest.mark.hybrid

ROOT = Path(__file__).resolve().parents[2]
MAMBA_REASON = "mamba-ssm not installed (CUDA/HIP extension; built into the GPU images)"
CONV_REASON = "causal-conv1d not installed (CUDA/HIP extension; built into the GPU images)"
# (batch, channels, length): Nemotron-Nano-9B-v2's Mamba2 conv channels per rank at TP 1 / 8.
CONV_SHAPES = ((2, 12288, 256), (3, 1536, 1000))
# (batch, dim, state, length): Jamba's Mamba1 (inner 8192 / TP 8, state 16), Falcon-H1-like.
SCAN_SHAPES = ((2, 1024, 16, 512), (1, 768, 64, 300))


def _import(name: str, reason: str):
    """The extension module; skip without it, but fail in a CI image, which is built with it (a
    broken build there must not pass the hybrid cell as a skip)."""
    try:
        return __import__(name, fromlist=["_"])
    except (ImportError, OSError) as exc:  # OSError: an extension built for another torch/driver
        if os.environ.get("PORTATTN_IMAGE") == "1":
            pytest.fail(f"{name} must import in the CI image (built into it); got {exc!r}")
        pytest.skip(reason)


def test_a_missing_extension_skips_outside_the_image_and_fails_in_it(monkeypatch):
    monkeypatch.delenv("PORTATTN_IMAGE", raising=False)
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        _import("portattn_no_such_extension", "portattn_no_such_extension not installed")
    monkeypatch.setenv("PORTATTN_IMAGE", "1")
    with pytest.raises(pytest.fail.Exception, match="must import in the CI image"):
        _import("portattn_no_such_extension", "portattn_no_such_extension not installed")


def _cuda() -> str:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA/HIP device")
    return "cuda"


def conv1d_ref(x, weight, bias, compute_dtype):
    """Causal depthwise conv + SiLU: ``x [b, d, l]``, ``weight [d, w]``."""
    x, weight, bias = (t.to(compute_dtype) for t in (x, weight, bias))
    w = weight.shape[1]
    y = F.conv1d(x, weight[:, None, :], bias, padding=w - 1, groups=x.shape[1])[..., : x.shape[2]]
    return F.silu(y)


def selective_scan_ref(u, delta, A, B, C, D, compute_dtype):
    """Mamba1 recurrence ``h_t = exp(dt*A) h_{t-1} + dt*B_t*u_t``, ``y_t = C_t.h_t + D*u_t``.

    ``u, delta [b, d, l]``, ``A [d, n]``, ``B, C [b, n, l]``, ``D [d]``.
    """
    u, delta, A, B, C, D = (t.to(compute_dtype) for t in (u, delta, A, B, C, D))
    h = torch.zeros((*u.shape[:2], A.shape[1]), dtype=compute_dtype, device=u.device)
    ys = []
    for t in range(u.shape[2]):
        dt = delta[:, :, t, None]
        h = torch.exp(dt * A) * h + dt * B[:, None, :, t] * u[:, :, t, None]
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, dim=-1) + D[:, None] * u


@pytest.mark.parametrize("shape", CONV_SHAPES, ids=str)
def test_causal_conv1d_matches_torch(shape):
    mod = _import("causal_conv1d", CONV_REASON)
    device = _cuda()
    b, d, length = shape
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, generator=g, device=device).to(torch.bfloat16)
    weight = (torch.randn((d, 4), generator=g, device=device) / 2).to(torch.bfloat16)
    bias = torch.randn(d, generator=g, device=device).to(torch.bfloat16)
    out = mod.causal_conv1d_fn(x, weight, bias, activation="silu")
    oracle = conv1d_ref(x, weight, bias, torch.float64)
    lowp = conv1d_ref(x, weight, bias, torch.bfloat16)
    assert_low_precision_close(out, oracle, lowp)


@pytest.mark.parametrize("shape", SCAN_SHAPES, ids=str)
def test_selective_scan_matches_torch(shape):
    _import("mamba_ssm", MAMBA_REASON)
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

    device = _cuda()
    b, d, n, length = shape
    g = torch.Generator(device=device).manual_seed(1)
    bf = lambda *s: torch.randn(s, generator=g, device=device).to(torch.bfloat16)  # noqa: E731
    u, B, C = bf(b, d, length), bf(b, n, length), bf(b, n, length)
    delta = F.softplus(torch.randn((b, d, length), generator=g, device=device) - 2)
    A = -torch.exp(torch.randn((d, n), generator=g, device=device) / 2)  # fp32, as Mamba keeps it
    D = torch.randn(d, generator=g, device=device)
    delta = delta.to(torch.bfloat16)
    out = selective_scan_fn(u, delta, A, B, C, D)
    oracle = selective_scan_ref(u, delta, A, B, C, D, torch.float64)
    lowp = selective_scan_ref(u, delta, A, B, C, D, torch.bfloat16)
    assert_low_precision_close(out, oracle, lowp)


@pytest.mark.parametrize("dockerfile", ("Dockerfile.cuda", "Dockerfile.rocm"))
def test_images_build_the_pinned_versions(dockerfile):
    """The images' build arguments and pyproject's pins name the same versions."""
    line = re.search(r"^mamba-extensions = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert line is not None
    want = dict(p.strip(' "').split("==") for p in line.group(1).split(","))
    text = (ROOT / dockerfile).read_text()
    got = {
        "mamba-ssm": set(re.findall(r"ARG MAMBA_SSM_VERSION=(\S+)", text)),
        "causal-conv1d": set(re.findall(r"ARG CAUSAL_CONV1D_VERSION=(\S+)", text)),
    }
    assert got == {k: {v} for k, v in want.items()}
