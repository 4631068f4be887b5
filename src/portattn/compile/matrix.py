"""Run the compile matrix (cases x targets) in worker processes, and gate every cell.

Gate: a cell fails when

1. planning raises (a policy finds no tile, a launcher rejects the shape), any launch of the
   plan does not compile or its resource figures cannot be read, or its worker fails (a case
   builder raises; a process dies: the cells it took down run again one at a time, so only
   the one that kills a process fails);
2. any launch's compiled shared memory (``metadata.shared``) exceeds the target's
   ``max_shared_mem``;
3. any launch spills more than `SPILL_THRESHOLD` of its vendor (plus the case's stated
   allowance). Units are the backend's: bytes of spill stores on NVIDIA, spilled VGPRs on AMD.

It passes with *notes* when the policy's own shared-memory estimate and the compiler's figure
disagree by more than `ESTIMATE_TOLERANCE`: the policy budgets with its estimate, so a large gap
either wastes tile size (estimate too high) or risks an overflow the estimate cannot see
(compiler higher). The gate itself already fails real overflows (rule 2).

Workers are spawned with ``TRITON_INTERPRET`` cleared (the CPU test gate sets it, and kernels
decorated under it are not compilable), and with ``TRITON_CACHE_DIR`` set when a cache folder is
given, so a second run of the same matrix is mostly cache hits.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from typing import Any

from portattn.compile.cases import Case, policy_estimate
from portattn.compile.worker import LaunchResult, compile_launch
from portattn.platform import TARGETS, get_target

#: Spills allowed before a cell fails, per vendor, in the backend's unit. NVIDIA: bytes of ptxas
#: spill stores per thread; 16 B (four 32-bit registers) tolerates a loop-invariant value ptxas
#: parks in local memory once per program, and is far below what a register-starved tile spills.
#: AMD: VGPRs spilled to scratch (SGPR spills live in VGPR lanes and are not counted); none are
#: allowed. A case that needs more states it and why (`Case.spill_allowance`).
SPILL_THRESHOLD: dict[str, int] = {"cuda": 16, "hip": 0}
#: (low, high) bounds of compiled / estimated shared memory outside which a cell gets a note.
ESTIMATE_TOLERANCE = (0.5, 1.25)
#: Estimates below this many bytes are not compared (a scratch of a few hundred bytes for a
#: reduction is below any tile's budget and not worth a note).
ESTIMATE_MIN_BYTES = 4096


@dataclass
class CellResult:
    """One (case, target) cell: its launches' results and the gate's verdict."""

    kernel: str
    case: str
    arch: str
    vendor: str
    limit: int
    launches: list[LaunchResult] = field(default_factory=list)
    plan_error: str | None = None
    # what stopped the worker outside planning and compiling: an exception in a case's builder,
    # a worker process that died
    crash: str | None = None
    passed: bool = False
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def id(self) -> str:
        return f"{self.kernel}/{self.case}@{self.arch}"

    @property
    def shared(self) -> int | None:
        """The largest compiled shared memory among the launches (``None``: none compiled)."""
        vals = [r.shared for r in self.launches if r.shared is not None]
        return max(vals) if vals else None

    @property
    def compiled(self) -> bool:
        return self.plan_error is None and self.crash is None and all(r.ok for r in self.launches)

    @property
    def refused(self) -> bool:
        """Its op refuses the problem on this target (`REFUSAL`): nothing to compile."""
        return self.plan_error is not None and REFUSAL in self.plan_error

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["id"] = self.id
        d["shared"] = self.shared
        return d


#: What a policy's ValueError says when no tile of the problem fits the target's budgets.
REFUSAL = "no tile fits"


def evaluate(cell: CellResult, spill_allowance: int = 0) -> CellResult:
    """Apply the gate (module docstring) to ``cell``, filling ``passed``, ``reasons``, ``notes``."""
    reasons: list[str] = []
    notes: list[str] = []
    if cell.crash is not None:
        reasons.append(f"worker: {cell.crash}")
    if cell.refused:
        # The op refuses this problem on this target with a clear ValueError before anything
        # runs (the public API does not accept it there): not a failure; which cells refuse is
        # pinned by tests/compile/test_refusals.py so that a new refusal is caught.
        notes.append(f"refused: {cell.plan_error}")
    elif cell.plan_error is not None:
        reasons.append(f"plan: {cell.plan_error}")
    for r in cell.launches:
        tag = f"{r.name}: " if len(cell.launches) > 1 else ""
        if not r.ok:
            reasons.append(f"{tag}compile: {r.error}")
            continue
        if r.shared is not None and r.shared > cell.limit:
            reasons.append(f"{tag}shared memory {r.shared} B > {cell.arch} limit {cell.limit} B")
        base = SPILL_THRESHOLD[cell.vendor]
        unit = "B spilled" if cell.vendor == "cuda" else "VGPRs spilled"
        if r.spills is not None and r.spills > base + spill_allowance:
            reasons.append(f"{tag}{r.spills} {unit} > threshold {base + spill_allowance}")
        elif r.spills is not None and r.spills > base:
            notes.append(
                f"{tag}{r.spills} {unit}, within the case's allowance (+{spill_allowance})"
            )
        est = r.policy_shared
        if est is not None and r.shared is not None and max(est, r.shared) >= ESTIMATE_MIN_BYTES:
            ratio = r.shared / est if est else float("inf")
            lo, hi = ESTIMATE_TOLERANCE
            if not lo <= ratio <= hi:
                notes.append(
                    f"{tag}policy estimate {est} B vs compiled {r.shared} B (x{ratio:.2f})"
                )
    cell.reasons, cell.notes = reasons, notes
    cell.passed = not reasons
    return cell


def _compile_cell(case: Case, arch: str) -> CellResult:
    """Plan ``case`` for ``arch`` and compile every launch (runs in a worker process)."""
    target = get_target(arch)
    cell = CellResult(case.kernel, case.name, arch, target.vendor, target.max_shared_mem)
    t0 = time.perf_counter()
    try:
        launches = case.plan(target)
    except Exception as exc:  # noqa: BLE001 - a plan that raises is this cell's result
        cell.plan_error = f"{type(exc).__name__}: {exc}"
        cell.wall_s = time.perf_counter() - t0
        return cell
    # ptxas failures print a page of PTX to stdout; the error text is kept in the result.
    with contextlib.redirect_stdout(io.StringIO()):
        for launch in launches:
            try:
                est = policy_estimate(launch)
            except (KeyError, ValueError, TypeError, AttributeError):
                est = None
            cell.launches.append(compile_launch(launch, target, est, shared_only=case.shared_only))
    cell.wall_s = time.perf_counter() - t0
    return cell


@contextlib.contextmanager
def _worker_env(cache_dir: str | None) -> Iterator[None]:
    """Environment the spawned workers inherit: no interpreter, the chosen Triton cache."""
    saved = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    os.environ.pop("TRITON_INTERPRET", None)
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = os.path.abspath(cache_dir)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def parse_targets(targets: Sequence[str] | None) -> list[str]:
    """Validated arch names (all of `TARGETS` when ``None``)."""
    if targets is None:
        return list(TARGETS)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"compile: targets must be among {list(TARGETS)}; got {unknown}")
    return list(dict.fromkeys(targets))


def matrix_cells(
    cases: Sequence[Case], targets: Sequence[str] | None = None
) -> list[tuple[Case, str]]:
    """The (case, arch) cells of ``cases`` x ``targets`` (default every target): a case
    compiles only for its vendors' targets (`Case.vendors`, `Case.compiles_for`)."""
    return [(c, a) for c in cases for a in parse_targets(targets) if c.compiles_for(get_target(a))]


