"""A planned kernel launch: what every op's launcher produces before it runs anything.

Each op is ``plan_<op>(...) -> list[Launch]`` (validate -> describe the problem -> policy tiles ->
allocate outputs -> keyword arguments) followed by ``launch.run()`` for each. Keeping the plan a
value lets the cross-target compile matrix (`portattn.compile`) compile exactly what a launch would
run, for any target, from meta tensors, with no GPU: `Launch.signature` gives Triton's signature.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl

from portattn.platform import Target
from portattn.policy.common import LaunchOptions

_TRITON_DTYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


@dataclass(frozen=True)
class Launch:
    """One kernel launch: kernel, grid, keyword arguments (tensors, ints, constexprs), options."""

    kernel: Any  # triton.runtime.jit.JITFunction
    grid: tuple[int, ...]
    args: dict[str, Any]
    options: LaunchOptions
    target: Target
    name: str = ""
    outputs: tuple[torch.Tensor, ...] = field(default=())
    #: The caller's tensors this launch writes (a given ``out``, caches written in place,
    #: metadata workspaces): the plan cache checks on every hit that they overlap no input.
    writes: tuple[torch.Tensor, ...] = field(default=())

    def __post_init__(self) -> None:
        """Every kernel parameter has an argument, constexprs and defaulted ones included: the
        plan cache's direct launch, `signature` and the compile matrix read them by name.

        Raises:
            ValueError: ``args`` lacks a parameter (naming the launch and each one missing).
        """
        missing = [name for name, _ in self._params() if name not in self.args]
        if missing:
            raise ValueError(
                f"launch {self.name or getattr(self.kernel, '__name__', self.kernel)!s}: args "
                f"lack kernel parameters {missing} (every parameter must be given, constexprs "
                "and defaulted ones included)"
            )

    def run(self) -> Any:
        """Launch through Triton's JIT; return the compiled kernel (``None`` under the
        interpreter, or when the grid is empty or the tensors are meta and nothing ran: meta
        tensors have shapes but no memory, so a call on them only gives its outputs' shapes)."""
        if any(g == 0 for g in self.grid) or self._on_meta():
            return None
        if hasattr(self.kernel, "params"):  # compiled by Triton's JIT: GPU or pinned host memory
            on_cpu = [
                n for n, v in self.args.items()
                if isinstance(v, torch.Tensor) and v.is_cpu and not v.is_pinned()
            ]  # fmt: skip
            if on_cpu:
                raise ValueError(
                    f"{self.name or getattr(self.kernel, '__name__', self.kernel)!s}: tensors "
                    f"{on_cpu} are on the CPU; CPU tensors run only under Triton's interpreter "
                    "(TRITON_INTERPRET=1 before importing portattn), otherwise pass GPU tensors"
                )
        kernel = self.kernel[self.grid](
            **self.args, **self.options.backend_kwargs(self.target, self.backend())
        )
        return kernel if hasattr(kernel, "packed_metadata") else None

    def _on_meta(self) -> bool:
        dev = next((v.device for v in self.args.values() if isinstance(v, torch.Tensor)), None)
        return dev is not None and dev.type == "meta"

    def backend(self) -> str:
        """The backend that compiles this launch: the device's vendor, or the target's for
        CPU tensors (Triton's interpreter accepts every option)."""
        dev = next((v.device for v in self.args.values() if isinstance(v, torch.Tensor)), None)
        if dev is None or dev.type != "cuda":
            return self.target.vendor
        return "hip" if getattr(torch.version, "hip", None) else "cuda"

    def _params(self) -> tuple[tuple[str, bool], ...]:
        """``(name, is_constexpr)`` per kernel parameter (`kernel_params`)."""
        return kernel_params(self.kernel)

    def constexprs(self) -> dict[str, Any]:
        """The constexpr arguments by name."""
        return {name: self.args[name] for name, c in self._params() if c}

    def signature(self) -> dict[str, str]:
        """Triton's signature for `triton.compiler.ASTSource` (constexprs as ``"constexpr"``)."""
        sig = {}
        for name, is_constexpr in self._params():
            v = self.args[name]
            if is_constexpr:
                sig[name] = "constexpr"
            elif isinstance(v, torch.Tensor):
                sig[name] = "*" + _TRITON_DTYPES[v.dtype]
            elif isinstance(v, bool):
                sig[name] = "i1"
            elif isinstance(v, int):
                sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            elif isinstance(v, float):
                sig[name] = "fp32"
            else:
                raise TypeError(f"Launch.signature: unsupported argument {name}={type(v)}")
        return sig


