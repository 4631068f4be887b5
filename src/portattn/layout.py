"""KV-cache layouts, how kernels address them, and hybrid models' interleaved caches.

Layouts (``x = 16 bytes // element_size``: 8 for fp16/bf16, 4 for fp32):

- ``"NHD"``: key_cache and value_cache ``[num_blocks, block_size, num_kv_heads, head_dim]``.
- ``"SHUFFLE"``: key_cache ``[num_blocks, num_kv_heads, head_dim // x, block_size, x]``,
  value_cache ``[num_blocks, num_kv_heads, block_size // x, head_dim, x]``.

Every layout is one instance of a single addressing rule, which is what kernels receive
(`CacheAddressing`): element (block ``b``, in-block token ``t``, head ``h``, dim ``d``) lives at

    b*stride_block + h*stride_head + (t // TOK_SPLIT)*stride_tok_hi + (t % TOK_SPLIT)*stride_tok_lo
                   + (d // DIM_SPLIT)*stride_dim_hi + (d % DIM_SPLIT)*stride_dim_lo

NHD has ``TOK_SPLIT = DIM_SPLIT = 1``; SHUFFLE K has ``DIM_SPLIT = x``; SHUFFLE V has
``TOK_SPLIT = x``. Any strides are allowed, so a hybrid model's interleaved cache (a strided view of
a shared buffer) is addressed exactly like a contiguous one.

`is_block_contiguous` is THE block-level-contiguity predicate: when it holds, token ``t`` of block
``b`` sits at ``(b*block_size + t) * stride_tok`` and a kernel may address the cache by flat slot;
otherwise it must address block and in-block offset separately. Both the write path and the read
path take their addressing from `describe_kv_cache`, which consults it, so they cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from portattn.kernels._checks import Problems, check_device
from portattn.kernels._launch import vector_elems
from portattn.platform import is_int

Layout = Literal["NHD", "SHUFFLE"]
LAYOUTS: tuple[str, ...] = ("NHD", "SHUFFLE")
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def shuffle_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector for ``dtype`` (the SHUFFLE layout's ``x``)."""
    if not isinstance(dtype, torch.dtype) or dtype.itemsize > 16:
        raise TypeError(
            f"shuffle_x: dtype must be a torch.dtype of at most 16 bytes; got {dtype!r}"
        )
    return 16 // dtype.itemsize


@dataclass(frozen=True)
class CacheAddressing:
    """How a kernel addresses one cache tensor (see the module docstring for the rule).

    All strides are in elements. ``block_contiguous`` is `is_block_contiguous` of this cache.
    """

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    stride_block: int
    stride_head: int
    stride_tok_hi: int
    stride_tok_lo: int
    stride_dim_hi: int
    stride_dim_lo: int
    tok_split: int
    dim_split: int

    @property
    def block_contiguous(self) -> bool:
        return is_block_contiguous(self)

    def kernel_args(self, prefix: str) -> dict[str, int]:
        """Stride keyword arguments ``stride_<prefix>_block`` ... for a kernel launch."""
        return {
            f"stride_{prefix}_block": self.stride_block,
            f"stride_{prefix}_head": self.stride_head,
            f"stride_{prefix}_tok_hi": self.stride_tok_hi,
            f"stride_{prefix}_tok_lo": self.stride_tok_lo,
            f"stride_{prefix}_dim_hi": self.stride_dim_hi,
            f"stride_{prefix}_dim_lo": self.stride_dim_lo,
        }


def is_block_contiguous(addr: CacheAddressing) -> bool:
    """True when tokens are evenly strided across block boundaries (flat-slot addressable).

    That needs an unsplit token axis (``tok_split == 1``) and ``stride_block == block_size *
    stride_tok``; a hybrid model's interleaved cache (K and V blocks alternate in one buffer, with
    Mamba state between pages) breaks the second condition, a SHUFFLE V cache the first.
    """
    return addr.tok_split == 1 and (
        addr.num_blocks == 1 or addr.stride_block == addr.block_size * addr.stride_tok_hi
    )


