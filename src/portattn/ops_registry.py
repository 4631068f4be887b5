"""Which kernel block sizes each op supports, for block-size negotiation (docs/design.md lesson 5).

Each kernel module declares ``SUPPORTED_BLOCK_SIZES`` (exact ``int`` sizes and/or `MultipleOf`
rules) for the NHD layout; a module whose op cannot read some layout lists the ones it can in
``SUPPORTED_LAYOUTS``. The SHUFFLE layout adds the same rule to every op: its V cache is
``[num_blocks, num_kv_heads, block_size // x, head_dim, x]``, so ``block_size % x == 0`` with
``x = 16 bytes / element size`` (8 for fp16/bf16, 4 for fp32). `supported_block_sizes` combines
the two; `participant` wraps the result for `select_common_block_size`::

    >>> select_common_block_size(participant("write_kv_cache", layout="SHUFFLE"),
    ...                          participant("gather_kv_cache"), min_block_size=20)
    24
"""

from __future__ import annotations

import importlib
import math

import torch

from portattn.blocksize import BlockSizeRule, MultipleOf, Participant
from portattn.layout import CACHE_DTYPES, LAYOUTS, shuffle_x

# op name -> the module that declares its SUPPORTED_BLOCK_SIZES (imported on first use).
OP_MODULES: dict[str, str] = {
    "write_kv_cache": "portattn.kernels.kv_cache",
    "gather_kv_cache": "portattn.kernels.kv_cache",
    "expand_page_indices": "portattn.kernels.page_indices",
    "paged_attention": "portattn.kernels.paged_attention",
    "mla_decode": "portattn.kernels.mla_decode",
}


def _apply_layout(rules: tuple[BlockSizeRule, ...], x: int) -> tuple[BlockSizeRule, ...]:
    """``rules`` restricted to multiples of ``x``."""
    out: list[BlockSizeRule] = []
    for r in rules:
        if isinstance(r, MultipleOf):
            out.append(MultipleOf(r.n * x // math.gcd(r.n, x)))
        elif r % x == 0:
            out.append(r)
    return tuple(out)


def supported_block_sizes(
    op: str, *, layout: str = "NHD", dtype: torch.dtype = torch.float16
) -> tuple[BlockSizeRule, ...]:
    """The kernel block sizes ``op`` supports with ``layout`` caches of ``dtype``.

    Raises:
        TypeError: ``op`` or ``layout`` not a str, ``dtype`` not a cache dtype.
        ValueError: unknown op or layout, a layout the op does not read, or no size left.
    """
    return _rules("supported_block_sizes", op, layout, dtype)


def participant(
    op: str, name: str | None = None, *, layout: str = "NHD", dtype: torch.dtype = torch.float16
) -> Participant:
    """A `Participant` for ``op`` (named ``name``, default the op's name) in negotiation.

    Raises:
        TypeError / ValueError: as `supported_block_sizes`, and ``name`` neither ``None`` nor a
            non-empty str.
    """
    if name is not None and (not isinstance(name, str) or not name):
        raise TypeError(f"participant: name must be None or a non-empty str; got {name!r}")
    return Participant(name or op, _rules("participant", op, layout, dtype))


def _rules(caller: str, op: object, layout: object, dtype: object) -> tuple[BlockSizeRule, ...]:
    """`supported_block_sizes`' answer; errors name ``caller``."""
    for arg, v in (("op", op), ("layout", layout)):
        if not isinstance(v, str):
            raise TypeError(f"{caller}: {arg} must be a str; got {v!r}")
    if dtype not in CACHE_DTYPES:
        raise TypeError(f"{caller}: dtype must be one of {CACHE_DTYPES}; got {dtype!r}")
    assert isinstance(op, str) and isinstance(dtype, torch.dtype)
    if op not in OP_MODULES:
        raise ValueError(f"{caller}: op must be one of {sorted(OP_MODULES)}; got {op!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"{caller}: layout must be one of {LAYOUTS}; got {layout!r}")
    try:
        module = importlib.import_module(OP_MODULES[op])
    except ModuleNotFoundError as e:
        raise ValueError(f"{caller}: op {op!r} is not available ({e})") from None
    if not hasattr(module, "SUPPORTED_BLOCK_SIZES"):
        raise ValueError(f"{caller}: {OP_MODULES[op]} must declare SUPPORTED_BLOCK_SIZES for {op}")
    rules: tuple[BlockSizeRule, ...] = tuple(module.SUPPORTED_BLOCK_SIZES)
    layouts = tuple(getattr(module, "SUPPORTED_LAYOUTS", LAYOUTS))
    if layout not in layouts:
        raise ValueError(f"{caller}: layout for {op} must be one of {layouts}; got {layout!r}")
    if layout == "SHUFFLE":
        rules = _apply_layout(rules, shuffle_x(dtype))
        if not rules:
            raise ValueError(
                f"{caller}: {op} supports no block size that is a multiple of "
                f"x={shuffle_x(dtype)} (SHUFFLE, {dtype})"
            )
    return rules
