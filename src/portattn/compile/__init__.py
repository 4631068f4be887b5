"""Cross-target compile matrix: every kernel x case x target, compiled on a machine with no GPU.

Triton's wheel carries its NVIDIA and AMD backends, so each op's planned launches
(`portattn.kernels._launch.Launch`, built from meta tensors with the target's policy tiles and
launch options) are compiled for sm_80 ... sm_120 and gfx90a ... gfx950 here, and gated on: it
compiles, its shared memory fits the target, it does not spill (`matrix.SPILL_THRESHOLD`).
Two upstream bugs (design §4, lessons 1 and 3) were compile-time failures on one vendor only;
this shows them on every commit.

Run it as ``python -m portattn.compile [--targets ...] [--kernels ...]`` (see ``--help``); the
API is `run_matrix(default_cases(), targets)` -> `CellResult` list, and the `report` functions.
"""

from portattn.compile.cases import Case, default_cases, make_case, policy_estimate, select_cases
from portattn.compile.matrix import (
    ESTIMATE_TOLERANCE,
    SPILL_THRESHOLD,
    CellResult,
    evaluate,
    parse_targets,
    run_matrix,
)
from portattn.compile.worker import LaunchResult, compile_launch

__all__ = [
    "ESTIMATE_TOLERANCE",
    "SPILL_THRESHOLD",
    "Case",
    "CellResult",
    "LaunchResult",
    "compile_launch",
    "default_cases",
    "evaluate",
    "make_case",
    "parse_targets",
    "policy_estimate",
    "run_matrix",
    "select_cases",
]