def vector_width(addr: CacheAddressing) -> int:
    """Elements of the aligned contiguous runs a kernel may load as one vector; 1: none claimed.

    For a split axis (SHUFFLE: K's dims, V's tokens, runs of ``x``), the runs are contiguous when
    their stride is 1, and a run starts on a multiple of ``w`` elements when every other stride is
    a multiple of ``w``: the answer is the largest such ``w`` dividing the split (``x``, a power of
    two), e.g. 8 for a contiguous or hybrid bf16 SHUFFLE cache, less for a view whose strides are
    not multiples of x. Kernels state it to the compiler (Triton specialises only integer arguments
    divisible by 16); the base pointer's alignment is Triton's own specialisation. Unsplit caches
    (NHD) get 1: their rows' alignment is `row_vector_elems`.
    """
    split = max(addr.tok_split, addr.dim_split)
    if split == 1:
        return 1
    lo = addr.stride_tok_lo if addr.tok_split > 1 else addr.stride_dim_lo
    if lo != 1:
        return 1
    strides = (addr.stride_block, addr.stride_head, addr.stride_tok_hi, addr.stride_dim_hi)
    return math.gcd(split, *strides)


def row_vector_elems(addr: CacheAddressing, elem_size: int) -> int:
    """Elements every row (one token's head) of an unsplit cache (NHD) starts on a multiple of,
    as a kernel may claim it (`kernels._launch.vector_elems` of the block, head and token
    strides): the rows' contiguous head dims then load as vectors of up to 16 bytes. 1 (no
    claim) for split caches (`vector_width` covers their runs), a head dim that is not
    contiguous, and strides that are all multiples of 16 elements (which Triton sees itself)."""
    if addr.tok_split != 1 or addr.dim_split != 1 or addr.stride_dim_hi != 1:
        return 1
    return vector_elems(elem_size, addr.stride_block, addr.stride_head, addr.stride_tok_hi)


def packed_runs(addr: CacheAddressing) -> bool:
    """True when a split cache's runs of x elements lie back to back along its other axis: SHUFFLE
    K's token stride (``[.., block_size, x]``) or SHUFFLE V's dim stride (``[.., head_dim, x]``)
    equals x, as in every cache `empty_kv_cache` and `make_hybrid_cache` build and their slices.
    A kernel may then use x itself, a compile-time constant, as that stride. False when unsplit.
    """
    if addr.dim_split > 1:
        return addr.stride_tok_hi == addr.dim_split
    if addr.tok_split > 1:
        return addr.stride_dim_hi == addr.tok_split
    return False


def _addressing(cache: torch.Tensor, layout: str, kind: str) -> CacheAddressing:
    s = cache.stride()
    if layout == "NHD":
        nb, bs, h, d = cache.shape
        return CacheAddressing(nb, bs, h, d, s[0], s[2], s[1], 0, s[3], 0, 1, 1)
    if kind == "key":
        nb, h, dhi, bs, x = cache.shape
        return CacheAddressing(nb, bs, h, dhi * x, s[0], s[1], s[3], 0, s[2], s[4], 1, x)
    nb, h, bhi, d, x = cache.shape
    return CacheAddressing(nb, bhi * x, h, d, s[0], s[1], s[2], s[4], s[3], 0, x, 1)


def check_layout(p: Problems, layout: object) -> None:
    """``layout`` is one of `LAYOUTS`: a type problem when it is no str, else a value problem."""
    if not isinstance(layout, str):
        p.type(f"layout must be a str, one of {LAYOUTS}; got {layout!r}")
    elif layout not in LAYOUTS:
        p.value(f"layout must be one of {LAYOUTS}; got {layout!r}")


