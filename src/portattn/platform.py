"""What a GPU is, as far as a tile policy cares.

`Target` is a frozen description of one GPU architecture: vendor, arch name, warp size, the
maximum shared memory (NVIDIA) / LDS (AMD) one program may use, and the few other facts the
policies read. `TARGETS` is the table of supported architectures; `current_target()` reads the
live device, but only when called: nothing here touches a device at import time.

Shared-memory figures are the opt-in maximum per block (thread block / workgroup), in bytes:

| arch    | bytes   | source                                                                   |
|---------|---------|--------------------------------------------------------------------------|
| sm_80   | 166912  | CUDA C++ Programming Guide, "Technical Specifications per Compute       |
|         |         | Capability": max shared memory per block 8.0 = 163 KB (163*1024)         |
| sm_86   | 101376  | same table, 8.6 = 99 KB                                                  |
| sm_89   | 101376  | same table, 8.9 = 99 KB                                                  |
| sm_90   | 232448  | same table, 9.0 = 227 KB; Hopper Tuning Guide §1.4.1.2                   |
| sm_100  | 232448  | same table, 10.0 = 227 KB; Blackwell Tuning Guide                        |
| sm_120  | 101376  | same table, 12.0 = 99 KB                                                 |
| gfx90a  | 65536   | AMD Instinct MI200 CDNA2 ISA guide: 64 KB LDS per workgroup              |
| gfx942  | 65536   | AMD CDNA3 ISA guide / ROCm "GPU hardware specifications": 64 KB LDS      |
| gfx950  | 163840  | ROCm "GPU hardware specifications" (MI350 series): 160 KB LDS            |

Multiprocessor counts are those of the flagship data-center part of each architecture (used only
to size split-KV grids, never for correctness): A100 108, A10 72 (sm_86), L40S 142, H100 SXM 132,
B200 148, RTX PRO 6000 Blackwell 188 (sm_120), MI250X GCD 110, MI300X 304, MI355X 256.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, TypeGuard

Vendor = Literal["cuda", "hip"]


def is_int(x: object) -> TypeGuard[int]:
    """A Python int that is not a bool (``True`` is no block size, count or rank)."""
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class Target:
    """One GPU architecture, as the tile policies see it.

    Attributes:
        vendor: ``"cuda"`` or ``"hip"``.
        arch: ``"sm_90"``, ``"gfx942"`` ...
        warp_size: threads per warp (32) or wavefront (64 on CDNA).
        max_shared_mem: bytes of shared memory / LDS one program may use.
        num_sms: streaming multiprocessors / compute units (split-KV sizing only).
        mma_min_rows: the fewest rows a matrix-unit tile (``tl.dot`` M) may have.
        max_num_stages: software-pipelining depth the backend supports well (AMD's stream
            pipeliner is tuned for 2 stages; NVIDIA's cp.async / TMA pipelines go deeper).
    """

    vendor: Vendor
    arch: str
    warp_size: int
    max_shared_mem: int
    num_sms: int
    mma_min_rows: int = 16
    max_num_stages: int = 4

    def __post_init__(self) -> None:
        # every policy divides and budgets by these: a bad field fails here, by name
        errors = []
        if self.vendor not in ("cuda", "hip"):
            errors.append(f"vendor must be 'cuda' or 'hip'; got {self.vendor!r}")
        prefix = {"cuda": "sm_", "hip": "gfx"}.get(self.vendor, "")
        if (
            not isinstance(self.arch, str)
            or not self.arch.startswith(prefix)
            or (self.vendor == "cuda" and not self.arch[len(prefix) :].isdigit())
        ):
            form = "'sm_<capability>'" if self.vendor == "cuda" else "'gfx<...>'"
            errors.append(f"arch must be {form} for vendor {self.vendor!r}; got {self.arch!r}")
        if self.warp_size not in (32, 64) or isinstance(self.warp_size, bool):
            errors.append(f"warp_size must be 32 or 64; got {self.warp_size!r}")
        for name in ("max_shared_mem", "num_sms", "mma_min_rows", "max_num_stages"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                errors.append(f"{name} must be an int >= 1; got {value!r}")
        if errors:
            raise ValueError("Target: " + "; ".join(errors))

    @property
    def is_hip(self) -> bool:
        return self.vendor == "hip"

    @property
    def capability(self) -> int:
        """CUDA compute capability as an int (``sm_90`` -> 90); HIP targets raise."""
        if self.vendor != "cuda":
            raise ValueError(f"Target.capability: only CUDA targets have one; got {self.arch}")
        return int(self.arch.removeprefix("sm_"))

    def gpu_target(self):  # -> triton.backends.compiler.GPUTarget
        """The Triton `GPUTarget` to compile for this target (imports triton lazily)."""
        from triton.backends.compiler import GPUTarget

        if self.vendor == "cuda":
            return GPUTarget("cuda", self.capability, self.warp_size)
        return GPUTarget("hip", self.arch, self.warp_size)


def _cuda(arch: str, smem: int, sms: int) -> Target:
    return Target("cuda", arch, 32, smem, sms, max_num_stages=4)


def _hip(arch: str, smem: int, cus: int) -> Target:
    return Target("hip", arch, 64, smem, cus, max_num_stages=2)


TARGETS: dict[str, Target] = {
    t.arch: t
    for t in (
        _cuda("sm_80", 166912, 108),
        _cuda("sm_86", 101376, 72),
        _cuda("sm_89", 101376, 142),
        _cuda("sm_90", 232448, 132),
        _cuda("sm_100", 232448, 148),
        _cuda("sm_120", 101376, 188),
        _hip("gfx90a", 65536, 110),
        _hip("gfx942", 65536, 304),
        _hip("gfx950", 163840, 256),
    )
}

_override: Target | None = None


def get_target(arch: str) -> Target:
    """The table entry for ``arch`` (``"sm_90"``, ``"gfx942"``, ...).

    Raises:
        TypeError: ``arch`` is not a string. ValueError: no such entry.
    """
    return _lookup(arch, "get_target: arch")


def _lookup(arch: object, what: str) -> Target:
    """``TARGETS[arch]``; errors begin with ``what`` (the argument or variable named)."""
    if not isinstance(arch, str):
        raise TypeError(f"{what} must be a str, one of {sorted(TARGETS)}; got {arch!r}")
    if arch not in TARGETS:
        raise ValueError(f"{what} must be one of {sorted(TARGETS)}; got {arch!r}")
    return TARGETS[arch]


def set_target_override(target: Target | str | None) -> None:
    """Force `current_target()` to return ``target`` (tests, or HIP policies on an NVIDIA GPU).

    ``None`` clears the override. The environment variable ``PORTATTN_TARGET=<arch>`` does the
    same for a whole process.

    Raises:
        TypeError: ``target`` is neither a `Target`, an arch name nor ``None``.
        ValueError: an arch name outside `TARGETS`.
    """
    global _override
    if isinstance(target, str):
        target = _lookup(target, "set_target_override: target")
    elif target is not None and not isinstance(target, Target):
        raise TypeError(
            "set_target_override: target must be a portattn Target, an arch name (one of "
            f"{sorted(TARGETS)}) or None; got {target!r}"
        )
    _override = target


def target_override() -> Target | str | None:
    """What overrides the live device's target: `set_target_override`'s target, else the
    ``PORTATTN_TARGET`` arch name, else ``None`` (part of the ops' plan-cache key)."""
    return _override if _override is not None else os.environ.get("PORTATTN_TARGET")


# ``os.environ`` keeps the process environment in ``_data`` (encoded keys and values) and
# updates it on every assignment; reading it there skips ``Mapping.get``'s Python frames. Only
# while ``os.environ`` is still the object it was at import (a replaced one is read plainly).
_ENVIRON = os.environ
_ENV_DATA: dict | None = getattr(_ENVIRON, "_data", None)
_ENV_NAME = getattr(_ENVIRON, "encodekey", str)("PORTATTN_TARGET")


def override_key() -> object:
    """`target_override` in a cheaper form for the plan cache's key: the override's `Target`,
    else ``PORTATTN_TARGET``'s raw (encoded) value, else ``None``; equal exactly when
    `target_override` is equal."""
    if _override is not None:
        return _override
    if _ENV_DATA is not None and os.environ is _ENVIRON:
        return _ENV_DATA.get(_ENV_NAME)
    return os.environ.get("PORTATTN_TARGET")


def current_target(device=None) -> Target:
    """The target of the live device (or the override). Reads the device only when called.

    Args:
        device: a torch device or index; defaults to the current CUDA/HIP device.
    """
    if _override is not None:
        return _override
    env = _env_target()
    if env is not None:
        return env
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "current_target: no CUDA/HIP device is visible; pass a Target explicitly or set "
            "PORTATTN_TARGET (e.g. sm_90, gfx942)"
        )
    props = torch.cuda.get_device_properties(device)
    arch = _device_arch(props)
    if getattr(torch.version, "hip", None):
        base = TARGETS.get(arch)
        if base is None:
            raise RuntimeError(f"current_target: unsupported HIP arch {arch!r}")
        return Target(
            "hip",
            arch,
            base.warp_size,
            base.max_shared_mem,
            props.multi_processor_count,
            base.mma_min_rows,
            base.max_num_stages,
        )
    base = TARGETS.get(arch)
    if base is None:
        raise RuntimeError(f"current_target: unsupported CUDA arch {arch!r}")
    smem = int(getattr(props, "shared_memory_per_block_optin", base.max_shared_mem))
    return Target(
        "cuda",
        arch,
        base.warp_size,
        smem,
        props.multi_processor_count,
        base.mma_min_rows,
        base.max_num_stages,
    )


def device_arch(device=None) -> str:
    """The live device's architecture (``sm_90``, ``gfx942``), whatever policy override is set:
    what the hardware is, not what the policies were told it is."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("device_arch: no CUDA/HIP device is visible")
    return _device_arch(torch.cuda.get_device_properties(device))


def _device_arch(props) -> str:
    """The arch name of a device from its torch properties (``sm_90``, ``gfx942``)."""
    import torch

    if getattr(torch.version, "hip", None):
        return props.gcnArchName.split(":")[0]
    return f"sm_{props.major}{props.minor}"


def compile_arch(t, target: Target) -> str:
    """The arch whose compiler builds a launch on tensor ``t``: for a GPU tensor the live
    device's (whatever policy ``target`` or the override forced: HIP tiles on an H100 still
    compile for sm_90); for a meta tensor (the compile matrix) ``target``'s; on the CPU (Triton's
    interpreter) `target_for_tensor`'s."""
    if t.device.type in ("cuda", "hip"):
        import torch

        return _device_arch(torch.cuda.get_device_properties(t.device))
    if t.device.type == "meta":
        return target.arch
    return target_for_tensor(t).arch


def target_for_tensor(t) -> Target:
    """The target a kernel launch on tensor ``t`` compiles for.

    On a CPU or meta tensor (Triton's interpreter, ``TRITON_INTERPRET=1``; the compile matrix)
    there is no device; the override / ``PORTATTN_TARGET`` is used if set, else sm_90, so CPU tests
    exercise a real policy.
    """
    if t.device.type not in ("cuda", "hip"):
        if _override is not None:
            return _override
        return _env_target() or TARGETS["sm_90"]
    return current_target(t.device)


def _env_target() -> Target | None:
    """``PORTATTN_TARGET``'s target; ``None`` when unset or empty.

    Raises:
        ValueError: naming the variable, when it names no arch of `TARGETS`.
    """
    env = os.environ.get("PORTATTN_TARGET")
    return _lookup(env, "PORTATTN_TARGET (when set)") if env else None
