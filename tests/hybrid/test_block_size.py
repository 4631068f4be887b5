"""Hybrid-model block sizes derived from published model configurations (design lesson 3)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from portattn.hybrid import (
    PUBLISHED_MODELS,
    align_block_size,
    attention_dims,
    derive_block_size,
    dtype_bytes,
    mamba_state_shapes,
    published_config,
)

pytestmark = pytest.mark.hybrid
transformers = pytest.importorskip(
    "transformers", reason="transformers not installed (the 'hybrid' extra builds the configs)"
)

TPS = (1, 2, 4, 8)
CACHE_DTYPES = ("bf16", "fp8")
KERNEL_MULTIPLES = (16, 32, 64)
# Every block size the table below derives at kernel multiple 16, plus the synthetic 2048: the
# kernel tests in test_hybrid_cache.py run at exactly these (they need no transformers).
DERIVED_BLOCK_SIZES = (
    48, 80, 144, 160, 272, 400, 528, 544, 672, 784, 800, 1056, 1072, 1328, 1568, 2048, 3120,
)  # fmt: skip


def _cases():
    for name in PUBLISHED_MODELS:
        cfg = published_config(name)
        for tp in TPS:
            try:
                mamba_state_shapes(cfg, tp)
            except ValueError:
                continue  # a TP size the model cannot be split by is filtered, not skipped
            for dt in CACHE_DTYPES:
                yield pytest.param(name, tp, dt, id=f"{name}-tp{tp}-{dt}")


def synthetic_2048():
    """A Nemotron-H-style config whose Mamba page needs exactly 2048 bf16 tokens at a = 16."""
    return transformers.NemotronHConfig(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
        mamba_num_heads=124, mamba_head_dim=64, n_groups=2, ssm_state_size=128, conv_kernel=4,
    )  # fmt: skip


@pytest.mark.parametrize("tp", (1, 2))
def test_qwen3_next_80b_bf16_is_544(tp):
    # 2*nk*dk + nv*dv = 8192 conv channels * 3 + 32*128*128 state = 548864 bf16 = 1097728 B per
    # rank at TP 1; 2 kv heads * 256 * 2 (K, V) * 2 B = 2048 B/token: 536 tokens -> 34 * 16.
    r = derive_block_size(published_config("Qwen3-Next-80B-A3B"), tp=tp, cache_dtype="bf16")
    assert (r.block_size, r.mamba_page_bytes * tp, r.attn_bytes_per_token * tp) == (
        544, 1097728, 2048,
    )  # fmt: skip


@pytest.mark.parametrize("tp", TPS)
def test_nemotron_nano_9b_v2_bf16_is_672(tp):
    # conv (10240 + 2*8*128) * 3 + SSM 128*80*128 = 1347584 bf16 = 2695168 B over 4096 B/token
    # = 658 tokens -> 42 * 16; every TP size divides heads, groups and kv heads alike.
    r = derive_block_size(published_config("Nemotron-Nano-9B-v2"), tp=tp)
    assert (r.block_size, r.mamba_page_bytes * tp) == (672, 2695168)


def test_nemotron_nano_9b_v2_fp32_ssm_state_is_1312():
    # vLLM's newer Nemotron-H default keeps the SSM state in float32.
    r = derive_block_size(published_config("Nemotron-Nano-9B-v2"), ssm_dtype="fp32")
    assert r.block_size == 1312


def test_synthetic_2048():
    r = derive_block_size(synthetic_2048())
    assert (r.block_size, r.attn_bytes_per_token) == (2048, 1024)
    assert 2032 * 1024 < r.mamba_page_bytes <= 2048 * 1024


@pytest.mark.parametrize(("name", "tp", "cache_dtype"), list(_cases()))
def test_published_block_size_covers_mamba_page_minimally(name, tp, cache_dtype):
    cfg = published_config(name)
    for a in KERNEL_MULTIPLES:
        r = derive_block_size(cfg, tp=tp, cache_dtype=cache_dtype, kernel_multiple=a)
        assert r.block_size % a == 0
        assert r.attn_page_bytes >= r.mamba_page_bytes > (r.block_size - a) * r.attn_bytes_per_token
        assert r.mamba_padding_bytes == r.attn_page_bytes - r.mamba_page_bytes >= 0


def test_table_derives_exactly_the_block_sizes_the_kernel_tests_use():
    derived = {
        derive_block_size(published_config(n), tp=tp, cache_dtype=dt).block_size
        for n in PUBLISHED_MODELS
        for tp in TPS
        for dt in CACHE_DTYPES
    }
    derived.add(derive_block_size(synthetic_2048()).block_size)
    assert tuple(sorted(derived)) == DERIVED_BLOCK_SIZES


def test_fp8_cache_halves_attention_bytes_only():
    cfg = published_config("Qwen3-Next-80B-A3B")
    bf16, fp8 = derive_block_size(cfg), derive_block_size(cfg, cache_dtype="fp8")
    assert fp8.mamba_page_bytes == bf16.mamba_page_bytes
    assert 2 * fp8.attn_bytes_per_token == bf16.attn_bytes_per_token
    assert fp8.block_size == 1072


def test_per_rank_state_shapes():
    """Each mixer's per-rank state, against the table in portattn.hybrid's docstring."""
    # Jamba: Mamba1, inner 2 * 4096, conv kernel 4, state 16.
    assert mamba_state_shapes(published_config("Jamba-v0.1"), 2) == ((4096, 3), (4096, 16))
    # Granite-4.0-H: one group, replicated to 4 at TP 4: (8192 + 2*4*128) / 4 channels.
    assert mamba_state_shapes(published_config("Granite-4.0-H-Small"), 4) == (
        (2304, 3), (32, 64, 128),
    )  # fmt: skip
    # Qwen3-Next with 2 speculative tokens: the conv state keeps K - 1 + 2 columns.
    assert mamba_state_shapes(published_config("Qwen3-Next-80B-A3B"), 1, num_spec=2) == (
        (8192, 5), (32, 128, 128),
    )  # fmt: skip
    # Zamba2's attention is on concat(hidden, embeddings): head_dim 2 * 2560 / 32 = 160.
    assert derive_block_size(published_config("Zamba2-2.7B")).head_dim == 160


def test_align_block_size_is_the_smallest_covering_multiple():
    for mamba in (1, 1000, 4096, 123457):
        for per_token, a in ((7, 16), (512, 16), (100, 1), (64, 64)):
            want = next(b for b in range(a, 10**7, a) if b * per_token >= mamba)
            assert align_block_size(mamba, per_token, a) == want
            assert want == a * math.ceil(mamba / (a * per_token))


def test_errors_name_the_function_the_user_called():
    """Each public helper's refusal starts with its own name; one called by derive_block_size
    is named as derive_block_size, the call the user made."""
    cfg = published_config("Jamba-v0.1")
    cases = (
        (lambda: attention_dims(cfg, 3), ValueError, "attention_dims: config.num_attention_heads"),
        (lambda: mamba_state_shapes(cfg, 3), ValueError, "mamba_state_shapes: mamba intermediate"),
        (lambda: mamba_state_shapes(cfg, 0), ValueError, "mamba_state_shapes: tp must be"),
        (lambda: dtype_bytes("int4", what="x"), ValueError, "dtype_bytes: x must be one of"),
        (lambda: dtype_bytes(3), TypeError, "dtype_bytes: dtype must be a dtype name"),
        (lambda: dtype_bytes(torch.bool), TypeError, "dtype_bytes: dtype must be a dtype name"),
        (lambda: align_block_size(0, 1, 1), ValueError, "align_block_size: mamba_page_bytes"),
        (lambda: derive_block_size(cfg, tp=3), ValueError, "derive_block_size: mamba intermediate"),
        (lambda: derive_block_size(cfg, cache_dtype=3), TypeError, "derive_block_size: cache_"),
    )
    for call, kind, start in cases:
        with pytest.raises(kind, match="^" + re.escape(start)):
            call()
    # a refusal's name is set per call: the same helper called directly afterwards names itself
    with pytest.raises(ValueError, match="^attention_dims: "):
        attention_dims(cfg, 3)


def test_errors_name_the_rule():
    cfg = published_config("Jamba-v0.1")
    with pytest.raises(ValueError, match=r"tp must be an int >= 1; got 0.*kernel_multiple"):
        derive_block_size(cfg, tp=0, kernel_multiple=0)
    with pytest.raises(ValueError, match=r"cache_dtype must be one of .*got 'int4'"):
        derive_block_size(cfg, cache_dtype="int4")
    with pytest.raises(ValueError, match=r"mamba intermediate size=8192 must be divisible .*tp=3"):
        derive_block_size(cfg, tp=3)
    with pytest.raises(ValueError, match=r"config.model_type must be one of .*got 'llama'"):
        derive_block_size(transformers.LlamaConfig())
    with pytest.raises(ValueError, match=r"kernel_multiple must be an int >= 1; got 0"):
        align_block_size(10, 10, 0)
    with pytest.raises(ValueError, match=r"name must be one of .*got 'GPT-2'"):
        published_config("GPT-2")


class _Reads:
    """A config that records which fields are read."""

    def __init__(self, cfg):
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "read", [])

    def __getattr__(self, name):
        self.read.append(name)
        return getattr(self._cfg, name)


OPTIONAL = {"head_dim", "num_key_value_heads", "mamba_d_ssm"}


def _fields(name):
    probe = _Reads(published_config(name))
    derive_block_size(probe)
    return [f for f in dict.fromkeys(probe.read) if f != "model_type"]


@pytest.mark.parametrize("name", PUBLISHED_MODELS)
def test_every_config_field_read_is_checked(name):
    """Each field the derivation reads, set to what no model has, is named with its rule
    instead of yielding a page size (a zero conv kernel once gave a negative state width)."""
    cfg = published_config(name)
    fields = _fields(name)
    assert "num_attention_heads" in fields and len(fields) >= 6, fields
    for field in fields:
        bad = [0, -3, 1.5, "x", True] + ([] if field in OPTIONAL else [None])
        if field == "mamba_expand":
            bad = [0, -2.0, "x", True, None]
        for value in bad:
            data = dict(cfg.to_dict(), model_type=cfg.model_type)
            data[field] = value
            broken = type("Config", (), data)()
            # an int (a float, for mamba_expand) out of range is a ValueError, any other type a
            # TypeError (a bool or a string was a ValueError)
            number = float if field == "mamba_expand" else int
            wrong_type = isinstance(value, bool) or not isinstance(value, (int, number))
            kind = TypeError if wrong_type else ValueError
            with pytest.raises(kind, match=re.escape(f"config.{field} must be")) as raised:
                derive_block_size(broken)
            assert isinstance(raised.value, kind) and not isinstance(
                raised.value, {TypeError: ValueError, ValueError: TypeError}[kind]
            )


def test_a_missing_field_is_named():
    cfg = published_config("Qwen3-Next-80B-A3B")
    data = {k: v for k, v in cfg.to_dict().items() if k != "linear_conv_kernel_dim"}
    broken = type("Config", (), dict(data, model_type="qwen3_next"))()
    with pytest.raises(
        ValueError, match=r"config.linear_conv_kernel_dim must be an int >= 1; missing"
    ):
        derive_block_size(broken)


@pytest.mark.parametrize(
    "changes, tp, message",
    [
        (dict(num_key_value_heads=3), 1,
         "num_attention_heads=16 must be a multiple of config.num_key_value_heads=3"),
        (dict(num_attention_heads=12, num_key_value_heads=4), 8,
         "num_attention_heads=12 must be divisible by tp=8"),
        (dict(num_attention_heads=24, num_key_value_heads=6), 4,
         "num_key_value_heads=6 must be divisible by tp=4, or divide it"),
        (dict(hidden_size=8, head_dim=None), 1,
         "hidden_size must be >= config.num_attention_heads"),
    ],
)  # fmt: skip
def test_attention_heads_must_split_over_the_ranks(changes, tp, message):
    cfg = published_config("Qwen3-Next-80B-A3B")
    broken = type("Config", (), dict(cfg.to_dict(), model_type="qwen3_next", **changes))()
    with pytest.raises(ValueError, match=re.escape(message)):
        derive_block_size(broken, tp=tp)


def test_mamba2_groups_split_over_the_ranks_or_are_one():
    """n_groups 3 over tp 2 came out as 2 groups a rank (a state shape no model has); vLLM's
    MambaMixer2 takes n_groups divisible by tp, or 1 (replicated on every rank)."""
    cfg = published_config("Nemotron-Nano-9B-v2")
    broken = type("Config", (), dict(cfg.to_dict(), model_type="nemotron_h", n_groups=3))()
    with pytest.raises(ValueError, match=re.escape("n_groups=3 must be 1 or divisible by the "
                                                   "tensor-parallel size tp=2")):  # fmt: skip
        derive_block_size(broken, tp=2)
    one = type("Config", (), dict(cfg.to_dict(), model_type="nemotron_h", n_groups=1))()
    assert derive_block_size(one, tp=2).block_size >= 16


def test_a_state_spec_has_an_element_size_per_tensor():
    from portattn.hybrid import MambaStateSpec

    with pytest.raises(ValueError, match=r"^MambaStateSpec: shapes and elem_bytes must have one"):
        MambaStateSpec(((1, 2),), (2, 2))
    assert MambaStateSpec(((1, 2), (3,)), (2, 4)).page_size_bytes == 16


@pytest.mark.parametrize(
    ("expand", "hidden"),
    [(float("inf"), None), (1e308, None), (float("nan"), None), (0, None), ("2", None),
     # a hidden_size past float's range raised OverflowError from the product
     (2, 10**400), (1.5, 10**400)],
)  # fmt: skip
def test_a_mamba_expand_without_a_finite_width_is_named(expand, hidden):
    """inf or 1e308 raised OverflowError converting the width to an int; a string is a
    TypeError."""
    cfg = dict(published_config("Jamba-v0.1").to_dict(), model_type="jamba", mamba_expand=expand)
    if hidden is not None:
        cfg["hidden_size"] = hidden
    broken = type("Config", (), cfg)()
    kind = TypeError if isinstance(expand, str) else ValueError
    with pytest.raises(kind, match=r"config.mamba_expand must be a finite number > 0"):
        derive_block_size(broken)


@pytest.mark.parametrize("expand", [1, 2, np.int64(2)])
def test_an_integral_mamba_expand_gives_the_exact_width(expand):
    """The width was a float product, which loses its low bits past 2**53 (2**60 + 32 came out
    as 2**60); vLLM's int(expand * hidden_size) is exact for an int expand."""
    hidden = 2**60 + 32
    cfg = dict(published_config("Jamba-v0.1").to_dict(), model_type="jamba", mamba_expand=expand,
               hidden_size=hidden)  # fmt: skip
    (conv, ssm) = mamba_state_shapes(type("Config", (), cfg)(), 1)
    assert conv[0] == ssm[0] == int(expand) * hidden


