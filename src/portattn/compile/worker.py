"""Compile one planned launch for one target, on a machine with no GPU, exactly as a launch would.

A real launch (``kernel[grid](**args)``) binds its arguments with Triton's own binder, which
specialises them (pointers and ints divisible by 16 get ``tt.divisibility``, ints equal to 1
become constants, on AMD pointers into buffers under 2 GiB get ``tt.pointer_range``), then calls
``triton.compile(ASTSource(...), target, options)``. `compile_launch` runs the same binder, built
for the requested `GPUTarget` instead of the active driver's, on the plan's meta tensors. A meta
tensor's ``data_ptr()`` is 0 plus its storage offset, so aligned allocations specialise like fresh
device allocations do (a launch on views with odd storage offsets would specialise differently;
the matrix's cases use whole allocations, as the ops' callers do).

Resource figures come from the compiled artifacts, since ``n_regs`` / ``n_spills`` are filled in
only when a kernel is loaded on a device:

* NVIDIA: ``cuobjdump -res-usage`` on the cubin (Triton's wheel ships it) gives registers and the
  stack frame; when the frame is non-empty, ``ptxas -v`` is rerun on the PTX for the exact spill
  bytes (Triton discards its own ``ptxas -v`` log).
* AMD: the AMDGPU metadata in the assembly: ``.vgpr_count``, ``.vgpr_spill_count``,
  ``.sgpr_spill_count``, ``.private_segment_fixed_size`` (scratch) and
  ``.group_segment_fixed_size`` (LDS).

This module must run with ``TRITON_INTERPRET`` off (the matrix's worker processes see to it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from portattn.kernels._launch import Launch
from portattn.platform import Target

# The shape mismatch of upstream lesson 1 and similar errors are one line deep in Triton's
# CompilationError text (after a source excerpt); keep the message short enough for a table.
_MAX_ERROR_CHARS = 2000
# Bump when the meaning of the remembered resource figures changes.
_RESOURCES_VERSION = 3


@dataclass
class LaunchResult:
    """What compiling one launch for one target gave.

    Attributes:
        name: the launch's name (the op, or ``<op>:<stage>`` for multi-kernel ops).
        kernel: the Triton kernel's function name.
        ok: it compiled.
        error: the error's type and message when it did not (``None`` when it did).
        shared: bytes of shared memory / LDS the compiled kernel allocates
            (``metadata.shared``; what a launch requests).
        regs: registers per thread (NVIDIA) or VGPRs per lane (AMD).
        spills: NVIDIA: bytes of ptxas spill stores per thread; AMD: VGPRs spilled to scratch
            (``.vgpr_spill_count``). ``None`` where not measured (a shared-memory-only cell, a
            launch that did not compile).
        scratch: NVIDIA stack frame / AMD private segment bytes per thread.
        policy_shared: the policy's own estimate for these tiles (``None``: no estimate).
        compile_s: wall seconds of the compile (a cache hit is fast).
        num_warps, num_stages: the launch options used.
        hash: Triton's kernel hash (equal hashes: the same compiled kernel).
    """

    name: str
    kernel: str
    ok: bool
    error: str | None = None
    shared: int | None = None
    regs: int | None = None
    spills: int | None = None
    scratch: int | None = None
    policy_shared: int | None = None
    compile_s: float = 0.0
    num_warps: int | None = None
    num_stages: int | None = None
    hash: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _triton_bin(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def source_for(kernel):
    """The compiler front end of ``kernel``: Gluon kernels need theirs (it sets the module's warp
    count before code generation), Triton kernels the plain `ASTSource`."""
    from triton.compiler import ASTSource

    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource
    return ASTSource


def bind(launch: Launch, target: Target):
    """Triton's (signature, constexprs, attrs, options) for ``launch`` compiled for ``target``.

    The same binder and `_pack_args` a JIT launch uses, with the backend of ``target``.
    """
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    if not hasattr(kernel, "params") or not hasattr(kernel, "_pack_args"):
        raise TypeError(
            f"compile: {launch.name} kernel is {type(kernel).__name__}, not a JITFunction "
            "(is TRITON_INTERPRET=1 set in this process?)"
        )
    backend = make_backend(target.gpu_target())
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs: dict[str, Any] = dict(launch.options.kwargs(target))
    kwargs["debug"] = bool(kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, specialization, options = binder(**launch.args, **kwargs)
    return kernel._pack_args(backend, kwargs, bound, specialization, options)


def _source(launch: Launch, target: Target):
    """``(src, options)``: the launch bound for ``target`` (`bind`) and its compiler front end."""
    options, signature, constexprs, attrs = bind(launch, target)
    return source_for(launch.kernel)(launch.kernel, signature, constexprs, attrs), options


def compile_kernel(launch: Launch, target: Target):
    """Triton's compiled kernel of ``launch`` for ``target`` (its ``asm`` holds the PTX / AMDGCN;
    compile errors raise): what `compile_launch` measures, for callers that read the code."""
    import triton

    src, options = _source(launch, target)
    return triton.compile(src, target=target.gpu_target(), options=options.__dict__)


@contextlib.contextmanager
def _stderr_to(path: str) -> Iterator[None]:
    """Send file descriptor 2 (where MLIR and LLVM diagnostics go) to ``path`` for a while."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.dup2(fd, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def _diagnostics(text: str) -> str:
    """The MLIR/LLVM diagnostic lines (``error:`` / ``Pipeline failed``) of a compiler log."""
    keep = [
        ln.split(": ", 1)[-1].strip() if ": error: " in ln or ": note: " in ln else ln.strip()
        for ln in text.splitlines()
        if "error:" in ln or "Pipeline failed" in ln
    ]
    return " | ".join(dict.fromkeys(keep))


