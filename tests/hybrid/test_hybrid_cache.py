"""Hybrid models' shared page buffer: attention K/V and Mamba state on the same pages.

Byte isolation (writes through the attention views never reach the state bytes and the reverse)
and the kernels (`paged_attention`, `gather_kv_cache`, `mla_decode`) against the references at
every block size the hybrid table derives (test_block_size.DERIVED_BLOCK_SIZES), also with each
page split into kernel blocks of 16, 32 or 64 tokens (docs/design.md lessons 3 and 4).
"""

from __future__ import annotations

import pytest
import torch

from portattn import gather_kv_cache, write_kv_cache
from portattn import reference as ref
from portattn.kernels.mla_decode import mla_decode
from portattn.kernels.paged_attention import paged_attention
from portattn.layout import LAYOUTS, to_logical
from tests.helpers import assert_low_precision_close
from tests.hybrid._cache import hybrid_kv, hybrid_latent

pytestmark = pytest.mark.hybrid

# The table's derived sizes (asserted equal to the table in test_block_size.py).
DERIVED_BLOCK_SIZES = (
    48, 80, 144, 160, 272, 400, 528, 544, 672, 784, 800, 1056, 1072, 1328, 1568, 2048, 3120,
)  # fmt: skip
KERNEL_BLOCKS = (16, 32, 64)
SPLITS_ALL = [(bs, kb) for bs in DERIVED_BLOCK_SIZES for kb in KERNEL_BLOCKS if bs % kb == 0]
# CPU (interpreter): every kernel-block size, over a small, a non-power-of-two and a large page.
SPLITS_CPU = [(80, 16), (544, 16), (544, 32), (2048, 64)]
STATE_BYTES = 1001  # odd: not a whole number of cache elements
NUM_PAGES = 3
# Sequence (length, query tokens, pages): one crosses a page boundary in pages 2 -> 0 with a
# 4-token chunk, one is a single-token decode in page 1 (page-level block ids).
SEQS = lambda bs: ((bs + 3, 4, (2, 0)), (5, 1, (1,)))  # noqa: E731


def _fill_random_bytes(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b = t.view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))


def _batch(seqs, device):
    table = torch.full((len(seqs), max(len(p) for *_, p in seqs)), -1, dtype=torch.int32)
    for i, (*_, pages) in enumerate(seqs):
        table[i, : len(pages)] = torch.tensor(pages)
    seq_lens = torch.tensor([n for n, *_ in seqs], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor([q for _, q, _ in seqs]).cumsum(0).tolist()])
    return table.to(device), seq_lens.to(device), qsl.to(torch.int32).to(device)


# -- byte isolation -----------------------------------------------------------------------------


def _kv_coverage(layout, kernel_block, dtype):
    """Bytes of the buffer that the K/V views cover (True) — built by writing through them."""
    hk = hybrid_kv(NUM_PAGES, 48, 2, 16, state_bytes=STATE_BYTES, dtype=dtype, device="cpu",
                   layout=layout, kernel_block=kernel_block)  # fmt: skip
    hk.buffer.zero_()
    n = NUM_PAGES * 48
    third = torch.full((n, 2, 16), 1 / 3, dtype=dtype)  # no zero byte in fp16 or fp32
    slots = hk.to_kernel_slots(torch.arange(n))
    ref.write_kv_cache(third, third, hk.key_cache, hk.value_cache, slots, layout=layout)
    return hk.buffer.view(torch.uint8) != 0


@pytest.mark.parametrize("dtype", (torch.float16, torch.float32), ids=str)
@pytest.mark.parametrize("kernel_block", (None, 16), ids=("page", "kb16"))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_views_partition_the_page(layout, kernel_block, dtype):
    """K/V views and the state view are disjoint; together they leave only padding."""
    cover = _kv_coverage(layout, kernel_block, dtype)
    hk = hybrid_kv(NUM_PAGES, 48, 2, 16, state_bytes=STATE_BYTES, dtype=dtype, device="cpu",
                   layout=layout, kernel_block=kernel_block)  # fmt: skip
    hk.buffer.zero_()
    hk.state.fill_(0xFF)
    state = hk.buffer.view(torch.uint8) != 0
    assert not (cover & state).any()
    esize = torch.empty((), dtype=dtype).element_size()
    assert int(cover.sum()) == 2 * NUM_PAGES * 48 * 2 * 16 * esize
    assert int(state.sum()) == NUM_PAGES * STATE_BYTES


