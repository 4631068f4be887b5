"""Launch options every tile policy shares; a policy is a pure ``(target, problem) -> Tiles``."""

from __future__ import annotations

from dataclasses import dataclass

from portattn.platform import Target

#: Capability from which a launch may start under the one before it (programmatic dependent
#: launch, `dependent_launch`).
PDL_MIN_CAPABILITY = 90


@dataclass(frozen=True)
class LaunchOptions:
    """Triton launch options for one kernel launch.

    Attributes:
        num_warps: warps (wavefronts on AMD) per program.
        num_stages: software-pipelining depth.
        waves_per_eu: HIP only: occupancy hint (0 = compiler's choice).
        maxnreg: CUDA only: a register cap per thread (PTX ``.maxnreg``) that buys one more
            resident program per multiprocessor (None = the compiler's choice).
        launch_pdl: CUDA only (sm_90+): programmatic dependent launch; the launch may start
            while the one before it in the stream runs, and its kernel waits for that one's
            results (``griddepcontrol.wait``) before it reads them (`dependent_launch`).
    """

    num_warps: int
    num_stages: int
    waves_per_eu: int | None = None
    maxnreg: int | None = None
    launch_pdl: bool = False

    def __post_init__(self) -> None:
        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"LaunchOptions: maxnreg must be in [24, 255]; got {self.maxnreg}")

    def kwargs(self, target: Target) -> dict[str, int]:
        """Keyword arguments for ``kernel[grid](..., **kwargs)`` on ``target``."""
        out = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.waves_per_eu is not None:
            if not target.is_hip:
                raise ValueError(
                    f"LaunchOptions: waves_per_eu is a HIP-only option; target is {target.arch}"
                )
            out["waves_per_eu"] = self.waves_per_eu
        if self.maxnreg is not None:
            if target.is_hip:
                raise ValueError(
                    f"LaunchOptions: maxnreg is a CUDA-only option; target is {target.arch}"
                )
            out["maxnreg"] = self.maxnreg
        if self.launch_pdl:
            if target.is_hip or target.capability < PDL_MIN_CAPABILITY:
                raise ValueError(
                    "LaunchOptions: launch_pdl needs a CUDA target of capability "
                    f">= {PDL_MIN_CAPABILITY}; target is {target.arch}"
                )
            out["launch_pdl"] = True
        return out

    def backend_kwargs(self, target: Target, backend: str) -> dict[str, int]:
        """Keyword arguments for a launch ``backend`` compiles: `kwargs` on the target's own
        vendor; on the other vendor's GPU (a forced ``PORTATTN_TARGET``) warps and stages are
        kept and that backend's unknown occupancy hints are left out."""
        out = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if backend == "hip" and self.waves_per_eu is not None:
            out["waves_per_eu"] = self.waves_per_eu
        if backend == "cuda" and self.maxnreg is not None:
            out["maxnreg"] = self.maxnreg
        if backend == "cuda" and self.launch_pdl:
            out["launch_pdl"] = True
        return out if backend != target.vendor else self.kwargs(target)


def dependent_launch(target: Target) -> bool:
    """Whether a launch that reads only the launch before it (a split-KV reduce) starts under
    it: CUDA from `PDL_MIN_CAPABILITY`. Its programs then become resident while the other's
    last ones run and wait on the device (``griddepcontrol.wait``) instead of in the launch
    queue; the kernel before it lets them start (``griddepcontrol.launch_dependents``)."""
    return not target.is_hip and target.capability >= PDL_MIN_CAPABILITY


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def prev_pow2(n: int) -> int:
    """Largest power of two <= n (n >= 1)."""
    return 1 << (int(n).bit_length() - 1)


def launch_options(
    target: Target,
    num_warps: int,
    num_stages: int,
    maxnreg: int | None = None,
    waves_per_eu: int | None = None,
    dependent: bool = False,
) -> LaunchOptions:
    """Per-vendor launch options: stages capped by the target; HIP asks for two waves per SIMD
    (``waves_per_eu=2``) to hide the paged gathers' latency unless the policy gives its own;
    CUDA takes a policy's ``maxnreg``. ``dependent``: the launch reads only the one before it,
    so it starts under it where the target allows (`dependent_launch`)."""
    stages = max(1, min(num_stages, target.max_num_stages))
    if target.is_hip:
        waves = 2 if waves_per_eu is None else waves_per_eu
        return LaunchOptions(num_warps=num_warps, num_stages=stages, waves_per_eu=waves)
    return LaunchOptions(
        num_warps=num_warps,
        num_stages=stages,
        maxnreg=maxnreg,
        launch_pdl=dependent and dependent_launch(target),
    )
