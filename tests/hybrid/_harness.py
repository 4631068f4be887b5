"""Run a transformers hybrid model's attention layers through portattn over interleaved pages.

`PortattnAttention` is registered as a transformers attention implementation
(``AttentionInterface``). Per attention layer it owns one hybrid page buffer
(``layout.make_hybrid_cache``: ``[K_b][V_b][Mamba state_b]`` per page) whose block size and state
size are derived from the model's own config (`portattn.hybrid.derive_block_size`), and a block
table whose pages are deliberately out of order. Each call it takes only this step's NEW keys and
values from transformers (the last ``q_len`` positions), writes them with
`portattn.write_kv_cache`, and attends with `portattn.kernels.paged_attention` over the pages:
transformers' own copy of the past keys is never read. The Mamba layers run in transformers.
"""

from __future__ import annotations

import torch

from portattn import write_kv_cache
from portattn.hybrid import derive_block_size
from portattn.kernels.paged_attention import paged_attention
from portattn.layout import make_hybrid_cache

NAME = "portattn_paged"


class PortattnAttention:
    def __init__(self, config, *, batch: int, max_len: int, dtype, device, kernel_multiple=16):
        name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
        derived = derive_block_size(
            config, cache_dtype=name, model_dtype=name, kernel_multiple=kernel_multiple
        )
        self.block_size = bs = derived.block_size
        self.state_bytes = derived.mamba_page_bytes
        per_seq = -(-max_len // bs)
        num_pages = batch * per_seq + 1  # one page no sequence uses
        g = torch.Generator().manual_seed(7)
        order = torch.randperm(num_pages, generator=g)[: batch * per_seq]
        self.block_table = order.reshape(batch, per_seq).to(torch.int32).to(device)
        self.batch, self.device = batch, device
        self.kv_heads, self.head_dim = derived.num_kv_heads, derived.head_dim
        self.caches: dict[int, object] = {}
        self.lens: dict[int, int] = {}
        self.state0: dict[int, torch.Tensor] = {}
        self.num_pages, self.dtype = num_pages, dtype

    def _layer(self, idx: int):
        if idx not in self.caches:
            hc = make_hybrid_cache(
                self.num_pages, self.block_size, self.kv_heads, self.head_dim,
                mamba_state_bytes=self.state_bytes, dtype=self.dtype, device=self.device,
            )  # fmt: skip
            hc.buffer.view(torch.uint8).copy_(
                torch.randint(0, 256, (hc.buffer.numel() * hc.buffer.element_size(),),
                              dtype=torch.uint8, generator=torch.Generator().manual_seed(idx))
            )  # fmt: skip
            self.caches[idx] = hc
            self.lens[idx] = 0
            self.state0[idx] = hc.mamba_state.clone()
        return self.caches[idx]

    def states_untouched(self) -> bool:
        """No attention write reached a Mamba state byte of any page, in any layer."""
        return all(torch.equal(self.caches[i].mamba_state, s) for i, s in self.state0.items())

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 **kwargs):  # fmt: skip
        b, hq, q_len, d = query.shape
        idx = module.layer_idx
        hc = self._layer(idx)
        past = self.lens[idx]
        if key.shape[2] != past + q_len or b != self.batch:
            raise RuntimeError(
                f"harness: layer {idx} expected {past} + {q_len} keys for batch {self.batch}; "
                f"got {tuple(key.shape)}"
            )
        new_k = key[:, :, -q_len:].transpose(1, 2).reshape(b * q_len, key.shape[1], d)
        new_v = value[:, :, -q_len:].transpose(1, 2).reshape(b * q_len, key.shape[1], d)
        pos = torch.arange(past, past + q_len, device=self.device)
        pages = self.block_table[:, pos // self.block_size].long()
        slots = (pages * self.block_size + pos % self.block_size).reshape(-1)
        write_kv_cache(new_k.contiguous(), new_v.contiguous(), hc.key_cache, hc.value_cache, slots)
        q = query.transpose(1, 2).reshape(b * q_len, hq, d)
        seq_lens = torch.full((b,), past + q_len, dtype=torch.int32, device=self.device)
        qsl = torch.arange(0, b * q_len + 1, q_len, dtype=torch.int32, device=self.device)
        out = paged_attention(q, hc.key_cache, hc.value_cache, self.block_table, seq_lens, qsl,
                              scale=scaling)  # fmt: skip
        self.lens[idx] = past + q_len
        return out.reshape(b, q_len, hq, d), None


def generate_logits(model, ids: torch.Tensor, decode_ids: torch.Tensor) -> torch.Tensor:
    """Logits of a prefill of ``ids`` then one decode step per column of ``decode_ids``.

    Returns ``[batch, prompt_len + steps, vocab]`` in float64.
    """
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for t in range(decode_ids.shape[1]):
            out = model(input_ids=decode_ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.past_key_values
    return torch.cat(logits, dim=1).double()