def test_a_numpy_mamba_expand_is_a_number():
    """np.float32(2.0) meets "a finite number > 0" but was refused (np.float64 was not)."""
    cfg = published_config("Jamba-v0.1")
    want = derive_block_size(cfg).block_size
    for expand in (np.float32(cfg.mamba_expand), np.int64(cfg.mamba_expand)):
        as_numpy = type("Config", (), dict(cfg.to_dict(), mamba_expand=expand))()
        assert derive_block_size(as_numpy).block_size == want


@pytest.mark.parametrize(
    "dtype", (np.dtype("float16"), np.float16(1), 2, None, torch.bool, torch.complex128,
              torch.int8)
)  # fmt: skip
def test_a_dtype_is_a_name_or_a_floating_torch_dtype(dtype):
    """A bool or complex dtype gave a page size (1072, 80) for a cache no op can hold."""
    rule = r"cache_dtype must be a dtype name or a floating-point torch.dtype"
    with pytest.raises(TypeError, match=rule):
        derive_block_size(published_config("Jamba-v0.1"), cache_dtype=dtype)


@pytest.mark.parametrize(
    ("shapes", "elem_bytes", "error", "what"),
    [(((1, -2),), (2,), ValueError, "shapes must be a tuple of shapes"),
     (5, (2,), TypeError, "shapes must be"),
     (((1, 2),), ("a",), TypeError, "elem_bytes must be a tuple of ints >= 1"),
     (((1, 2),), (0,), ValueError, "elem_bytes must be"),
     (((1, 2),), (True,), TypeError, "elem_bytes must be"),
     (((1, 2.0),), (2,), TypeError, "shapes must be")],
)  # fmt: skip
def test_a_state_spec_refuses_sizes_that_are_no_sizes(shapes, elem_bytes, error, what):
    """A negative dimension gave a negative page size; a shape that is no tuple or an element
    size that is no int raised from len() or +. A wrong type is a TypeError, an int out of
    range a ValueError, as everywhere else in the library."""
    from portattn.hybrid import MambaStateSpec

    with pytest.raises(error, match=f"^MambaStateSpec: {what}") as raised:
        MambaStateSpec(shapes, elem_bytes)
    assert type(raised.value) is error