def describe_kv_cache(
    op: str, key_cache: torch.Tensor, value_cache: torch.Tensor, layout: str
) -> tuple[CacheAddressing, CacheAddressing]:
    """Validate a (key_cache, value_cache) pair for ``layout`` and return how to address each.

    Raises ValueError/TypeError naming ``op``, the argument and the rule, listing every problem.
    """
    layout_problems = Problems(op)
    check_layout(layout_problems, layout)
    layout_problems.raise_if_any()
    errors: list[str] = []
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dtype not in CACHE_DTYPES:
            raise TypeError(
                f"{op}: {name} dtype must be one of float16, bfloat16, float32; got {t.dtype}"
            )
    if key_cache.dtype != value_cache.dtype:
        raise TypeError(
            f"{op}: key_cache and value_cache must share a dtype; got {key_cache.dtype} and "
            f"{value_cache.dtype}"
        )
    if key_cache.device != value_cache.device:
        raise ValueError(
            f"{op}: key_cache and value_cache must be on one device; got {key_cache.device} and "
            f"{value_cache.device}"
        )
    want = 4 if layout == "NHD" else 5
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dim() != want:
            errors.append(
                f"{name} must be {want}-D for layout {layout}; got shape {tuple(t.shape)}"
            )
    if errors:
        raise ValueError(f"{op}: " + "; ".join(errors))
    if layout == "SHUFFLE":
        errors += _shuffle_x_errors("key_cache", key_cache)
        errors += _shuffle_x_errors("value_cache", value_cache)
        if errors:
            raise ValueError(f"{op}: " + "; ".join(errors))
    k = _addressing(key_cache, layout, "key")
    v = _addressing(value_cache, layout, "value")
    for field in ("num_blocks", "block_size", "num_kv_heads", "head_dim"):
        if getattr(k, field) != getattr(v, field):
            errors.append(
                f"key_cache and value_cache must agree on {field}; got {getattr(k, field)} and "
                f"{getattr(v, field)} (shapes {tuple(key_cache.shape)}, {tuple(value_cache.shape)})"
            )
    for name, a, t in (("key_cache", k, key_cache), ("value_cache", v, value_cache)):
        if a.num_blocks < 1 or a.block_size < 1 or a.num_kv_heads < 1 or a.head_dim < 1:
            errors.append(f"{name} must have non-empty dims; got shape {tuple(t.shape)}")
    if errors:
        raise ValueError(f"{op}: " + "; ".join(errors))
    return k, v


# -- logical (layout-independent) access, for references and tests ----------------------------


def _layout_args(p: Problems, layout: object, kind: object) -> None:
    """The rules `to_logical`, `from_logical` and `token_view` share for ``layout`` and
    ``kind`` (which picks the SHUFFLE K or V order: a typo must not pick one silently)."""
    check_layout(p, layout)
    if kind not in ("key", "value"):
        p.value(f"kind must be 'key' or 'value'; got {kind!r}")


def _rank_args(p: Problems, name: str, t: object, rank: int, what: str) -> bool:
    """``t`` must be a ``rank``-D tensor (``what`` says which); True when it is."""
    if isinstance(t, torch.Tensor) and t.dim() == rank:
        return True
    got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
    p.type(f"{name} must be a {rank}-D tensor ({what}); got {got}")
    return False


def _shuffle_x_errors(name: str, cache: torch.Tensor) -> list[str]:
    """A SHUFFLE cache's last dim must be its dtype's x (another x orders the elements
    otherwise)."""
    x = shuffle_x(cache.dtype)
    if cache.shape[-1] == x:
        return []
    return [f"{name} last dim must be x=16/element_size={x} for SHUFFLE; got shape "
            f"{tuple(cache.shape)}"]  # fmt: skip


def _cache_args(p: Problems, cache: object, layout: str) -> None:
    """``cache`` must be a cache of ``layout``: NHD 4-D; SHUFFLE 5-D with its dtype's x."""
    rank = 4 if layout == "NHD" else 5
    if _rank_args(p, "cache", cache, rank, f"a {layout} cache") and layout == "SHUFFLE":
        assert isinstance(cache, torch.Tensor)
        p.value(*_shuffle_x_errors("cache", cache))


