"""Attention block sizes of hybrid (Mamba + attention) models, derived as serving engines do.

A hybrid model keeps its attention KV cache and its Mamba (SSM) state in ONE pool of equal-sized
pages, so one attention page must be at least as large as one Mamba state page. vLLM therefore
raises the attention ``block_size`` to

    block_size = a * ceil(mamba_page_bytes / (a * attn_bytes_per_token))

with ``a`` the attention kernel's minimum block multiple (its ``MultipleOf(a)``; 16 for vLLM's
FlashAttention/FlashInfer/Triton backends) and both byte counts **per tensor-parallel rank**, then
pads the Mamba page up to the attention page (vLLM ``HybridAttentionMambaModelConfig.
verify_and_update_config``, ``Platform._align_hybrid_block_size`` in newer releases, its
"no prefix caching" branch). That is how block sizes such as 544 and 2048 reach a kernel
(docs/design.md lesson 3).

Per-rank Mamba state, as vLLM's ``MambaStateShapeCalculator`` computes it (``divide`` = exact
division; ``tp`` = tensor-parallel size):

| mixer                       | conv state                        | SSM ("temporal") state |
|-----------------------------|-----------------------------------|------------------------|
| Mamba1 (Jamba)              | ``(I/tp, K-1)``                   | ``(I/tp, N)``          |
| Mamba2 (Zamba2, Falcon-H1,  | ``((I + 2*G'*N)/tp, K-1)``        | ``(H/tp, P, N)``       |
| Granite-4.0-H, Nemotron-H)  | (``G' = tp`` for ``G = 1``; else  |                        |
|                             | ``G % tp == 0``, ``G' = G``)      |                        |
| Gated DeltaNet (Qwen3-Next) | ``((2*nk*dk + nv*dv)/tp, K-1+s)`` | ``(nv/tp, dk, dv)``    |

``I`` intermediate (inner) size, ``K`` conv kernel width, ``N`` state size, ``H``/``P`` Mamba2
heads/head dim, ``G`` groups, ``nk``/``nv`` and ``dk``/``dv`` DeltaNet key/value heads and head
dims, ``s`` speculative tokens. The conv state is stored in the Mamba cache dtype (the model
dtype unless set) and the SSM state in the SSM cache dtype (the Mamba cache dtype unless set; vLLM's
``--mamba-ssm-cache-dtype``). An FP8 KV cache shrinks only the attention side.

Attention bytes per token per rank: ``2 (K and V) * max(1, num_kv_heads // tp) * head_dim *
kv_bytes`` (MLA: ``1 * head_dim_k * kv_bytes``: one latent row per token).

Independently known values (checked in tests/hybrid): Qwen3-Next-80B-A3B, bf16, ``a = 16`` ->
544 at TP 1 and 2 (1097728 B of GDN state per layer over 2048 B/token = 536 -> 544); Nemotron-Nano-
9B-v2, bf16 model and SSM state, ``a = 16`` -> 672 at TP 1, 2, 4 and 8 (2695168 B / 4096 B =
658 -> 672; with vLLM's newer float32 SSM-state default for Nemotron-H it is 1312).

`derive_block_size` is a pure function of (config, tp, cache dtype, kernel multiple). Configs are
duck-typed (any object with the transformers attribute names); `published_configs` builds the
published sizes with transformers' own config classes (the ``hybrid`` extra), imported lazily so
that portattn itself depends on torch and triton only.
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeGuard, TypeVar

import torch

from portattn.platform import is_int

DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "float32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

HYBRID_MODEL_TYPES = (
    "jamba",
    "zamba2",
    "falcon_h1",
    "granitemoehybrid",
    "nemotron_h",
    "qwen3_next",
)


class _Refusal(Exception):
    """A bad argument or config field, named by the public function the user called."""

    def __init__(self, rule: str) -> None:
        super().__init__(rule)
        self.rule = rule
        self.caller = ""

    def __str__(self) -> str:
        return f"{self.caller}: {self.rule}" if self.caller else self.rule


class _ValueRefusal(_Refusal, ValueError):
    pass


class _TypeRefusal(_Refusal, TypeError):
    pass


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _names_its_refusals(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Prefix ``fn``'s refusals with its name; the outermost public function's name wins."""

    @functools.wraps(fn)
    def named(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except _Refusal as e:
            e.caller = fn.__name__
            raise

    return named


@_names_its_refusals
def dtype_bytes(dtype: Any, *, what: str = "dtype") -> int:
    """Bytes per element of ``dtype`` (a name from `DTYPE_BYTES` or a ``torch.dtype``)."""
    if isinstance(dtype, str):
        if dtype not in DTYPE_BYTES:
            raise _ValueRefusal(
                f"{what} must be one of {sorted(DTYPE_BYTES)} or a torch.dtype; got {dtype!r}"
            )
        return DTYPE_BYTES[dtype]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        # caches and Mamba states hold floating-point numbers: a bool or complex size is no page
        raise _TypeRefusal(
            f"{what} must be a dtype name or a floating-point torch.dtype; got {dtype!r}"
        )
    if re.search(r"_x\d+$", str(dtype)):
        # a packed dtype (float4_e2m1fn_x2: two values a byte) has no whole bytes a value
        raise _TypeRefusal(
            f"{what} must be a dtype name or a floating-point torch.dtype of whole bytes a "
            f"value; got {dtype!r}, which packs several values into one element"
        )
    return dtype.itemsize


def _is_count(v: object, minimum: int) -> TypeGuard[int]:
    """An int (not a bool) >= ``minimum``."""
    return is_int(v) and v >= minimum


def _count_refusal(name: str, v: object, minimum: int) -> _Refusal:
    """The refusal of ``v`` as ``name``, which must be an int >= ``minimum``: a TypeError when it
    is no int (a bool, a float, a string, None), else a ValueError."""
    rule = f"{name} must be an int >= {minimum}; got {v!r}"
    return _ValueRefusal(rule) if is_int(v) else _TypeRefusal(rule)


def _check_tp(tp: object) -> int:
    if not _is_count(tp, 1):
        raise _count_refusal("tp", tp, 1)
    return tp


def _size(config: Any, name: str, *, minimum: int = 1, optional: bool = False) -> Any:
    """``config.<name>``, an int >= ``minimum``; ``None`` when ``optional`` and absent or None.

    Raises:
        ValueError: naming the field, the rule and the value, for a field that is missing or
            an int out of range (a config that misses a field its model type needs, or holds a
            wrong value there, would give a wrong page size).
        TypeError: the same, for a field that is no int.
    """
    v = getattr(config, name, None)
    if v is None and optional:
        return None
    if not hasattr(config, name):
        raise _ValueRefusal(f"config.{name} must be an int >= {minimum}; missing")
    if not _is_count(v, minimum):
        raise _count_refusal(f"config.{name}", v, minimum)
    return v


def _inner(config: Any) -> int:
    """``int(config.mamba_expand * config.hidden_size)``, the Mamba inner width (>= 1): exact
    for an integral ``mamba_expand``, in floating point (as vLLM computes it) for a float."""
    expand = getattr(config, "mamba_expand", None)
    hidden = _size(config, "hidden_size")
    rule = (
        f"config.mamba_expand must be a finite number > 0 whose product with "
        f"config.hidden_size ({hidden}) is finite (the Mamba width); got {expand!r}"
    )
    if isinstance(expand, bool) or not isinstance(expand, numbers.Real):
        raise _TypeRefusal(rule)
    try:  # a real number of any kind (numpy's included), as a float
        width = float(expand) * hidden
    except OverflowError:  # a hidden_size past float's range
        width = math.inf
    if not 0 < width < math.inf:  # inf, nan and 0 have no int width
        raise _ValueRefusal(rule)
    # a float's product loses the width's low bits past 2**53; an integer's does not
    inner = int(expand) * hidden if isinstance(expand, numbers.Integral) else int(width)
    if inner < 1:
        raise _ValueRefusal(
            "the mamba intermediate size (config.mamba_expand * "
            "config.hidden_size) must be "
            f">= 1; got {inner}"
        )
    return inner


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise _ValueRefusal(
            f"{what}={n} must be divisible by the tensor-parallel size; got tp={tp}"
        )
    return n // tp


@dataclass(frozen=True)
class MambaStateSpec:
    """One Mamba layer's state per TP rank: its tensors' shapes and element sizes in bytes."""

    shapes: tuple[tuple[int, ...], ...]
    elem_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        shapes, sizes = self.shapes, self.elem_bytes
        shapes_rule = (
            f"MambaStateSpec: shapes must be a tuple of shapes (tuples of ints >= 0); got "
            f"{shapes!r}"
        )
        sizes_rule = f"MambaStateSpec: elem_bytes must be a tuple of ints >= 1; got {sizes!r}"
        # A value of the wrong type is a TypeError; an int out of range is a ValueError.
        if not isinstance(shapes, tuple) or not all(
            isinstance(s, tuple) and all(is_int(d) for d in s) for s in shapes
        ):
            raise TypeError(shapes_rule)
        if not isinstance(sizes, tuple) or not all(is_int(b) for b in sizes):
            raise TypeError(sizes_rule)
        if not all(_is_count(d, 0) for s in shapes for d in s):
            raise ValueError(shapes_rule)
        if not all(_is_count(b, 1) for b in sizes):
            raise ValueError(sizes_rule)
        if len(self.shapes) != len(self.elem_bytes):
            raise ValueError(
                f"MambaStateSpec: shapes and elem_bytes must have one entry per state tensor; got "
                f"{len(self.shapes)} shapes and {len(self.elem_bytes)} element sizes"
            )

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one sequence's state (vLLM ``MambaSpec.page_size_bytes``, unpadded)."""
        return sum(math.prod(s) * b for s, b in zip(self.shapes, self.elem_bytes, strict=True))


@dataclass(frozen=True)
class HybridBlockSize:
    """The result of `derive_block_size` and the numbers it came from (all per TP rank)."""

    block_size: int
    kernel_multiple: int
    attn_bytes_per_token: int
    mamba_page_bytes: int
    num_kv_heads: int
    head_dim: int
    mamba: MambaStateSpec

    @property
    def attn_page_bytes(self) -> int:
        return self.block_size * self.attn_bytes_per_token

    @property
    def mamba_padding_bytes(self) -> int:
        """Bytes the Mamba page is padded by to equal the attention page."""
        return self.attn_page_bytes - self.mamba_page_bytes


@_names_its_refusals
def align_block_size(mamba_page_bytes: int, attn_bytes_per_token: int, kernel_multiple: int) -> int:
    """``a * ceil(mamba_page_bytes / (a * attn_bytes_per_token))``: the smallest multiple of ``a``
    whose attention page covers the Mamba page.

    >>> align_block_size(1097728, 2048, 16)  # Qwen3-Next-80B-A3B, bf16, TP 1
    544
    """
    for name, v in (
        ("mamba_page_bytes", mamba_page_bytes),
        ("attn_bytes_per_token", attn_bytes_per_token),
        ("kernel_multiple", kernel_multiple),
    ):
        if not _is_count(v, 1):
            raise _count_refusal(name, v, 1)
    return kernel_multiple * -(-mamba_page_bytes // (kernel_multiple * attn_bytes_per_token))


@_names_its_refusals
def attention_dims(config: Any, tp: int) -> tuple[int, int]:
    """``(num_kv_heads per rank, head_dim)`` of the model's attention layers.

    KV heads split over the ranks, or are replicated when there are fewer of them than ranks
    (vLLM's rule: ``num_kv_heads % tp == 0``, else ``tp % num_kv_heads == 0``).

    Raises:
        ValueError: a field missing or out of range, or heads that ``tp`` cannot split.
        TypeError: ``tp`` or a field that is no int.
    """
    tp = _check_tp(tp)
    heads = _size(config, "num_attention_heads")
    if getattr(config, "model_type", None) == "zamba2":
        # attention runs on concat(hidden, embedding): 2x width
        head_dim = _size(config, "attention_head_dim")
    else:
        head_dim = _size(config, "head_dim", optional=True)
        if head_dim is None:
            head_dim = _size(config, "hidden_size") // heads
            if head_dim < 1:
                raise _ValueRefusal(
                    "config.hidden_size must be >= config.num_attention_heads "
                    f"(head_dim = hidden_size // heads); got {config.hidden_size} < {heads}"
                )
    kv = _size(config, "num_key_value_heads", optional=True) or heads
    errors = []
    if heads % kv:
        errors.append(
            f"config.num_attention_heads={heads} must be a multiple of config."
            f"num_key_value_heads={kv}"
        )
    if heads % tp:
        errors.append(f"config.num_attention_heads={heads} must be divisible by tp={tp}")
    if (kv % tp) if kv >= tp else (tp % kv):
        errors.append(
            f"config.num_key_value_heads={kv} must be divisible by tp={tp}, or divide it (KV "
            "heads replicated over the ranks)"
        )
    if errors:
        raise _ValueRefusal("" + "; ".join(errors))
    return max(1, kv // tp), head_dim


def _mamba2(tp, intermediate, n_groups, num_heads, head_dim, state, conv_kernel):
    if n_groups % tp and n_groups != 1:  # vLLM's MambaMixer2 refuses such a split as well
        raise _ValueRefusal(
            f"the mamba n_groups={n_groups} must be 1 or divisible by the "
            f"tensor-parallel size tp={tp}"
        )
    if n_groups % tp:  # one group, replicated so that every rank holds it
        n_groups = tp
    conv_dim = intermediate + 2 * n_groups * state
    return (
        (_divide(conv_dim, tp, "mamba conv dim"), conv_kernel - 1),
        (_divide(num_heads, tp, "mamba heads"), head_dim, state),
    )


@_names_its_refusals
def mamba_state_shapes(config: Any, tp: int, *, num_spec: int = 0) -> tuple[tuple[int, ...], ...]:
    """``(conv_state_shape, ssm_state_shape)`` of one Mamba layer per TP rank (table above).

    Raises:
        ValueError: an unknown model type, a field missing or out of range, or a dimension
            that ``tp`` does not divide.
        TypeError: ``tp``, ``num_spec`` or a field that is no int, a ``mamba_expand`` that is
            no real number.
    """
    tp = _check_tp(tp)
    if not _is_count(num_spec, 0):
        raise _count_refusal("num_spec", num_spec, 0)
    f = lambda name: _size(config, name)  # noqa: E731
    mt = getattr(config, "model_type", None)
    if mt == "jamba":
        i = _divide(_inner(config), tp, "mamba intermediate size")
        return ((i, f("mamba_d_conv") - 1), (i, f("mamba_d_state")))
    if mt == "zamba2":
        return _mamba2(tp, _inner(config), f("mamba_ngroups"), f("n_mamba_heads"),
                       f("mamba_headdim"), f("mamba_d_state"), f("mamba_d_conv"))  # fmt: skip
    if mt == "falcon_h1":
        inner = _size(config, "mamba_d_ssm", optional=True) or _inner(config)
        return _mamba2(tp, inner, f("mamba_n_groups"), f("mamba_n_heads"), f("mamba_d_head"),
                       f("mamba_d_state"), f("mamba_d_conv"))  # fmt: skip
    if mt == "granitemoehybrid":
        return _mamba2(tp, _inner(config), f("mamba_n_groups"), f("mamba_n_heads"),
                       f("mamba_d_head"), f("mamba_d_state"), f("mamba_d_conv"))  # fmt: skip
    if mt == "nemotron_h":
        heads, head_dim = f("mamba_num_heads"), f("mamba_head_dim")
        return _mamba2(tp, heads * head_dim, f("n_groups"), heads, head_dim,
                       f("ssm_state_size"), f("conv_kernel"))  # fmt: skip
    if mt == "qwen3_next":
        nk, nv = f("linear_num_key_heads"), f("linear_num_value_heads")
        dk, dv = f("linear_key_head_dim"), f("linear_value_head_dim")
        conv_dim = 2 * nk * dk + nv * dv
        return (
            (_divide(conv_dim, tp, "GDN conv dim"), f("linear_conv_kernel_dim") - 1 + num_spec),
            (_divide(nv, tp, "GDN value heads"), dk, dv),
        )
    raise _ValueRefusal(f"config.model_type must be one of {HYBRID_MODEL_TYPES}; got {mt!r}")


@_names_its_refusals
def derive_block_size(
    config: Any,
    *,
    tp: int = 1,
    cache_dtype: Any = "bf16",
    kernel_multiple: int = 16,
    model_dtype: Any = "bf16",
    mamba_dtype: Any = None,
    ssm_dtype: Any = None,
    num_spec: int = 0,
) -> HybridBlockSize:
    """The attention block size a serving engine gives a hybrid model (module docstring).

    Args:
        config: a transformers config of a type in `HYBRID_MODEL_TYPES` (or any object with
            the same attributes).
        tp: tensor-parallel size; every byte count is per rank.
        cache_dtype: the attention KV-cache dtype (``"bf16"``, ``"fp8"``, ``"auto"`` = model dtype,
            or a ``torch.dtype``).
        kernel_multiple: ``a``, the attention kernel's minimum block multiple.
        model_dtype: the model's dtype (the Mamba conv state's, unless ``mamba_dtype``).
        mamba_dtype: the Mamba cache dtype; defaults to ``model_dtype``.
        ssm_dtype: the SSM-state dtype; defaults to ``mamba_dtype``.
        num_spec: speculative tokens (widen a Gated-DeltaNet conv state).

    Raises:
        ValueError: an argument out of range, an unknown model type, a config field missing or
            out of range, or a dimension that the tensor-parallel size does not divide.
        TypeError: an argument or config field of a wrong type (an int that is a bool, float or
            string; a dtype that is neither a name nor a floating-point ``torch.dtype`` of whole
            bytes a value).
    """
    refusals = [
        _count_refusal(name, v, low)
        for name, v, low in (("tp", tp, 1), ("kernel_multiple", kernel_multiple, 1),
                             ("num_spec", num_spec, 0))
        if not _is_count(v, low)
    ]  # fmt: skip
    if refusals:  # every one named; a TypeError when any of them is a type problem
        kind = _TypeRefusal if any(isinstance(r, TypeError) for r in refusals) else _ValueRefusal
        raise kind("; ".join(r.rule for r in refusals))
    model_b = dtype_bytes(model_dtype, what="model_dtype")
    auto = isinstance(cache_dtype, str) and cache_dtype == "auto"
    kv_b = model_b if auto else dtype_bytes(cache_dtype, what="cache_dtype")
    conv_b = model_b if mamba_dtype is None else dtype_bytes(mamba_dtype, what="mamba_dtype")
    ssm_b = conv_b if ssm_dtype is None else dtype_bytes(ssm_dtype, what="ssm_dtype")
    shapes = mamba_state_shapes(config, tp, num_spec=num_spec)
    mamba = MambaStateSpec(shapes, (conv_b, ssm_b))
    kv_heads, head_dim = attention_dims(config, tp)
    per_token = 2 * kv_heads * head_dim * kv_b
    block = align_block_size(mamba.page_size_bytes, per_token, kernel_multiple)
    return HybridBlockSize(
        block, kernel_multiple, per_token, mamba.page_size_bytes, kv_heads, head_dim, mamba
    )


# -- published model sizes, as transformers configs --------------------------------------------


def _published() -> dict[str, Callable[[], Any]]:
    import transformers as tf

    return {
        # ai21labs/Jamba-v0.1 (Jamba-1.5-Mini has the same mixer sizes): Mamba1, 1 attention
        # layer in 8.
        "Jamba-v0.1": lambda: tf.JambaConfig(
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            attn_layer_period=8,
            attn_layer_offset=4,
        ),
        # Zyphra/Zamba2-2.7B: Mamba2 backbone with shared attention blocks on 2x-wide input.
        "Zamba2-2.7B": lambda: tf.Zamba2Config(
            hidden_size=2560,
            num_hidden_layers=54,
            num_attention_heads=32,
            num_key_value_heads=32,
            n_mamba_heads=80,
            mamba_ngroups=1,
            mamba_d_state=64,
            mamba_d_conv=4,
            mamba_expand=2,
        ),
        # tiiuae/Falcon-H1-1.5B-Instruct: attention and Mamba2 in parallel in every layer.
        "Falcon-H1-1.5B": lambda: tf.FalconH1Config(  # type: ignore[call-arg]
            hidden_size=2048,
            num_hidden_layers=24,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            intermediate_size=4608,
            mamba_d_ssm=3072,
            mamba_n_heads=48,
            mamba_d_head=64,
            mamba_n_groups=1,
            mamba_d_state=256,
            mamba_d_conv=4,
        ),
        # ibm-granite/granite-4.0-h-small.
        "Granite-4.0-H-Small": lambda: tf.GraniteMoeHybridConfig(
            hidden_size=4096,
            num_hidden_layers=40,
            num_attention_heads=32,
            num_key_value_heads=8,
            mamba_n_heads=128,
            mamba_d_head=64,
            mamba_n_groups=1,
            mamba_d_state=128,
            mamba_d_conv=4,
            mamba_expand=2,
        ),
        # nvidia/Nemotron-H-8B-Base-8K.
        "Nemotron-H-8B": lambda: tf.NemotronHConfig(
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            mamba_num_heads=128,
            mamba_head_dim=64,
            n_groups=8,
            ssm_state_size=128,
            conv_kernel=4,
        ),
        # nvidia/NVIDIA-Nemotron-Nano-9B-v2: 56 layers, 4 of them attention.
        "Nemotron-Nano-9B-v2": lambda: tf.NemotronHConfig(
            hidden_size=4480,
            num_attention_heads=40,
            num_key_value_heads=8,
            head_dim=128,
            mamba_num_heads=128,
            mamba_head_dim=80,
            n_groups=8,
            ssm_state_size=128,
            conv_kernel=4,
        ),
        # Qwen/Qwen3-Next-80B-A3B: Gated DeltaNet, 1 full-attention layer in 4.
        "Qwen3-Next-80B-A3B": lambda: tf.Qwen3NextConfig(
            hidden_size=2048,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
        ),
    }


PUBLISHED_MODELS = (
    "Jamba-v0.1",
    "Zamba2-2.7B",
    "Falcon-H1-1.5B",
    "Granite-4.0-H-Small",
    "Nemotron-H-8B",
    "Nemotron-Nano-9B-v2",
    "Qwen3-Next-80B-A3B",
)


def published_config(name: str) -> Any:
    """The transformers config of the published model ``name`` (one of `PUBLISHED_MODELS`).

    Needs transformers (``pip install portattn[hybrid]``).
    """
    if name not in PUBLISHED_MODELS:
        raise ValueError(f"published_config: name must be one of {PUBLISHED_MODELS}; got {name!r}")
    return _published()[name]()