@pytest.mark.parametrize(
    "kwargs", (dict(tp=True), dict(kernel_multiple=True), dict(num_spec=False))
)
def test_a_bool_is_no_count(kwargs):
    """A bool is a type problem (a TypeError, as everywhere else in the library; it was a
    ValueError here)."""
    with pytest.raises(TypeError, match=re.escape(f"{next(iter(kwargs))} must be an int")):
        derive_block_size(published_config("Qwen3-Next-80B-A3B"), **kwargs)
    with pytest.raises(TypeError, match="kernel_multiple must be an int >= 1; got True"):
        align_block_size(10, 10, True)
    with pytest.raises(TypeError, match="tp must be an int >= 1; got 2.0"):
        attention_dims(published_config("Qwen3-Next-80B-A3B"), 2.0)
    # every argument named; a TypeError when any of them is a type problem
    with pytest.raises(TypeError, match="tp must be an int >= 1; got 0; num_spec must be an int"):
        derive_block_size(published_config("Qwen3-Next-80B-A3B"), tp=0, num_spec="1")


def test_a_packed_dtype_is_no_cache_dtype():
    """float4_e2m1fn_x2 holds two values a byte; its itemsize of 1 gave fp8's block size."""
    dtype = getattr(torch, "float4_e2m1fn_x2", None)
    if dtype is None:
        pytest.skip("this torch has no float4_e2m1fn_x2")
    with pytest.raises(TypeError, match=r"cache_dtype must be .* whole bytes a value; got torch"):
        derive_block_size(published_config("Qwen3-Next-80B-A3B"), cache_dtype=dtype)


def test_an_array_cache_dtype_is_named():
    """An array compared with "auto" raised numpy's ambiguous-truth ValueError."""
    with pytest.raises(TypeError, match="cache_dtype must be a dtype name"):
        derive_block_size(published_config("Qwen3-Next-80B-A3B"),
                          cache_dtype=np.array(["bf16", "fp8"]))  # fmt: skip