def _short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    # Triton's CompilationError puts the source excerpt first and the reason last.
    lines = [ln for ln in text.splitlines() if ln.strip()]
    reason = lines[-1] if lines else text
    if reason not in lines[:1]:
        reason = f"{type(exc).__name__}: {reason}"
    return reason[:_MAX_ERROR_CHARS]


_CUOBJ_RE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
_PTXAS_SPILL_RE = re.compile(r"(\d+) bytes spill stores")


def _nvidia_resources(compiled, capability: int) -> tuple[int | None, int | None, int | None]:
    """(registers, spill bytes, stack bytes) of a compiled NVIDIA kernel, from its cubin."""
    cubin = compiled.asm.get("cubin")
    if cubin is None:
        raise RuntimeError("the compiled kernel holds no cubin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run(
            [_triton_bin("cuobjdump"), "-res-usage", path], capture_output=True, text=True
        )
        m = _CUOBJ_RE.search(res.stdout)
        if res.returncode != 0 or m is None:
            raise RuntimeError(f"cuobjdump -res-usage exited {res.returncode} without the "
                               f"figures: {_first_line(res.stderr or res.stdout)}")  # fmt: skip
        regs, stack, _shared, local = (int(g) for g in m.groups())
        scratch = stack + local
        if scratch == 0:
            return regs, 0, 0
        # A non-empty frame: ask ptxas for the exact spill bytes (Triton drops its -v log).
        from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        arch = sm_arch_from_capability(capability)
        res = subprocess.run(
            [get_ptxas(capability).path, "-v", f"--gpu-name={arch}", ptx, "-o", path + ".o"],
            capture_output=True,
            text=True,
        )
        found = _PTXAS_SPILL_RE.findall(res.stderr + res.stdout)
        if res.returncode != 0 or not found:
            raise RuntimeError(f"ptxas -v exited {res.returncode} without the spill figures: "
                               f"{_first_line(res.stderr or res.stdout)}")  # fmt: skip
        return regs, sum(int(s) for s in found), scratch


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0][:200] if lines else "(no output)"


def _amd_field(asm: str, name: str) -> int | None:
    m = re.search(rf"^\s*\.{name}:\s+(\d+)", asm, re.MULTILINE)
    return int(m.group(1)) if m else None


def _amd_resources(compiled) -> tuple[int | None, int | None, int | None]:
    """(VGPRs, spilled VGPRs, scratch bytes) of a compiled AMD kernel, from its assembly.

    Only VGPR spills count: they go to scratch memory. SGPR spills (``.sgpr_spill_count``) are
    parked in VGPR lanes by ``v_writelane``, cost no memory traffic, and are not reported.
    """
    asm = compiled.asm.get("amdgcn") or ""
    vgpr = _amd_field(asm, "vgpr_count")
    vspill = _amd_field(asm, "vgpr_spill_count")
    scratch = _amd_field(asm, "private_segment_fixed_size")
    missing = [n for n, v in (("vgpr_count", vgpr), ("vgpr_spill_count", vspill),
                              ("private_segment_fixed_size", scratch)) if v is None]  # fmt: skip
    if missing:
        raise RuntimeError(f"the AMDGPU metadata has no {', '.join(missing)}")
    return vgpr, vspill, scratch


