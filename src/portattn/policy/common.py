"""Pieces every tile policy shares: launch options and shared-memory budgeting.

A policy is a pure function ``(target, problem) -> <Op>Tiles``; every ``<Op>Tiles`` is a frozen
dataclass that carries a `LaunchOptions` and a shared-memory estimate in bytes. Backend-only
options (HIP's ``waves_per_eu``) are set only for HIP targets, and `LaunchOptions.kwargs`
refuses to hand them to a backend that does not accept them.
"""

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
        maxnreg: CUDA only: registers per thread the compiler may use (PTX ``.maxnreg``): a
            cap that buys one more resident program per multiprocessor where the compiler
            would otherwise take a few registers too many (None = the compiler's choice).
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
        """Keyword arguments for a launch that ``backend`` (``"cuda"``/``"hip"``) compiles.

        Normally ``backend == target.vendor`` and this is `kwargs`. When a policy is forced onto
        the other vendor's GPU (``PORTATTN_TARGET=gfx942`` on an H100, to test HIP tiles there),
        the tiles, warps and stages are kept and the options that backend does not accept
        (``waves_per_eu`` on CUDA, ``maxnreg`` on HIP) are left out, by design: they are
        occupancy hints, not tiles.
        """
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
    target: Target, num_warps: int, num_stages: int, maxnreg: int | None = None
) -> LaunchOptions:
    """Per-vendor launch options, decided in this one place.

    HIP: the stage count is capped by the target (AMD's stream pipeliner is tuned for 2) and
    ``waves_per_eu=2`` asks the compiler to keep register use low enough for two waves per SIMD,
    which hides the latency of the paged gathers. CUDA takes ``maxnreg`` where a policy asks
    for one (HIP ignores it: its occupancy hint is ``waves_per_eu``).
    """
    stages = max(1, min(num_stages, target.max_num_stages))
    if target.is_hip:
        return LaunchOptions(num_warps=num_warps, num_stages=stages, waves_per_eu=2)
    return LaunchOptions(num_warps=num_warps, num_stages=stages, maxnreg=maxnreg)
