"""Speculative verification: every query position against the reference for its own prefix.

An upstream kernel returned the same row for every position of a verification step when the
query length was not a power of two; here each position's reference is a separate single-token
decode over exactly its causal prefix (docs/design.md lesson 5), for `paged_attention` (the draft
model's kind of attention) and `mla_decode` (the target's), per sequence and mixed in one batch.
"""

from __future__ import annotations

import pytest
import torch

from portattn import reference as ref
from portattn.kernels.mla_decode import mla_decode
from portattn.kernels.paged_attention import paged_attention
from portattn.platform import get_target
from tests.helpers import assert_low_precision_close
from tests.specdec._batch import make_group, per_position

pytestmark = pytest.mark.specdec

Q_LENS = (2, 3, 4, 5, 6, 7, 8)
# One batch: plain decode, every verification length, a prefill-sized chunk; contexts cross
# blocks of 16 and end mid-block.
MIXED = ((9, 1), (40, 3), (23, 5), (33, 6), (18, 2), (50, 8), (29, 7), (21, 4))
RANK, ROPE = 32, 16
CPU = dict(block_size=16, hkv=2, d=32, latent_dim=RANK + ROPE, dtype=torch.float16)
HEADS = 4  # query heads (GQA 2:1 for the draft; MLA heads of the target)


def _one_token(t: torch.Tensor, s: int, j: int, qsl) -> torch.Tensor:
    return t[int(qsl[s]) + j : int(qsl[s]) + j + 1]


def _own_context(group, s):
    """Sequence ``s``'s whole context as a one-block cache (so a row's reference reads only it),
    on the group's device, where the references then run."""
    n = int(group.seq_lens[s])
    cu = torch.tensor([0, n])
    table = group.block_table[s : s + 1]
    k, v = ref.gather_kv_cache(group.key_cache, group.value_cache, table, cu)
    lat = ref.gather_kv_cache(group.latent[:, :, None], group.latent[:, :, None], table, cu)[0]
    return k[None], v[None], lat[None, :, 0]


def check_paged(group, q, out):
    qsl = group.query_start_loc.cpu()
    ctx = {s: _own_context(group, s) for s in range(len(group.q_lens))}
    one, block0 = torch.tensor([0, 1]), torch.tensor([[0]])

    def row(s, j, prefix, compute_dtype):
        k, v, _ = ctx[s]
        qj = _one_token(q, s, j, qsl)
        lens = torch.tensor([prefix])
        return ref.paged_attention(qj, k, v, block0, lens, one, compute_dtype=compute_dtype)

    oracle = per_position(group, lambda s, j, p: row(s, j, p, torch.float64))
    lowp = per_position(group, lambda s, j, p: row(s, j, p, q.dtype))
    assert_low_precision_close(out.cpu(), oracle, lowp)
    _rows_differ(out, group)


def check_mla(group, q, out, scale, rank):
    check_mla_outputs(group, q, {"out": out}, scale, rank)


def check_mla_outputs(group, q, outs: dict, scale, rank):
    """Each output in ``outs`` (name -> out) against one set of per-position references."""
    qsl = group.query_start_loc.cpu()
    ctx = {s: _own_context(group, s)[2] for s in range(len(group.q_lens))}
    block0 = torch.tensor([[0]])

    def row(s, j, prefix, compute_dtype):
        return ref.mla_decode(
            _one_token(q, s, j, qsl), ctx[s], block0, torch.tensor([prefix]),
            kv_lora_rank=rank, scale=scale, compute_dtype=compute_dtype,
        )[0]  # fmt: skip

    oracle = per_position(group, lambda s, j, p: row(s, j, p, torch.float64))
    lowp = per_position(group, lambda s, j, p: row(s, j, p, q.dtype))
    for name, out in outs.items():
        try:
            assert_low_precision_close(out.cpu(), oracle, lowp)
            _rows_differ(out, group)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e


def _rows_differ(out, group):
    """The upstream failure mode, named: no two positions of a step share one output row."""
    qsl = group.query_start_loc.tolist()
    for s, e in zip(qsl[:-1], qsl[1:], strict=True):
        rows = out[s:e].flatten(1)
        for j in range(1, e - s):
            assert not torch.equal(rows[j], rows[j - 1]), f"positions {j - 1} and {j} are equal"