def shared_memory_only(src, target: Target, options) -> int:
    """Shared memory Triton allocates for ``src`` on ``target``, without lowering to a binary.

    ``metadata.shared`` is the ``ttg.shared`` attribute that the allocation pass at the start of
    the backend's ``make_llir`` sets. This runs ``make_ttir`` and ``make_ttgir`` (the backend's
    own stage functions) and then only the passes ``make_llir`` runs up to and including that
    allocation (Triton 3.6's lists, per vendor), skipping the LLVM lowering, LLVM optimisation
    and ptxas / AMDGPU codegen that follow. For tiles far too large for any target (upstream
    lesson 3's 2048-token tile) those late stages take minutes on a CPU, while the verdict is the
    allocated size. ``tests/compile`` checks that this figure equals the full compile's on real
    kernels of both vendors, so a Triton upgrade that changes the pass order is caught.
    """
    from triton._C.libtriton import amd, ir, nvidia, passes
    from triton.compiler import make_backend

    gpu = target.gpu_target()
    backend = make_backend(gpu)
    opts = backend.parse_options(dict(options.__dict__))
    stages: dict[str, Any] = {}
    backend.add_stages(stages, opts, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(
        gpu, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context
    )
    metadata: dict[str, Any] = {"hash": src.hash(), "target": gpu, **opts.__dict__}
    for ext in ("ttir", "ttgir"):  # a Gluon source starts at ttgir (its stages have no ttir)
        if ext in stages:
            module = stages[ext](module, metadata)
    pm = ir.pass_manager(module.context)
    if target.vendor == "hip":
        amd.passes.ttgpuir.add_update_async_wait_count(pm, opts.arch)
        amd.passes.ttgpuir.add_optimize_lds_usage(pm, opts.arch, 0)
        passes.convert.add_scf_to_cf(pm)
        passes.gluon.add_inliner(pm)
        passes.convert.add_index_to_llvmir(pm)
        amd.passes.ttgpuir.add_allocate_shared_memory(pm)
    else:
        from triton.backends.nvidia.compiler import get_ptx_version_from_options

        capability = target.capability
        ptx_version = get_ptx_version_from_options(opts, capability)
        passes.ttgpuir.add_combine_tensor_select_and_if(pm)
        passes.ttgpuir.add_allocate_warp_groups(pm)
        passes.convert.add_scf_to_cf(pm)
        passes.gluon.add_inliner(pm)
        nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, capability, ptx_version)
    pm.run(module, "portattn_shared_memory_only")
    return int(module.get_int_attr("ttg.shared"))


def compile_launch(
    launch: Launch, target: Target, policy_shared: int | None, *, shared_only: bool = False
) -> LaunchResult:
    """Compile ``launch`` for ``target`` and measure it; compile errors are results.

    With ``shared_only`` the pipeline stops at shared-memory allocation (`shared_memory_only`):
    the result has the shared memory but no registers, spills or hash.
    """
    kernel_name = getattr(launch.kernel, "__name__", str(launch.kernel))
    opts = launch.options
    result = LaunchResult(
        name=launch.name or kernel_name,
        kernel=kernel_name,
        ok=False,
        policy_shared=policy_shared,
        num_warps=opts.num_warps,
        num_stages=opts.num_stages,
    )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "stderr.log")
        try:
            with _stderr_to(log):
                if shared_only:
                    src, options = _source(launch, target)
                    shared = shared_memory_only(src, target, options)
                else:
                    compiled = compile_kernel(launch, target)
        except Exception as exc:  # noqa: BLE001 - any compiler failure is this cell's result
            result.compile_s = time.perf_counter() - t0
            with open(log, errors="replace") as f:
                diag = _diagnostics(f.read())
            msg = _short_error(exc)
            result.error = (f"{msg} [{diag}]" if diag else msg)[:_MAX_ERROR_CHARS]
            return result
    result.compile_s = time.perf_counter() - t0
    result.ok = True
    if shared_only:
        result.shared = shared
        return result
    result.shared = int(compiled.metadata.shared)
    result.hash = compiled.metadata.hash
    try:  # a spill figure that cannot be read is no spill-free kernel: the cell fails
        result.regs, result.spills, result.scratch = _resources(compiled, target)
    except Exception as exc:  # noqa: BLE001 - the tools' failures are this cell's result
        result.ok = False
        result.error = f"resource figures unreadable: {_short_error(exc)}"
    return result


def _resources(compiled, target: Target) -> tuple[int | None, int | None, int | None]:
    """(regs, spills, scratch), remembered per kernel hash next to Triton's cache.

    NVIDIA figures take a cuobjdump (and, for a kernel with a stack frame, a ptxas) run; a warm
    matrix run reads them back instead. A tool that fails, or output without the figures,
    raises (nothing is remembered).
    """
    from triton import knobs

    folder = os.path.join(knobs.cache.dir, "portattn_resources")
    path = os.path.join(folder, f"{compiled.metadata.hash}.{_RESOURCES_VERSION}.json")
    try:
        with open(path) as f:
            got = json.load(f)
        figures = got["regs"], got["spills"], got["scratch"]
        if all(isinstance(v, int) for v in figures):  # else measured again
            return figures
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if target.vendor == "cuda":
        res = _nvidia_resources(compiled, target.capability)
    else:
        res = _amd_resources(compiled)
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(dict(zip(("regs", "spills", "scratch"), res, strict=True)), f)
    os.replace(tmp, path)
    return res