def run_matrix(
    cases: Sequence[Case],
    targets: Sequence[str] | None = None,
    *,
    jobs: int | None = None,
    cache_dir: str | None = None,
    progress: Callable[[int, int, CellResult], None] | None = None,
    executor: Executor | None = None,
) -> list[CellResult]:
    """Compile every case for every target in ``jobs`` spawned processes; gate each cell.

    Args:
        cases: the cases (`portattn.compile.cases.default_cases` or a selection).
        targets: arch names; default every target of `portattn.platform.TARGETS`.
        jobs: worker processes; default ``os.cpu_count()``.
        cache_dir: Triton cache folder for the workers; default Triton's own
            (``TRITON_CACHE_DIR`` or ``~/.triton/cache``).
        progress: called as ``progress(done, total, cell)`` after each cell.
        executor: worker processes to use instead of spawning ``jobs`` new ones (kept running
            afterwards); they must run with ``TRITON_INTERPRET`` cleared, and ``cache_dir`` does
            not apply to them.

    Returns:
        One `CellResult` per (case, target) the case compiles for (`Case.compiles_for`), in
        case-major, target-minor order.

    Raises:
        MatrixInterrupted: on a KeyboardInterrupt, the workers stopped; it holds every cell.
    """
    cells = matrix_cells(cases, targets)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(cells) or 1))
    results: dict[int, CellResult] = {}
    ctx = multiprocessing.get_context("spawn")
    with _worker_env(cache_dir):
        pool = executor or ProcessPoolExecutor(max_workers=jobs, mp_context=ctx)
        # Workers start while the environment above is in place (spawned at submit).
        futures = {
            pool.submit(_compile_cells, [cells[i] for i in chunk]): chunk
            for chunk in _chunks(cells, min(CHUNK, max(1, len(cells) // jobs)))
        }
    done = 0

    def finish(i: int, cell: CellResult) -> None:
        nonlocal done
        results[i] = evaluate(cell, cells[i][0].allowance(cell.vendor, cell.arch))
        done += 1
        if progress is not None:
            progress(done, len(cells), results[i])

    broken: list[int] = []  # cells of chunks a dead worker took down with it
    try:
        own = pool if isinstance(pool, ProcessPoolExecutor) and executor is None else None
        with pool if executor is None else contextlib.nullcontext(), _stops_workers(futures, own):
            for fut in as_completed(futures):
                chunk = futures[fut]
                try:
                    got = fut.result()
                except BrokenProcessPool:  # one worker died: every pending chunk fails with it
                    broken += chunk
                    continue
                except (Exception, SystemExit) as exc:  # noqa: BLE001 - its cells' result
                    got = [_crashed(*cells[i], exc) for i in chunk]
                for i, cell in zip(chunk, got, strict=True):
                    finish(i, cell)
        if broken:
            with _worker_env(cache_dir):
                _one_at_a_time([(i, cells[i]) for i in sorted(broken)], finish)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM where the caller raises it so
        stopped = "stopped before its result came back (interrupted)"
        partial = [
            results[i] if i in results else evaluate(_crashed(*cells[i], None, why=stopped))
            for i in range(len(cells))
        ]
        raise MatrixInterrupted(partial) from None
    return [results[i] for i in range(len(cells))]


@contextlib.contextmanager
def _stops_workers(futures: Iterable[Future], pool: ProcessPoolExecutor | None) -> Iterator[None]:
    """On an interrupt, end ``pool``'s processes (before its exit, which would wait for every
    running compile to finish), which fails what is queued; in a caller's pool, which is left
    running, cancel what has not started. Queued work of an ended pool is not cancelled too:
    the executor's thread then fails it as broken and raised on the cancelled futures."""
    try:
        yield
    except KeyboardInterrupt:
        if pool is not None:
            _terminate(pool)
        else:
            for f in futures:
                f.cancel()
        raise


def _terminate(pool: ProcessPoolExecutor) -> None:
    """End ``pool``'s worker processes now (Python 3.14's ``terminate_workers``; before it, the
    executor's own process table)."""
    stop = getattr(pool, "terminate_workers", None)
    if stop is not None:
        stop()
        return
    for process in list(getattr(pool, "_processes", {}).values()):
        process.terminate()


class MatrixInterrupted(KeyboardInterrupt):
    """`run_matrix` stopped by an interrupt: ``cells`` holds every cell, those that had no
    result failed as stopped, so that what finished can still be reported."""

    def __init__(self, cells: list[CellResult]) -> None:
        super().__init__(f"{sum(not c.passed for c in cells)} cells stopped or failed")
        self.cells = cells


def _one_at_a_time(
    todo: Sequence[tuple[int, tuple[Case, str]]], finish: Callable[[int, CellResult], None]
) -> None:
    """Each cell alone in one worker process, a fresh one after a death: the cell during which
    the process died is the one that killed it (a crash, the OOM killer), and it alone fails."""
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=1, mp_context=ctx)
    try:
        for i, (case, arch) in todo:
            try:
                (cell,) = pool.submit(_compile_cells, [(case, arch)]).result()
            except BrokenProcessPool:
                cell = _crashed(case, arch, None)
                pool.shutdown(wait=True)
                pool = ProcessPoolExecutor(max_workers=1, mp_context=ctx)
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - its result
                cell = _crashed(case, arch, exc)
            finish(i, cell)
    except KeyboardInterrupt:
        _terminate(pool)  # before the wait below
        raise
    finally:
        pool.shutdown(wait=True)


#: Cells a worker takes at once: consecutive cases for one target. Neighbouring cases often
#: plan the same kernel for a target (they differ in what its tiles ignore); in one chunk one
#: worker compiles it and the rest hit the cache, where cells handed out one by one had two
#: workers compile it at the same time.
CHUNK = 8


def _chunks(cells: Sequence[tuple[Case, str]], size: int) -> list[list[int]]:
    """Indices of ``cells`` in chunks of at most ``size`` cells of one target, in case order,
    the targets taking turns (so workers running side by side are on different targets)."""
    by_arch: dict[str, list[int]] = {}
    for i, (_, arch) in enumerate(cells):
        by_arch.setdefault(arch, []).append(i)
    runs = [[ids[k : k + size] for k in range(0, len(ids), size)] for ids in by_arch.values()]
    return [run[r] for r in range(max(map(len, runs), default=0)) for run in runs if r < len(run)]


def _crashed(
    case: Case, arch: str, exc: BaseException | None, why: str | None = None
) -> CellResult:
    """The cell whose worker raised ``exc`` (``None``: its process died while compiling it, or
    ``why``)."""
    t = get_target(arch)
    cell = CellResult(case.kernel, case.name, t.arch, t.vendor, t.max_shared_mem)
    died = "the worker process died compiling this cell (a crash, or killed: out of memory?)"
    cell.crash = (why or died) if exc is None else f"{type(exc).__name__}: {exc}"
    return cell


def _compile_cells(cells: Sequence[tuple[Case, str]]) -> list[CellResult]:
    """`_compile_cell` of each (case, arch), in order (runs in a worker process); what one
    raises (a builder's bug, a tool's failure) is that cell's result, not its neighbours'."""
    out = []
    for case, arch in cells:
        try:
            out.append(_compile_cell(case, arch))
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - this cell's result
            out.append(_crashed(case, arch, exc))
    return out
