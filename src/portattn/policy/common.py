"""Launch options every tile policy shares; a policy is a pure ``(target, problem) -> Tiles``."""

from __future__ import annotations

from dataclasses import dataclass

from portattn.platform import Target


@dataclass(frozen=True)
class LaunchOptions:
    """Triton launch options for one kernel launch.

    Attributes:
        num_warps: warps (wavefronts on AMD) per program.
        num_stages: software-pipelining depth.
        waves_per_eu: HIP only: occupancy hint (0 = compiler's choice).
        maxnreg: CUDA only: a register cap per thread (PTX ``.maxnreg``) that buys one more
            resident program per multiprocessor (None = the compiler's choice).
    """

    num_warps: int
    num_stages: int
    waves_per_eu: int | None = None
    maxnreg: int | None = None

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
        return out if backend != target.vendor else self.kwargs(target)


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
) -> LaunchOptions:
    """Per-vendor launch options: stages capped by the target; HIP asks for two waves per SIMD
    (``waves_per_eu=2``) to hide the paged gathers' latency unless the policy gives its own;
    CUDA takes a policy's ``maxnreg``."""
    stages = max(1, min(num_stages, target.max_num_stages))
    if target.is_hip:
        waves = 2 if waves_per_eu is None else waves_per_eu
        return LaunchOptions(num_warps=num_warps, num_stages=stages, waves_per_eu=waves)
    return LaunchOptions(num_warps=num_warps, num_stages=stages, maxnreg=maxnreg)