@pytest.mark.parametrize("writer", ("reference", "kernel"))
@pytest.mark.parametrize("kernel_block", (None, 16), ids=("page", "kb16"))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_writes_never_touch_state(device, layout, kernel_block, writer):
    dtype = torch.float16
    cover = _kv_coverage(layout, kernel_block, dtype).to(device)
    hk = hybrid_kv(NUM_PAGES, 48, 2, 16, state_bytes=STATE_BYTES, dtype=dtype, device=device,
                   layout=layout, kernel_block=kernel_block)  # fmt: skip
    _fill_random_bytes(hk.buffer, seed=1)
    before = hk.buffer.view(torch.uint8).clone()
    g = torch.Generator().manual_seed(2)
    n = NUM_PAGES * 48 - 7  # every slot but a few, in random order, with a padding slot
    slots = torch.randperm(NUM_PAGES * 48, generator=g)[:n]
    slots[3] = -1
    key = torch.randn((n, 2, 16), generator=g).to(dtype).to(device)
    value = torch.randn((n, 2, 16), generator=g).to(dtype).to(device)
    kslots = hk.to_kernel_slots(slots).to(device)
    write = ref.write_kv_cache if writer == "reference" else write_kv_cache
    write(key, value, hk.key_cache, hk.value_cache, kslots, layout=layout)
    changed = hk.buffer.view(torch.uint8) != before
    assert not (changed & ~cover).any(), "a write reached bytes outside the K/V views"
    # ... and every written token reads back from its page-level slot.
    lk = to_logical(hk.key_cache, layout, "key").cpu()
    lv = to_logical(hk.value_cache, layout, "value").cpu()
    for i, s in enumerate(kslots.tolist()):
        if s >= 0:
            b, o = divmod(s, hk.kernel_block)
            assert torch.equal(lk[b, o], key[i].cpu()) and torch.equal(lv[b, o], value[i].cpu())


@pytest.mark.parametrize("kernel_block", (None, 16), ids=("page", "kb16"))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_state_writes_never_touch_attention(layout, kernel_block):
    hk = hybrid_kv(NUM_PAGES, 48, 2, 16, state_bytes=STATE_BYTES, dtype=torch.float16,
                   device="cpu", layout=layout, kernel_block=kernel_block)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    hk.key_cache.copy_(torch.randn(hk.key_cache.shape, generator=g))
    hk.value_cache.copy_(torch.randn(hk.value_cache.shape, generator=g))
    blocks = hk.attention_blocks(NUM_PAGES)
    k0, v0 = hk.key_cache[blocks], hk.value_cache[blocks]
    hk.state.copy_(torch.randint(0, 256, hk.state.shape, generator=g, dtype=torch.uint8))
    assert torch.equal(hk.key_cache[blocks], k0) and torch.equal(hk.value_cache[blocks], v0)


# -- kernels over the hybrid buffer ---------------------------------------------------------------


def _check_attention(device, dtype, block_size, kernel_block, hkv, hq, head_dim, layout="NHD"):
    hk = hybrid_kv(NUM_PAGES, block_size, hkv, head_dim, state_bytes=STATE_BYTES, dtype=dtype,
                   device=device, layout=layout, kernel_block=kernel_block)  # fmt: skip
    g = torch.Generator().manual_seed(block_size)
    hk.key_cache.copy_(torch.randn(hk.key_cache.shape, generator=g).to(dtype))
    hk.value_cache.copy_(torch.randn(hk.value_cache.shape, generator=g).to(dtype))
    _fill_random_bytes(hk.state, seed=4)  # after K/V: split caches' views span the state slots
    state0 = hk.state.clone()
    table, seq_lens, qsl = _batch(SEQS(block_size), device)
    ktable = hk.to_kernel_table(table)
    q = torch.randn((int(qsl[-1]), hq, head_dim), generator=g).to(dtype).to(device)
    args = (q, hk.key_cache, hk.value_cache, ktable, seq_lens, qsl)
    out = paged_attention(*args, layout=layout)
    oracle = ref.paged_attention(*args, layout=layout)
    lowp = ref.paged_attention(*args, layout=layout, compute_dtype=dtype)
    assert_low_precision_close(out.cpu(), oracle, lowp)
    cu = torch.tensor([0, *seq_lens.cpu().cumsum(0).tolist()], device=device)
    k, v = gather_kv_cache(hk.key_cache, hk.value_cache, ktable, cu, layout=layout)
    rk, rv = ref.gather_kv_cache(hk.key_cache, hk.value_cache, ktable, cu, layout=layout)
    assert torch.equal(k.cpu(), rk.cpu()) and torch.equal(v.cpu(), rv.cpu())
    assert torch.equal(hk.state, state0)