# kernel id -> (kernel, its parameters): the kernel is kept, so its id names no other object
_PARAMS: dict[int, tuple[Any, tuple[tuple[str, bool], ...]]] = {}


def kernel_params(kernel: Any) -> tuple[tuple[str, bool], ...]:
    """``(name, is_constexpr)`` per parameter of a JIT or an interpreted kernel, read once per
    kernel object (every plan asks: each launch checks its arguments against them)."""
    known = _PARAMS.get(id(kernel))
    if known is not None:
        return known[1]
    if hasattr(kernel, "params"):
        params = tuple((p.name, bool(p.is_constexpr)) for p in kernel.params)
    else:  # TRITON_INTERPRET=1: InterpretedFunction
        sig = inspect.signature(kernel.fn)
        params = tuple((n, "constexpr" in str(p.annotation)) for n, p in sig.parameters.items())
    _PARAMS[id(kernel)] = (kernel, params)
    return params


def run_all(launches: list[Launch]) -> None:
    for launch in launches:
        launch.run()


def rows_aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s rows (its last dim) are contiguous with 16-byte aligned strides and base.
    The Gluon kernels' warp-specialized partitions cannot see the launch's alignment of their
    arguments (Triton drops it at the partition boundary), so their launchers tell them: then
    their loads and stores of such rows go in 16-byte pieces, otherwise element by element."""
    elem = t.element_size()
    return (
        t.stride(-1) == 1
        and all((st * elem) % 16 == 0 for st in t.stride()[:-1])
        and t.data_ptr() % 16 == 0
    )


#: The most programs a launch grid may have along its second and third axes (CUDA's limit:
#: the cache ops launch one grid row a KV head, the split-KV reduce one a query head).
MAX_GRID_YZ = 65535


def vector_elems(elem_size: int, *strides: int) -> int:
    """Elements a kernel may claim that rows addressed by ``strides`` start on (`in_units`),
    so that their contiguous elements load as vectors of up to 16 bytes: the largest power of two
    within 16 bytes dividing every stride; 1 (no claim) where every stride is a multiple of 16
    elements, which Triton sees by itself (it specialises integer arguments divisible by 16 and
    nothing else: a row stride of 520 elements left every element a scalar load)."""
    if all(s % 16 == 0 for s in strides):
        return 1
    return math.gcd(max(1, 16 // elem_size), *strides)


@triton.jit
def in_units(stride_block, stride_head, stride_tok, UNIT: tl.constexpr):
    """A kernel's cache strides said as multiples of ``UNIT`` (its launcher's `vector_elems` of
    them; 1: as they are), a form Triton's axis analysis follows through any sum of their
    products, so rows that start on such multiples load as vectors."""
    if UNIT > 1:
        stride_block = stride_block // UNIT * UNIT
        stride_head = stride_head // UNIT * UNIT
        stride_tok = stride_tok // UNIT * UNIT
    return stride_block, stride_head, stride_tok


def check_trace_buffer(
    trace: Any, need: int, device: torch.device, layout: str, op: str | None = None
) -> None:
    """A Gluon kernel's diagnostic ``trace`` buffer: a contiguous int64 tensor on the launch's
    device of at least ``need`` elements (``layout`` names its dimensions, ``op`` prefixes the
    error). The kernel stamps it flat from its first element, so a strided or expanded view
    would take stamps past its own elements.

    Raises:
        ValueError: naming ``trace`` and the rule.
    """
    if isinstance(trace, torch.Tensor):
        if (
            trace.dtype == torch.int64
            and trace.device == device
            and trace.numel() >= need
            and trace.is_contiguous()
        ):
            return
        got = f"{trace.dtype} on {trace.device}, {trace.numel()} elements, strides {trace.stride()}"
    else:
        got = type(trace).__name__
    prefix = f"{op}: " if op else ""
    raise ValueError(
        f"{prefix}trace must be a contiguous int64 tensor on {device} of at least {need} "
        f"elements ({layout}); got {got}"
    )
