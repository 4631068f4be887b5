"""Launch plans describe a kernel launch identically under the JIT and the interpreter."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from portattn.kernels._launch import Launch, kernel_params
from portattn.platform import get_target
from portattn.policy.common import LaunchOptions


@triton.jit
def _toy_kernel(a_ptr, n, scale, BLOCK: tl.constexpr):
    pass


def _launch(arch: str, options: LaunchOptions, n: int = 3) -> Launch:
    args = {"a_ptr": torch.empty(4, dtype=torch.float16), "n": n, "scale": 0.5, "BLOCK": 16}
    return Launch(_toy_kernel, (1,), args, options, get_target(arch))


def test_signature_and_constexprs():
    launch = _launch("sm_90", LaunchOptions(4, 2))
    assert launch.constexprs() == {"BLOCK": 16}
    assert launch.signature() == {
        "a_ptr": "*fp16",
        "n": "i32",
        "scale": "fp32",
        "BLOCK": "constexpr",
    }
    assert _launch("sm_90", LaunchOptions(4, 2), n=2**31).signature()["n"] == "i64"


def test_hip_only_option_refused_on_cuda():
    opts = LaunchOptions(4, 2, waves_per_eu=2)
    assert _launch("gfx942", opts).options.kwargs(get_target("gfx942"))["waves_per_eu"] == 2
    with pytest.raises(ValueError, match="waves_per_eu is a HIP-only option; target is sm_90"):
        opts.kwargs(get_target("sm_90"))


def test_cuda_only_register_cap_refused_on_hip():
    opts = LaunchOptions(4, 2, maxnreg=128)
    assert opts.kwargs(get_target("sm_90")) == {"num_warps": 4, "num_stages": 2, "maxnreg": 128}
    with pytest.raises(ValueError, match="maxnreg is a CUDA-only option; target is gfx942"):
        opts.kwargs(get_target("gfx942"))
    # a CUDA policy forced onto an AMD GPU keeps its tiles and drops the cap
    assert opts.backend_kwargs(get_target("sm_90"), "hip") == {"num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("bad", [0, 16, 256])
def test_register_cap_out_of_range(bad):
    with pytest.raises(ValueError, match=rf"maxnreg must be in \[24, 255\]; got {bad}"):
        LaunchOptions(4, 2, maxnreg=bad)


def test_forced_hip_policy_keeps_tiles_and_drops_hip_hints_on_cuda():
    opts = LaunchOptions(8, 2, waves_per_eu=2)
    gfx942 = get_target("gfx942")
    assert opts.backend_kwargs(gfx942, "cuda") == {"num_warps": 8, "num_stages": 2}
    assert opts.backend_kwargs(gfx942, "hip") == {
        "num_warps": 8,
        "num_stages": 2,
        "waves_per_eu": 2,
    }
    assert _launch("gfx942", opts).backend() == "hip"  # CPU tensors: the target's own backend


@triton.jit
def _defaulted_kernel(a_ptr, n, BLOCK: tl.constexpr, DIAG: tl.constexpr = False):
    pass


def test_every_kernel_parameter_needs_an_argument():
    """A parameter left to its default (here ``DIAG``) would run under Triton's JIT but not
    through the plan's direct launch or the compile matrix: refused when the launch is built."""
    args = {"a_ptr": torch.empty(4, dtype=torch.float16), "n": 3, "BLOCK": 16}
    with pytest.raises(ValueError, match=r"launch toy: args lack kernel parameters \['DIAG'\]"):
        Launch(_defaulted_kernel, (1,), args, LaunchOptions(4, 2), get_target("sm_90"), "toy")
    ok = Launch(_defaulted_kernel, (1,), {**args, "DIAG": False}, LaunchOptions(4, 2),
                get_target("sm_90"), "toy")  # fmt: skip
    assert ok.constexprs() == {"BLOCK": 16, "DIAG": False}


def test_each_kernels_parameters_are_its_own_and_read_once():
    """Every plan asks for its kernels' parameters: read once per kernel object, never another
    kernel's."""
    toy = kernel_params(_toy_kernel)
    assert toy == (("a_ptr", False), ("n", False), ("scale", False), ("BLOCK", True))
    assert [n for n, _ in kernel_params(_defaulted_kernel)] == ["a_ptr", "n", "BLOCK", "DIAG"]
    assert kernel_params(_toy_kernel) is toy


def _run_cpu_launch_without_interpreter() -> str:
    """In a process without Triton's interpreter: a JIT launch given CPU tensors, and what it
    raises (module level: it runs in a spawned worker)."""
    try:
        _launch("sm_90", LaunchOptions(4, 2)).run()
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_cpu_tensors_need_the_interpreter():
    """Without the interpreter, CPU tensors are refused by name before Triton's launcher sees
    them (its own error names no argument)."""
    from tests.helpers import in_spawned_workers

    (msg,) = in_spawned_workers(_run_cpu_launch_without_interpreter, [()]).values()
    assert "['a_ptr'] are on the CPU" in msg and "TRITON_INTERPRET=1" in msg
