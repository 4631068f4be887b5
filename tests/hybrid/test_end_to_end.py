"""End to end: tiny hybrid models whose attention runs through portattn over interleaved pages.

Models are built from configuration with random weights (no downloads): a Jamba-style (Mamba1 +
attention + MoE) and a Qwen3-Next-style (Gated DeltaNet + gated attention) model from
transformers. A prefill then several decode steps; the logits must match the model's own eager
attention under the tolerance rule (design §5): error against the float64 eager model at most
2x that of the eager model in the run's precision. CPU: small, fp32, interpreter. GPU: larger,
bf16 (the fp64 oracle runs on the CPU).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import os
import sys

import pytest
import torch

from tests.helpers import assert_low_precision_close

pytestmark = pytest.mark.hybrid
tf = pytest.importorskip(
    "transformers", reason="transformers not installed (the 'hybrid' extra builds the models)"
)
from tests.hybrid._harness import NAME, PortattnAttention, generate_logits  # noqa: E402

FP32_FLOOR = 1e-6  # fp32: a few ulps of attention, carried through the layers


def jamba(small: bool):
    """Jamba-style: Mamba1 layer then attention layer, repeated (dense MLPs: the MoE's grouped
    matmul has no float64 kernel for the oracle)."""
    h, layers, heads, kv, inner = (64, 2, 4, 2, 4) if small else (1024, 4, 16, 4, 2)
    return tf.JambaConfig(
        vocab_size=256, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, attn_layer_period=2,
        attn_layer_offset=1, num_experts=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=inner,
        mamba_dt_rank=max(8, h // 16), tie_word_embeddings=False,
    )  # fmt: skip


def qwen3_next(small: bool):
    """Qwen3-Next-style: Gated DeltaNet layers and one gated full-attention layer in N (dense)."""
    if small:
        h, heads, kv, hd, nk, nv, dk, types = 64, 4, 2, 16, 2, 8, 16, ["linear_attention",
                                                                      "full_attention"]  # fmt: skip
    else:
        h, heads, kv, hd, nk, nv, dk = 1024, 8, 2, 256, 4, 8, 128
        types = ["linear_attention"] * 3 + ["full_attention"]
    return tf.Qwen3NextConfig(
        vocab_size=256, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=len(types),
        layer_types=types, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
        linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=dk,
        linear_value_head_dim=dk, linear_conv_kernel_dim=4, mlp_only_layers=list(range(len(types))),
        tie_word_embeddings=False,
    )  # fmt: skip


# Model classes by name, resolved when a test runs: transformers imports a model's module on
# first use (seconds each), so collecting this file imports neither.
MODELS = {
    "jamba": (jamba, "JambaForCausalLM"),
    "qwen3_next": (qwen3_next, "Qwen3NextForCausalLM"),
}


def _kernel_functions(module) -> dict:
    """The module's functions that transformers binds, at import, to an installed package's
    kernel (mamba-ssm, causal-conv1d, fla) with the readable torch path kept as ``__wrapped__``."""
    return {
        name: fn
        for name, fn in vars(module).items()
        if callable(fn)
        and getattr(getattr(fn, "__wrapped__", None), "__module__", None) == module.__name__
    }


def _bound_implementation(fn):
    """What a `_kernel_functions` entry runs: the package's kernel or the torch path."""
    return inspect.getclosurevars(fn).nonlocals.get("implementation", fn.__wrapped__)


@contextlib.contextmanager
def torch_paths(model_class):
    """Run ``model_class``'s model on its torch paths: the float64 oracle cannot go through the
    CUDA kernels (16/32-bit only) that transformers binds whenever the packages import."""
    module = sys.modules[model_class.__module__]
    saved = _kernel_functions(module)
    for name, fn in saved.items():
        setattr(module, name, fn.__wrapped__)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def _run(name, *, small, dtype, device, batch, prompt, steps):
    make_config, class_name = MODELS[name]
    cls = getattr(tf, class_name)
    cfg = make_config(small)
    torch.manual_seed(0)
    base = cls(cfg).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), generator=g)
    dec = torch.randint(0, cfg.vocab_size, (batch, steps), generator=g)

    def logits(model_dtype, model_device, attn):
        model = copy.deepcopy(base).to(model_dtype).to(model_device)
        model.set_attn_implementation(attn)
        return generate_logits(model, ids.to(model_device), dec.to(model_device)).cpu()

    harness = PortattnAttention(
        cfg, batch=batch, max_len=prompt + steps, dtype=dtype, device=device
    )
    tf.AttentionInterface.register(NAME, harness)
    out = logits(dtype, device, NAME)
    with torch_paths(cls):
        oracle = logits(torch.float64, device, "eager")
    lowp = logits(dtype, device, "eager")
    assert harness.states_untouched()
    assert set(harness.lens.values()) == {prompt + steps}  # every attention layer, every step
    return harness, out, oracle, lowp


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tiny_model_matches_eager_attention(device, name):
    # Prompts cross a page: the derived block sizes are 80 (Jamba) and 48 (Qwen3-Next) here.
    # fp32 under the interpreter; fp16 on a GPU (Triton's fp32 dot may run in TF32 there).
    dtype = torch.float32 if device == "cpu" else torch.float16
    harness, out, oracle, lowp = _run(
        name, small=True, dtype=dtype, device=device, batch=2, prompt=90, steps=3
    )
    assert harness.block_size == {"jamba": 80, "qwen3_next": 48}[name]
    floor = FP32_FLOOR if dtype == torch.float32 else 0.0
    assert_low_precision_close(out, oracle, lowp, floor=floor)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_matches_eager_attention_bf16(name):
    harness, out, oracle, lowp = _run(
        name, small=False, dtype=torch.bfloat16, device="cuda", batch=4, prompt=700, steps=8
    )
    assert harness.block_size % 16 == 0
    assert_low_precision_close(out, oracle, lowp)


@pytest.mark.gpu
@pytest.mark.skipif(
    os.environ.get("PORTATTN_IMAGE") != "1"  # the CI image is built with them: never a skip there
    and (
        importlib.util.find_spec("mamba_ssm") is None
        or importlib.util.find_spec("causal_conv1d") is None
    ),
    reason="mamba-ssm / causal-conv1d not installed (CUDA extensions built into the GPU images)",
)
def test_jamba_mamba_layers_run_the_installed_kernels():
    """Where the extensions import, the Jamba model under test runs its Mamba layers through the
    real causal-conv1d and selective-scan kernels (the oracle alone takes the torch paths)."""
    module = sys.modules[tf.JambaForCausalLM.__module__]
    bound = {n: _bound_implementation(fn) for n, fn in _kernel_functions(module).items()}
    assert bound["causal_conv1d_fn"].__module__.startswith("causal_conv1d"), bound
    assert bound["mamba_selective_scan"].__module__.startswith("mamba_ssm"), bound
    harness, out, oracle, lowp = _run(
        "jamba", small=True, dtype=torch.float16, device="cuda", batch=2, prompt=90, steps=3
    )
    assert_low_precision_close(out, oracle, lowp)
