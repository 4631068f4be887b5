"""Split-KV workspaces and per-step metadata for `portattn.mla_decode` (CUDA-graph friendly).

A serving engine captures the decode step in a CUDA graph, so every buffer the launch touches must
exist before capture and keep its address. `MlaMetadataBuilder` asks the MLA policy ONCE for the
largest step it will serve (``max_batch`` sequences of up to ``max_query_len`` tokens, contexts up
to ``max_seq_len``), keeps that frozen `MlaTiles`, and allocates the split-KV workspaces from it:

| workspace      | shape                                                  | dtype |
|----------------|--------------------------------------------------------|-------|
| partial_out    | [max_tokens, num_kv_splits, padded_heads, block_dv]    | fp32  |
| partial_lse    | [max_tokens, num_kv_splits, padded_heads]              | fp32  |

``max_tokens = max_batch * max_query_len``; ``padded_heads`` and ``block_dv`` are the tiles' own
(heads padded to the matrix units' 16 rows, lesson 2), so the kernel, which writes every padded
row, and the buffers cannot disagree. The policy also gets ``max_query_len``: with row packing
(`portattn.policy.mla.MlaTiles.packed`) a sequence's query tokens share a tile's rows, and the
launch grid comes from the step's ``max_query_len`` through `portattn.policy.mla.mla_row_groups`
(so a step must not have a longer query than its metadata says; checked where contents are read).
The launch reads ``metadata.tiles``: it never re-asks the policy.

`MlaMetadataBuilder.build` returns a NEW `MlaMetadata` per step holding that step's state (number
of sequences, longest query, whether it is a single-token decode). The builder keeps no per-step
state (lesson 5: a builder that cached decode-only state broke speculative verification), and the
single-token decode path (token ``i`` is sequence ``i``, no ``query_start_loc``) is chosen only
when ``max_query_len == 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portattn.kernels._checks import (
    Problems,
    capture_errors,
    check_device,
    lazy_bit_errors,
    refuse_unstrided,
)
from portattn.platform import Target, is_int
from portattn.policy.mla import MlaProblem, MlaTiles, mla_decode_tiles

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
_INDEX = (torch.int32, torch.int64)


@dataclass(frozen=True)
class MlaMetadata:
    """One step's MLA decode metadata (see the module docstring).

    Attributes:
        target: the target the tiles were chosen for.
        tiles: the frozen tiles the launch uses (the builder's object itself).
        num_heads, head_dim_k, kv_lora_rank, dtype: the layer this metadata serves.
        max_tokens: query tokens the workspaces hold.
        partial_out: ``[max_tokens, num_kv_splits, padded_heads, block_dv]`` fp32 workspace.
        partial_lse: ``[max_tokens, num_kv_splits, padded_heads]`` fp32 workspace.
        num_seqs: sequences in this step.
        max_query_len: the longest query of this step (1 for plain decode).
    """

    target: Target
    tiles: MlaTiles
    num_heads: int
    head_dim_k: int
    kv_lora_rank: int
    dtype: torch.dtype
    max_tokens: int
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    num_seqs: int
    max_query_len: int

    @property
    def decode(self) -> bool:
        """Single-token decode: one query token per sequence, token ``i`` is sequence ``i``."""
        return self.max_query_len == 1


class MlaMetadataBuilder:
    """Allocates MLA decode workspaces once and builds per-step `MlaMetadata`.

    Args:
        target: the GPU target (``portattn.platform.current_target()`` on a live device).
        max_batch: most sequences per step.
        num_heads: query heads of the layer (any count >= 1; padded by the tiles).
        kv_lora_rank: latent width.
        head_dim_k: query / cache width (latent + rope).
        dtype: query / cache dtype.
        device: where the workspaces live.
        max_query_len: most query tokens per sequence (1 + speculative tokens).
        max_seq_len: longest context served (the split count is chosen for it).

    Example::

        builder = MlaMetadataBuilder(target, max_batch=64, num_heads=16, kv_lora_rank=512,
                                     head_dim_k=576, dtype=torch.bfloat16, device="cuda",
                                     max_seq_len=32768)
        md = builder.build(seq_lens)            # decode step
        out = mla_decode(q, cache, block_table, seq_lens, kv_lora_rank=512, scale=s, metadata=md)
    """

    __slots__ = (
        "target",
        "tiles",
        "num_heads",
        "head_dim_k",
        "kv_lora_rank",
        "dtype",
        "max_batch",
        "max_query_len",
        "max_tokens",
        "_partial_out",
        "_partial_lse",
    )

    def __init__(
        self,
        target: Target,
        *,
        max_batch: int,
        num_heads: int,
        kv_lora_rank: int,
        head_dim_k: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_query_len: int = 1,
        max_seq_len: int,
    ) -> None:
        op = "MlaMetadataBuilder"
        if not isinstance(target, Target):
            raise TypeError(f"{op}: target must be a portattn Target; got {type(target).__name__}")
        if dtype not in _FLOAT:
            raise TypeError(f"{op}: dtype must be one of float16, bfloat16, float32; got {dtype}")
        errors, wrong_type = [], False
        for name, v in (
            ("max_batch", max_batch),
            ("num_heads", num_heads),
            ("kv_lora_rank", kv_lora_rank),
            ("head_dim_k", head_dim_k),
            ("max_query_len", max_query_len),
            ("max_seq_len", max_seq_len),
        ):
            if not is_int(v) or v < 1:
                errors.append(f"{name} must be an int >= 1; got {v!r}")
                wrong_type = wrong_type or not is_int(v)
            elif v >= 2**31 and name != "max_seq_len":  # the kernels index these in int32
                errors.append(f"{name} must be < 2**31; got {v}")
        if not errors and kv_lora_rank > head_dim_k:
            errors.append(f"kv_lora_rank must be <= head_dim_k; got {kv_lora_rank} > {head_dim_k}")
        if not errors and max_batch * max_query_len >= 2**31:
            errors.append(
                "max_batch * max_query_len (the query rows a step may hold) must be < 2**31; got "
                f"{max_batch} * {max_query_len}"
            )
        p = Problems(op)
        check_device(p, device)
        errors += p.reasons
        if errors:  # a TypeError where any of them is a type problem, as the ops raise
            raise (TypeError if wrong_type else ValueError)(f"{op}: " + "; ".join(errors))
        self.target = target
        self.num_heads = num_heads
        self.head_dim_k = head_dim_k
        self.kv_lora_rank = kv_lora_rank
        self.dtype = dtype
        self.max_batch = max_batch
        self.max_query_len = max_query_len
        self.max_tokens = max_batch * max_query_len
        elem = torch.empty((), dtype=dtype).element_size()
        # The one policy call: the launch consumes this object through every metadata.
        problem = MlaProblem(
            num_heads,
            head_dim_k,
            kv_lora_rank,
            elem,
            self.max_tokens,
            max_seq_len,
            max_query_len,
        )
        try:
            self.tiles = mla_decode_tiles(target, problem)
        except ValueError as exc:  # no tile fits the target: the builder's arguments ask for it
            raise ValueError(f"{op}: {exc}") from None
        t = self.tiles
        splits = t.num_kv_splits if t.num_kv_splits > 1 else 0  # no workspace without splits
        self._partial_out = torch.empty(
            (self.max_tokens, splits, t.padded_heads, t.block_dv),
            dtype=torch.float32,
            device=device,
        )
        self._partial_lse = torch.empty(
            (self.max_tokens, splits, t.padded_heads), dtype=torch.float32, device=device
        )

    def build(
        self,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor | None = None,
        *,
        max_query_len: int | None = None,
    ) -> MlaMetadata:
        """This step's metadata; the builder itself is not changed.

        Args:
            seq_lens: ``[num_seqs]`` context lengths (int32/int64).
            query_start_loc: ``[num_seqs + 1]`` query offsets; None for single-token decode.
            max_query_len: the longest query of the step. When None and ``query_start_loc`` is
                given it is read from the tensor (a device sync); pass it to avoid that.

        Raises:
            ValueError/TypeError: arguments that do not fit this builder.
        """
        op = "MlaMetadataBuilder.build"
        named = [("seq_lens", seq_lens), ("query_start_loc", query_start_loc)]
        refuse_unstrided(op, named)
        if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype not in _INDEX:
            got = _arg_summary(seq_lens)
            raise TypeError(f"{op}: seq_lens must be an int32/int64 tensor; got {got}")
        if query_start_loc is not None and (
            not isinstance(query_start_loc, torch.Tensor) or query_start_loc.dtype not in _INDEX
        ):
            raise TypeError(
                f"{op}: query_start_loc must be None or an int32/int64 tensor; got "
                f"{_arg_summary(query_start_loc)}"
            )
        errors = []
        num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
        if seq_lens.dim() != 1:
            errors.append(f"seq_lens must be 1-D; got shape {tuple(seq_lens.shape)}")
        elif not 1 <= num_seqs <= self.max_batch:
            errors.append(
                f"seq_lens must hold 1..max_batch={self.max_batch} sequences; got {num_seqs}"
            )
        if query_start_loc is not None and tuple(query_start_loc.shape) != (num_seqs + 1,):
            errors.append(
                f"query_start_loc must have shape (num_seqs + 1,) = ({num_seqs + 1},); got "
                f"{tuple(query_start_loc.shape)}"
            )
        errors += lazy_bit_errors(named)
        if errors:
            raise ValueError(f"{op}: " + "; ".join(errors))
        if max_query_len is not None and (
            not is_int(max_query_len) or not 1 <= max_query_len <= self.max_query_len
        ):
            raise ValueError(
                f"{op}: max_query_len must be None or an int in 1..{self.max_query_len} (the "
                f"builder's max_query_len); got {max_query_len!r}"
            )
        if query_start_loc is None:
            if max_query_len not in (None, 1):
                raise ValueError(
                    f"{op}: max_query_len must be 1 without query_start_loc; got {max_query_len}"
                )
            max_query_len = 1
        elif max_query_len is None:
            if query_start_loc.is_meta:
                raise ValueError(
                    f"{op}: max_query_len must be given for meta tensors (query_start_loc has no "
                    "values to read)"
                )
            capture_errors(op, query_start_loc.device, "max_query_len", "query_start_loc")
            # int64 differences: int32 offsets that fall by 2**31 or more wrap when subtracted
            qsl = query_start_loc.to(torch.int64)
            steps = qsl[1:] - qsl[:-1]
            shortest, read, first = torch.stack(
                [*torch.aminmax(steps), qsl[0]]
            ).tolist()  # one read
            # the ops' offsets rules, which a metadata-carrying GPU call reads nowhere else
            bad = [f"start at 0; got query_start_loc[0]={first}"] if first != 0 else []
            if shortest < 0:
                bad.append(f"never decrease; got a sequence of {shortest} tokens")
            if bad:
                raise ValueError(f"{op}: query_start_loc must " + " and ".join(bad))
            if read == 1 and shortest != 1:
                raise ValueError(
                    f"{op}: query_start_loc gives a sequence {shortest} tokens and none more than "
                    "1: single-token metadata runs token i as sequence i, so this step needs "
                    "metadata that reads the offsets (a builder of max_query_len >= 2, and "
                    "build(..., max_query_len=2))"
                )
            if not 1 <= read <= self.max_query_len:
                raise ValueError(
                    f"{op}: the longest query in query_start_loc (read, as max_query_len was not "
                    f"given) must be in 1..{self.max_query_len} (the builder's max_query_len); "
                    f"got {read}"
                )
            max_query_len = read
        return MlaMetadata(
            target=self.target,
            tiles=self.tiles,
            num_heads=self.num_heads,
            head_dim_k=self.head_dim_k,
            kv_lora_rank=self.kv_lora_rank,
            dtype=self.dtype,
            max_tokens=self.max_tokens,
            partial_out=self._partial_out,
            partial_lse=self._partial_lse,
            num_seqs=num_seqs,
            max_query_len=max_query_len,
        )


def _arg_summary(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of dtype {x.dtype}, shape {tuple(x.shape)}"
    return type(x).__name__