def _check_mla(device, dtype, block_size, kernel_block, heads, rank, rope):
    hl = hybrid_latent(NUM_PAGES, block_size, rank + rope, state_bytes=STATE_BYTES, dtype=dtype,
                       device=device, kernel_block=kernel_block)  # fmt: skip
    g = torch.Generator().manual_seed(block_size + 1)
    hl.kv_cache.copy_(torch.randn(hl.kv_cache.shape, generator=g).to(dtype))
    _fill_random_bytes(hl.state, seed=5)
    state0 = hl.state.clone()
    table, seq_lens, qsl = _batch(SEQS(block_size), device)
    ktable = hl.to_kernel_table(table)
    q = torch.randn((int(qsl[-1]), heads, rank + rope), generator=g).to(dtype).to(device)
    scale = (rank + rope) ** -0.5
    kw = dict(kv_lora_rank=rank, scale=scale, query_start_loc=qsl)
    out = mla_decode(q, hl.kv_cache, ktable, seq_lens, **kw)
    oracle, _ = ref.mla_decode(q, hl.kv_cache, ktable, seq_lens, **kw)
    lowp, _ = ref.mla_decode(q, hl.kv_cache, ktable, seq_lens, compute_dtype=dtype, **kw)
    assert_low_precision_close(out.cpu(), oracle, lowp)
    assert torch.equal(hl.state, state0)


@pytest.mark.parametrize("block_size", DERIVED_BLOCK_SIZES)
def test_paged_attention_and_gather_at_derived_block_sizes(device, block_size):
    _check_attention(device, torch.float16, block_size, None, hkv=2, hq=4, head_dim=32)


@pytest.mark.parametrize("block_size", DERIVED_BLOCK_SIZES)
def test_mla_decode_at_derived_block_sizes(device, block_size):
    _check_mla(device, torch.float16, block_size, None, heads=2, rank=32, rope=16)


@pytest.mark.parametrize(("block_size", "kernel_block"), SPLITS_CPU)
def test_kernel_block_split(device, block_size, kernel_block):
    _check_attention(device, torch.float16, block_size, kernel_block, hkv=2, hq=4, head_dim=32)
    _check_mla(device, torch.float16, block_size, kernel_block, heads=2, rank=32, rope=16)


def test_shuffle_layout_hybrid(device):
    """The SHUFFLE layout on an interleaved buffer at a non-power-of-two page (544 = 68 x 8)."""
    _check_attention(device, torch.float16, 544, None, hkv=2, hq=4, head_dim=32, layout="SHUFFLE")


# -- GPU: real shapes in bf16 -------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("block_size", "kernel_block"),
                         [(bs, None) for bs in DERIVED_BLOCK_SIZES] + SPLITS_ALL)  # fmt: skip
def test_gpu_derived_block_sizes_bf16(block_size, kernel_block):
    # Qwen3-Next's attention per rank at TP 1 (16 q / 2 kv heads, head_dim 256), Nemotron-H's
    # (32 / 8, 128), and DeepSeek-V3's MLA (128 heads, 512 + 64) at every derived page size.
    _check_attention("cuda", torch.bfloat16, block_size, kernel_block, hkv=2, hq=16, head_dim=256)
    _check_attention("cuda", torch.bfloat16, block_size, kernel_block, hkv=8, hq=32, head_dim=128)
    _check_mla("cuda", torch.bfloat16, block_size, kernel_block, heads=128, rank=512, rope=64)