def _run_both(group, device, heads=HEADS, mla_target=None):
    """Both models' attention over ``group`` against the per-position references; the MLA
    call with ``mla_target``'s policy forced when given (``target=``)."""
    g = torch.Generator().manual_seed(11)
    num_tokens = int(group.query_start_loc[-1])
    d, dk = group.key_cache.shape[-1], group.latent.shape[-1]
    dtype = group.key_cache.dtype
    q = torch.randn((num_tokens, heads, d), generator=g).to(dtype).to(device)
    out = paged_attention(q, group.key_cache, group.value_cache, group.block_table,
                          group.seq_lens, group.query_start_loc)  # fmt: skip
    check_paged(group, q, out)
    qm = torch.randn((num_tokens, heads, dk), generator=g).to(dtype).to(device)
    scale = dk**-0.5
    rank = dk - (ROPE if dk == RANK + ROPE else 64)
    outm = mla_decode(qm, group.latent, group.block_table, group.seq_lens, kv_lora_rank=rank,
                      scale=scale, query_start_loc=group.query_start_loc,
                      target=mla_target)  # fmt: skip
    check_mla(group, qm, outm, scale, rank)


@pytest.mark.parametrize("q_len", Q_LENS)
def test_verification_step_per_query_length(device, q_len):
    """Two sequences of one verification length; one context ends mid-block."""
    group = make_group(((q_len + 20, q_len), (q_len + 35, q_len)), device=device, **CPU)
    _run_both(group, device)


def test_verification_lengths_mixed_in_one_batch(device):
    group = make_group(MIXED, device=device, **CPU)
    _run_both(group, device)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", Q_LENS)
def test_gpu_verification_bf16(q_len):
    # Real shapes: a Llama-style draft (8 kv heads x 128) and DeepSeek-V3's MLA (576 / 512, 16
    # heads per TP-8 rank), long contexts, block size 64 (FlashMLA's multiple). 8 sequences, not
    # 64: the per-position fp64 oracle runs on the host (64 sequences took > 90 s per case).
    seqs = [(1000 + 371 * i, q_len) for i in range(7)] + [(4096, 1)]
    group = make_group(seqs, block_size=64, hkv=8, d=128, latent_dim=576,
                       dtype=torch.bfloat16, device="cuda")  # fmt: skip
    _run_both(group, "cuda", heads=16)


# -- HIP policies forced: verification packs (query token, head) rows on AMD tiles too ----------

HIP_ARCHS = ("gfx90a", "gfx942", "gfx950")


@pytest.mark.parametrize("arch", HIP_ARCHS)
def test_hip_verification_lengths_mixed_in_one_batch(device, arch):
    """The mixed batch with ``arch``'s MLA policy forced: every length 1-8 in one launch of the
    HIP packed tiles (4 heads: up to 32 rows a sequence), each position against its own prefix."""
    group = make_group(MIXED, device=device, **CPU)
    _run_both(group, device, mla_target=get_target(arch))


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", (2, 4, 8))
def test_gpu_verification_bf16_hip_policies(q_len):
    """Real shapes (as `test_gpu_verification_bf16`) with each HIP MLA policy forced on this
    GPU: DeepSeek-V3's 576/512 at 16 heads through gfx90a's, gfx942's and gfx950's packed
    tiles, each against the same per-position references (the draft's attention does not
    depend on the MLA policy: `test_gpu_verification_bf16` covers it)."""
    seqs = [(1000 + 371 * i, q_len) for i in range(7)] + [(4096, 1)]
    group = make_group(seqs, block_size=64, hkv=8, d=128, latent_dim=576,
                       dtype=torch.bfloat16, device="cuda")  # fmt: skip
    g = torch.Generator().manual_seed(11)
    qm = torch.randn((int(group.query_start_loc[-1]), 16, 576), generator=g)
    qm = qm.to(torch.bfloat16).to("cuda")
    scale, rank = 576**-0.5, 512
    outs = {
        arch: mla_decode(
            qm,
            group.latent,
            group.block_table,
            group.seq_lens,
            kv_lora_rank=rank,
            scale=scale,
            query_start_loc=group.query_start_loc,
            target=get_target(arch),
        )  # fmt: skip
        for arch in HIP_ARCHS
    }
    check_mla_outputs(group, qm, outs, scale, rank)