def to_logical(cache: torch.Tensor, layout: str, kind: str) -> torch.Tensor:
    """A copy of ``cache`` as ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    p = Problems("to_logical")
    _layout_args(p, layout, kind)
    if not p:
        _cache_args(p, cache, layout)
    p.raise_if_any()
    if layout == "NHD":
        return cache.clone()
    # sizes spelled out, not -1: an empty cache (no blocks) has a logical shape too
    nb, h, a, b, x = cache.shape
    if kind == "key":  # [nb, h, d/x, bs, x] -> [nb, bs, h, d/x, x]
        return cache.permute(0, 3, 1, 2, 4).reshape(nb, b, h, a * x)
    # value: [nb, h, bs/x, d, x] -> [nb, bs/x, x, h, d]
    return cache.permute(0, 2, 4, 1, 3).reshape(nb, a * x, h, b)


def from_logical(logical: torch.Tensor, layout: str, kind: str) -> torch.Tensor:
    """A contiguous cache in ``layout`` holding ``logical`` ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` (the inverse of `to_logical`; SHUFFLE needs ``head_dim`` (key) or
    ``block_size`` (value) divisible by x). Benchmarks use it to time one cache in both layouts."""
    p = Problems("from_logical")
    _layout_args(p, layout, kind)
    what = "[num_blocks, block_size, num_kv_heads, head_dim]"
    if _rank_args(p, "logical", logical, 4, what) and layout == "SHUFFLE" and not p:
        x = shuffle_x(logical.dtype)
        dim, size = (
            ("head_dim", logical.shape[3]) if kind == "key" else ("block_size", logical.shape[1])
        )
        if size % x:
            p.value(f"{dim} must be a multiple of x={x} for a SHUFFLE {kind} cache; got {size}")
    p.raise_if_any()
    if layout == "NHD":
        return logical.contiguous()
    nb, bs, h, d = logical.shape
    x = shuffle_x(logical.dtype)
    if kind == "key":  # [nb, bs, h, d/x, x] -> [nb, h, d/x, bs, x]
        return logical.reshape(nb, bs, h, d // x, x).permute(0, 2, 3, 1, 4).contiguous()
    # value: [nb, bs/x, x, h, d] -> [nb, h, bs/x, d, x]
    return logical.reshape(nb, bs // x, x, h, d).permute(0, 3, 1, 4, 2).contiguous()


def token_view(
    cache: torch.Tensor, layout: str, kind: str, block: int, offset: int
) -> torch.Tensor:
    """A writable view ``[num_kv_heads, head_dim]`` (or ``[h, d/x, x]``) of one cached token.

    For SHUFFLE K the view is ``[num_kv_heads, head_dim // x, x]``: assign ``tok.view(h, -1, x)``.
    """
    p = Problems("token_view")
    _layout_args(p, layout, kind)
    rank = 4 if layout == "NHD" else 5  # read only for a known layout
    if not p:
        _cache_args(p, cache, layout)
    if not p:
        # NHD [nb, bs, h, d]; SHUFFLE K [nb, h, d/x, bs, x], V [nb, h, bs/x, d, x]
        shape = cache.shape
        block_size = shape[1] if rank == 4 else shape[3] if kind == "key" else shape[2] * shape[4]
        for name, i, n in (("block", block, shape[0]), ("offset", offset, block_size)):
            if not is_int(i):
                p.type(f"{name} must be an int in [0, {n}); got {i!r}")
            elif not 0 <= i < n:
                p.value(f"{name} must be an int in [0, {n}); got {i!r}")
    p.raise_if_any()
    if layout == "NHD":
        return cache[block, offset]
    if kind == "key":
        return cache[block, :, :, offset, :]
    x = cache.shape[-1]
    return cache[block, :, offset // x, :, offset % x]


def _check_geometry(
    op: str, sizes: dict[str, Any], layout: object, dtype: object, device: object
) -> None:
    """Refuse, naming each argument and its rule, what the cache builders cannot build: sizes that
    are not ints (``num_blocks`` >= 0, the others >= 1), a layout outside `LAYOUTS`, a dtype the
    ops do not take, a device torch cannot parse or this process cannot see, and caches whose
    byte count leaves int64."""
    p = Problems(op)
    check_device(p, device)
    for name, n in sizes.items():
        low = 0 if name in ("num_blocks", "mamba_state_bytes") else 1
        if not is_int(n):
            p.type(f"{name} must be an int >= {low}; got {type(n).__name__}")
        elif n < low:
            p.value(f"{name} must be >= {low}; got {n}")
    check_layout(p, layout)
    if dtype not in CACHE_DTYPES:
        p.type(f"dtype must be one of {CACHE_DTYPES}; got {dtype!r}")
    if not p:
        esize: int = dtype.itemsize  # type: ignore[attr-defined]
        block = (
            2
            * esize
            * math.prod(n for k, n in sizes.items() if k not in ("num_blocks", "mamba_state_bytes"))
        )
        state = -(-sizes.get("mamba_state_bytes", 0) // esize) * esize  # whole elements
        # with no blocks, one block's strides must still fit int64
        num_blocks = sizes["num_blocks"]
        nbytes = max(num_blocks, 1) * (block + state)
        if nbytes >= 2**63:
            what = "the cache's" if num_blocks else "one block's (its strides span one)"
            p.value(f"{what} {nbytes} bytes must be < 2**63; got sizes {sizes}")
    p.raise_if_any()


def empty_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    layout: str = "NHD",
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous, uninitialised ``(key_cache, value_cache)`` in ``layout``."""
    sizes = dict(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                 head_dim=head_dim)  # fmt: skip
    _check_geometry("empty_kv_cache", sizes, layout, dtype, device)
    if layout == "NHD":
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return (
            _empty("empty_kv_cache", sizes, shape, dtype, device),
            _empty("empty_kv_cache", sizes, shape, dtype, device),
        )
    x = shuffle_x(dtype)
    if head_dim % x or block_size % x:
        raise ValueError(
            f"empty_kv_cache: SHUFFLE needs head_dim and block_size divisible by x={x}; got "
            f"head_dim={head_dim}, block_size={block_size}"
        )
    k_shape = (num_blocks, num_kv_heads, head_dim // x, block_size, x)
    v_shape = (num_blocks, num_kv_heads, block_size // x, head_dim, x)
    k = _empty("empty_kv_cache", sizes, k_shape, dtype, device)
    return k, _empty("empty_kv_cache", sizes, v_shape, dtype, device)


def _empty(op: str, sizes: dict[str, Any], shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    """``torch.empty``; an allocation the device cannot hold re-raises torch's error (same type)
    with the op, the bytes and the sizes asked for in front of torch's own words."""
    try:
        return torch.empty(shape, dtype=dtype, device=device)
    except RuntimeError as exc:  # torch.OutOfMemoryError included
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        raise type(exc)(
            f"{op}: cannot allocate {nbytes} bytes on {device} for sizes {sizes} ({exc})"
        ) from exc


# -- hybrid models: interleaved [K0][V0][S0][K1][V1][S1]... pages -----------------------------


@dataclass(frozen=True)
class HybridCache:
    """A hybrid model's shared page buffer and its views.

    Page ``b`` holds K block ``b``, then V block ``b``, then ``mamba_state_bytes`` of Mamba state
    (rounded up to whole cache elements). ``key_cache``/``value_cache`` are strided views in the
    requested layout; ``mamba_state`` is a ``[num_blocks, mamba_state_bytes]`` uint8 view.
    """

    buffer: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    mamba_state: torch.Tensor
    page_elems: int


def make_hybrid_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    mamba_state_bytes: int,
    layout: str = "NHD",
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
) -> HybridCache:
    """Build a hybrid model's interleaved cache as strided views of one shared buffer."""
    sizes = dict(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, mamba_state_bytes=mamba_state_bytes)  # fmt: skip
    _check_geometry("make_hybrid_cache", sizes, layout, dtype, device)
    esize = torch.empty((), dtype=dtype).element_size()
    blk = block_size * num_kv_heads * head_dim
    state_elems = -(-mamba_state_bytes // esize)
    page = 2 * blk + state_elems
    buffer = _empty("make_hybrid_cache", sizes, (num_blocks * page,), dtype, device)
    if layout == "NHD":
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        strides = (page, num_kv_heads * head_dim, head_dim, 1)
        k = buffer.as_strided(shape, strides, 0)
        v = buffer.as_strided(shape, strides, blk)
    elif layout == "SHUFFLE":
        x = shuffle_x(dtype)
        if head_dim % x or block_size % x:
            raise ValueError(
                f"make_hybrid_cache: SHUFFLE needs head_dim and block_size divisible by x={x}; "
                f"got head_dim={head_dim}, block_size={block_size}"
            )
        hs = head_dim * block_size  # elements per head inside a block
        k = buffer.as_strided(
            (num_blocks, num_kv_heads, head_dim // x, block_size, x),
            (page, hs, block_size * x, x, 1),
            0,
        )
        v = buffer.as_strided(
            (num_blocks, num_kv_heads, block_size // x, head_dim, x),
            (page, hs, head_dim * x, x, 1),
            blk,
        )
    else:
        raise ValueError(f"make_hybrid_cache: layout must be one of {LAYOUTS}; got {layout!r}")
    state = buffer.view(torch.uint8).as_strided(
        (num_blocks, mamba_state_bytes), (page * esize, 1), 2 * blk * esize
    )
    return HybridCache(buffer, k, v, state, page)
