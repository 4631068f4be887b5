"""Split-KV reduces start under their attention launch on sm_90 (programmatic dependent launch):
the reduce's launch asks for it, the reduce waits for the attention grid before it reads a
partial, and the attention kernel lets it start. Nowhere else does either kernel carry the PTX."""

from __future__ import annotations

import pytest
import torch

from portattn.kernels.mla_decode import plan_mla_decode
from portattn.kernels.paged_attention import plan_paged_attention
from portattn.platform import get_target
from portattn.policy.mla import MlaProblem, mla_decode_tiles
from tests.helpers import in_spawned_workers, target_compile

META = dict(device="meta")


def _mla_plan(arch: str):
    """MLA 576/512, 16 heads, 16 sequences of up to 1k tokens: the policy splits each context."""
    target = get_target(arch)
    q = torch.empty(16, 16, 576, dtype=torch.float16, **META)
    cache = torch.empty(257, 64, 576, dtype=torch.float16, **META)
    bt = torch.empty(16, 16, dtype=torch.int32, **META)
    sl = torch.empty(16, dtype=torch.int32, **META)
    tiles = mla_decode_tiles(target, MlaProblem(16, 576, 512, 2, 16, 1024))
    return plan_mla_decode(q, cache, bt, sl, kv_lora_rank=512, scale=0.05, target=target,
                           tiles=tiles)  # fmt: skip


def _paged_plan(arch: str):
    """Paged decode, 2 sequences x 8 KV heads of up to 16k tokens: too few programs, so split."""
    target = get_target(arch)
    q = torch.empty(2, 32, 128, dtype=torch.float16, **META)
    k = torch.empty(2049, 16, 8, 128, dtype=torch.float16, **META)
    bt = torch.empty(2, 1024, dtype=torch.int32, **META)
    sl = torch.empty(2, dtype=torch.int32, **META)
    qsl = torch.empty(3, dtype=torch.int32, **META)
    return plan_paged_attention(q, k, k, bt, sl, qsl, target=target, max_query_len=1,
                                max_seq_len=16384, check_contents=False)  # fmt: skip


PLANS = {"mla": _mla_plan, "paged": _paged_plan}


@pytest.mark.parametrize("op", sorted(PLANS))
@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "sm_80", "gfx942"])
def test_only_sm90_and_later_reduces_start_under_their_attention(op, arch):
    main, reduce = PLANS[op](arch)
    dependent = arch in ("sm_90", "sm_100")
    assert reduce.options.launch_pdl is dependent
    assert reduce.args["GDC_WAIT"] is dependent
    assert main.args["GDC_LAUNCH"] is dependent
    assert not main.options.launch_pdl  # the attention launch waits for what came before it


def _ptx(op: str) -> tuple[str, str]:
    """The sm_90 PTX of ``op``'s attention and reduce launches (spawned worker: no interpreter)."""
    from portattn.compile.worker import compile_kernel

    target = get_target("sm_90")
    main, reduce = PLANS[op]("sm_90")
    return tuple(compile_kernel(x, target).asm["ptx"] for x in (main, reduce))


@target_compile
def test_the_reduce_waits_for_the_attention_grid_before_it_reads():
    got = in_spawned_workers(_ptx, [(op,) for op in sorted(PLANS)])
    for (op,), (main, reduce) in got.items():
        assert "griddepcontrol.launch_dependents" in main, op
        assert "griddepcontrol.wait" not in main, op
        assert reduce.count("griddepcontrol.wait") == 1, op
        # before the first global load: every partial is read after the attention grid is done
        assert reduce.index("griddepcontrol.wait") < reduce.index("ld.global"), op


def test_launch_pdl_needs_cuda_sm90():
    from portattn.policy.common import LaunchOptions

    opts = LaunchOptions(4, 1, launch_pdl=True)
    assert opts.kwargs(get_target("sm_90"))["launch_pdl"] is True
    for arch in ("sm_80", "gfx942"):
        with pytest.raises(ValueError, match=f"launch_pdl needs a CUDA target of capability >= "
                                             f"90; target is {arch}"):  # fmt: skip
            opts.kwargs(get_target(arch))
    # a CUDA policy forced onto an AMD GPU keeps its tiles and drops the CUDA launch attribute
    assert opts.backend_kwargs(get_target("sm_90"), "hip") == {"num_warps": 4, "num_stages": 1}
