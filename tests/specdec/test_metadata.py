"""MLA metadata across speculative steps: single-token metadata only when ``max_query_len == 1``,
per-step state in the returned object, and a draft's and a target's builders used alternately
without seeing each other's state (docs/design.md lesson 5)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from portattn import reference as ref
from portattn.kernels.mla_decode import mla_decode
from portattn.mla_metadata import MlaMetadataBuilder
from portattn.platform import current_target, get_target
from tests.helpers import assert_low_precision_close
from tests.specdec._batch import make_group

pytestmark = pytest.mark.specdec

MAX_SEQ_LEN = 512  # long enough that the policy splits the KV sequence (workspaces in use)
DRAFT = dict(num_heads=4, kv_lora_rank=32, head_dim_k=48)  # an MTP-style MLA draft layer
TARGET = dict(num_heads=8, kv_lora_rank=64, head_dim_k=80)


def _target(device):
    return get_target("sm_90") if device == "cpu" else current_target()


def _builder(device, layer, max_query_len, max_batch=4):
    return MlaMetadataBuilder(
        _target(device), max_batch=max_batch, dtype=torch.float16, device=device,
        max_query_len=max_query_len, max_seq_len=MAX_SEQ_LEN, **layer,
    )  # fmt: skip


def _step(device, layer, seqs, seed):
    """A (group, query) for ``layer``: cache ``[blocks, 16, head_dim_k]``, ``seqs`` (len, q)."""
    group = make_group(seqs, block_size=16, hkv=1, d=8, latent_dim=layer["head_dim_k"],
                       dtype=torch.float16, device=device, seed=seed)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    n = int(group.query_start_loc[-1])
    q = torch.randn((n, layer["num_heads"], layer["head_dim_k"]), generator=g)
    return group, q.to(torch.float16).to(device)


def _launch_and_check(group, q, layer, md, *, decode):
    kw = dict(kv_lora_rank=layer["kv_lora_rank"], scale=layer["head_dim_k"] ** -0.5)
    qsl = None if decode else group.query_start_loc
    out = mla_decode(q, group.latent, group.block_table, group.seq_lens, query_start_loc=qsl,
                     metadata=md, **kw)  # fmt: skip
    rkw = dict(query_start_loc=group.query_start_loc, **kw)
    oracle, _ = ref.mla_decode(q, group.latent, group.block_table, group.seq_lens, **rkw)
    lowp, _ = ref.mla_decode(q, group.latent, group.block_table, group.seq_lens,
                             compute_dtype=torch.float16, **rkw)  # fmt: skip
    assert_low_precision_close(out.cpu(), oracle, lowp)


def test_policy_splits_so_workspaces_matter(device):
    b = _builder(device, TARGET, max_query_len=4)
    assert b.tiles.num_kv_splits > 1
    assert b.build(torch.tensor([5, 9])).partial_out.shape[1] == b.tiles.num_kv_splits


@pytest.mark.parametrize("q_lens", ((1, 1, 1), (3, 3, 3), (1, 5, 1), (2, 8, 6)), ids=str)
def test_single_token_metadata_only_when_max_query_len_is_1(q_lens):
    b = _builder("cpu", TARGET, max_query_len=8)
    seq_lens = torch.tensor([20, 30, 40])
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    md = b.build(seq_lens, qsl)
    assert md.max_query_len == max(q_lens)
    assert md.decode == (max(q_lens) == 1)
    assert b.build(seq_lens, qsl, max_query_len=max(q_lens)).decode == md.decode


def test_decode_metadata_serves_decode_and_verify_metadata_serves_verification(device):
    b = _builder(device, TARGET, max_query_len=4)
    group, q = _step(device, TARGET, ((40, 1), (17, 1), (33, 1)), seed=1)
    md = b.build(group.seq_lens)
    assert md.decode
    _launch_and_check(group, q, TARGET, md, decode=True)
    group, q = _step(device, TARGET, ((40, 3), (17, 1), (33, 4)), seed=2)
    md = b.build(group.seq_lens, group.query_start_loc, max_query_len=4)
    assert not md.decode
    _launch_and_check(group, q, TARGET, md, decode=False)
    # A verification step given single-token metadata is refused, not silently mis-indexed.
    with pytest.raises(ValueError, match=r"max_query_len == 1"):
        mla_decode(q, group.latent, group.block_table, group.seq_lens, kv_lora_rank=64,
                   scale=0.1, query_start_loc=group.query_start_loc,
                   metadata=b.build(group.seq_lens))  # fmt: skip


def test_per_step_state_lives_in_the_metadata_object(device):
    b = _builder(device, TARGET, max_query_len=4)
    dec_group, dec_q = _step(device, TARGET, ((40, 1), (17, 1), (33, 1)), seed=3)
    ver_group, ver_q = _step(device, TARGET, ((21, 4), (50, 2)), seed=4)
    md_decode = b.build(dec_group.seq_lens)
    md_verify = b.build(ver_group.seq_lens, ver_group.query_start_loc)
    # Building the second step changed neither the first step's metadata nor the builder.
    assert (md_decode.num_seqs, md_decode.max_query_len, md_decode.decode) == (3, 1, True)
    assert (md_verify.num_seqs, md_verify.max_query_len, md_verify.decode) == (2, 4, False)
    assert md_decode.tiles is md_verify.tiles is b.tiles
    assert not any(hasattr(b, a) for a in ("num_seqs", "decode", "seq_lens"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        md_decode.max_query_len = 4  # type: ignore[misc]
    # Launch them out of build order: each step uses only its own metadata.
    _launch_and_check(ver_group, ver_q, TARGET, md_verify, decode=False)
    _launch_and_check(dec_group, dec_q, TARGET, md_decode, decode=True)


def test_draft_and_target_builders_alternate_without_sharing_state(device):
    draft, target = _builder(device, DRAFT, 1), _builder(device, TARGET, 4)
    assert draft.tiles is not target.tiles
    for step in range(2):  # draft proposes (decode), target verifies (q_len 3): twice
        d_group, d_q = _step(device, DRAFT, ((30 + step, 1), (12 + step, 1)), seed=10 + step)
        t_group, t_q = _step(device, TARGET, ((33 + step, 3), (15 + step, 3)), seed=20 + step)
        md_t = target.build(t_group.seq_lens, t_group.query_start_loc, max_query_len=3)
        md_d = draft.build(d_group.seq_lens)  # built between the target's build and launch
        assert md_d.tiles is draft.tiles and md_t.tiles is target.tiles
        assert md_d.partial_out.data_ptr() != md_t.partial_out.data_ptr()
        _launch_and_check(d_group, d_q, DRAFT, md_d, decode=True)
        _launch_and_check(t_group, t_q, TARGET, md_t, decode=False)
    # The draft's metadata cannot be used for the target's layer.
    with pytest.raises(ValueError, match=r"metadata must be built for \(num_heads"):
        mla_decode(t_q, t_group.latent, t_group.block_table, t_group.seq_lens, kv_lora_rank=64,
                   scale=0.1, query_start_loc=t_group.query_start_loc,
                   metadata=draft.build(t_group.seq_lens))  # fmt: skip
