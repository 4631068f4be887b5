"""Helpers the bench scripts share: copy ceiling, bf16 matmul rate, HIP policies on a CUDA GPU,
the JSON record of a run, the SM clock and power sampled during a timing.

Imported by ``bench/bench_*.py`` (run as ``python3 bench/<script>.py``, so this folder is on
``sys.path``). Nothing here runs at import.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch
import triton
from triton.testing import do_bench

from portattn import platform
from portattn.kernels._launch import Launch
from portattn.kernels._plans import PLANS


def _git(*args: str, cwd: str | None = None, env: dict | None = None) -> str:
    return subprocess.run(
        ["git", *args], capture_output=True, text=True, check=True, cwd=cwd, env=env
    ).stdout.strip()


def git_commit(cwd: str | None = None) -> str:
    """The commit a record's figures came from: ``HEAD``'s short hash when the working tree is
    that commit's, else ``HEAD+tree:<hash>``, the git tree hash of the working tree as it ran
    (tracked and new files, .gitignore respected). It is built in a scratch index: the
    repository's own index and refs are left as they were (the files' blobs are written as
    loose objects). A working tree copied onto a GPU machine over a stale ``.git`` (as the
    device tool does) thus still names what ran: the commit whose ``%T`` is that hash
    (``git log --all --format='%h %T' | grep <hash>``)."""
    try:
        head = _git("rev-parse", "--short", "HEAD", cwd=cwd)
        if not _git("status", "--porcelain", cwd=cwd):
            return head
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, GIT_INDEX_FILE=os.path.join(tmp, "index"))
            _git("read-tree", "HEAD", cwd=cwd, env=env)
            _git("add", "-A", cwd=cwd, env=env)
            tree = _git("write-tree", cwd=cwd, env=env)
        return f"{head}+tree:{tree[:12]}"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_switch(module, item: str, flag: str = "--set") -> tuple[str, bool]:
    """``NAME=0`` / ``NAME=1`` (a bench's ``flag`` argument) -> ``(NAME, on)``, ``NAME`` a boolean
    switch of the policy ``module``.

    Raises:
        SystemExit: ``item`` is not ``NAME=0|1`` or ``NAME`` is not a boolean switch of ``module``.
    """
    name, sep, value = item.partition("=")
    if not sep or value not in ("0", "1"):
        sys.exit(f"{flag} must be SWITCH=0 or SWITCH=1; got {item!r}")
    if not isinstance(getattr(module, name, None), bool):
        sys.exit(f"{flag} {name}: not a boolean switch of {module.__name__}")
    return name, value == "1"


def set_switch(module, item: str) -> None:
    """Set a boolean policy switch from ``NAME=0`` / ``NAME=1`` (a bench's ``--set``,
    `parse_switch`), for an A/B in one run; the plan cache is emptied (switches are read at
    planning, not in a plan's key)."""
    name, on = parse_switch(module, item)
    setattr(module, name, on)
    PLANS.clear()


@contextlib.contextmanager
def switched(module, switches: dict):
    """The policy ``module``'s ``switches`` (name -> value) set for a block, then restored; the
    plan cache emptied on entry and exit (switches are read at planning, not in a plan's key)."""
    saved = {k: getattr(module, k) for k in switches}
    for k, v in switches.items():
        setattr(module, k, v)
    PLANS.clear()
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)
        PLANS.clear()


def turn_order(n: int, rnd: int) -> list[int]:
    """The order in which ``n`` calls timed in turns go in round ``rnd``: rotated by one each
    round (0 1 2, 1 2 0, 2 0 1, ...), so no call always runs first or last in a round. With a
    fixed order a call timed third ran 1.3-3.9% slower than the same launch timed first
    (bench/RESULTS.md, seventeenth session, calls 2-3)."""
    return [(i + rnd) % n for i in range(n)]


def save_record(name: str, **fields) -> str | None:
    """Write ``$OUT/<name>.json``: ``fields`` plus the device, commit, date, torch and Triton
    versions and the command line (fields win on a clash). Nothing without ``$OUT``; returns
    the path written."""
    out_dir = os.environ.get("OUT")
    if not out_dir:
        return None
    meta = dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        commit=git_commit(),
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        triton=triton.__version__,
        command=" ".join(sys.argv),
    )
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump({**meta, **fields}, f, indent=1)
    return path


def copy_ceiling(nbytes: int) -> tuple[float, float]:
    """Device-to-device copy of ``nbytes // 2`` bytes: (bytes read + written) / median, GB/s.

    ``nbytes`` is the traffic (read + written) of the operation it is compared with, so the copy
    moves the same number of bytes. Returns ``(GB/s, ms)``.
    """
    n = max(2, nbytes // 2)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * n / (ms * 1e-3) / 1e9, ms


def matmul_rate(n: int = 8192) -> tuple[float, float]:
    """bf16 ``torch.mm`` of two ``n x n`` matrices: (TFLOP/s, ms), do_bench median."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: torch.mm(a, b, out=c), return_mode="median")
    return 2 * n**3 / (ms * 1e-3) / 1e12, ms


def roofline_s(row: dict, copy_gbs: float, mm_tflops: float) -> float:
    """A row's roofline in seconds (its ``roof_bytes`` and ``roof_flops``) at these ceilings."""
    return max(row["roof_bytes"] / (copy_gbs * 1e9), row["roof_flops"] / (mm_tflops * 1e12))


def at_point_ceiling(rows: list[dict], copy_gbs: float, mm_run: float, mm_point: float) -> None:
    """Give each row (its ``x_roofline`` taken at the run's matmul rate ``mm_run``; its
    ``roof_bytes`` and ``roof_flops``) its ratio at ``mm_point`` too, the rate measured just
    before its point was timed (``x_roofline_point``, ``mm_point``). The run's one rate is taken
    at its start, on a card not yet warm from the timings that follow (bench/NOTES.md, seventh
    session, "Method")."""
    for row in rows:
        run, here = roofline_s(row, copy_gbs, mm_run), roofline_s(row, copy_gbs, mm_point)
        row["mm_point"] = mm_point
        row["x_roofline_point"] = row["x_roofline"] * run / here


def plan_with_target(arch: str, plan, *args, **kwargs) -> list[Launch]:
    """Plan under a forced target's policy (e.g. ``gfx942``), runnable on the live CUDA device.

    Only the planning happens under `platform.set_target_override`, so the tiles are that
    target's; `Launch.run` itself leaves out the launch options the live backend does not accept
    (``waves_per_eu`` on CUDA; `LaunchOptions.backend_kwargs`).
    """
    platform.set_target_override(arch)
    try:
        return plan(*args, **kwargs)
    finally:
        platform.set_target_override(None)


def nvml_reader(index: int = 0):
    """A function returning the card's ``(SM MHz, W)`` now, through NVML (the driver's
    ``libnvidia-ml.so.1``, by ctypes: no Python package needed). Raises OSError where NVML is
    missing, RuntimeError on an NVML error (its code named)."""
    import ctypes

    lib = ctypes.CDLL("libnvidia-ml.so.1")

    def ok(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"nvml_reader: {what} returned NVML error {rc}")

    ok(lib.nvmlInit_v2(), "nvmlInit_v2")
    handle = ctypes.c_void_p()
    ok(lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)), "GetHandleByIndex")
    mhz, mw = ctypes.c_uint(), ctypes.c_uint()

    def read() -> tuple[float, float]:
        ok(lib.nvmlDeviceGetClockInfo(handle, 1, ctypes.byref(mhz)), "GetClockInfo(SM)")
        ok(lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(mw)), "GetPowerUsage")
        return float(mhz.value), mw.value / 1000.0

    return read


class ClockSampler:
    """Samples ``read()`` (say `nvml_reader`: the SM clock and power) every ``ms`` ms on a
    background thread while the ``with`` block runs; after it, ``samples`` holds the values,
    less ``trim`` at each end (the thread's start and stop fall outside the work). An exception
    in ``read`` is raised again on leaving the block: no run reports a clock it did not read."""

    def __init__(self, read, ms: float = 20.0, trim: int = 2):
        if ms <= 0 or trim < 0:
            raise ValueError(f"ClockSampler: ms must be > 0 and trim >= 0; got {ms}, {trim}")
        self.read, self.ms, self.trim = read, ms, trim
        self.samples: list = []
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._got.append(self.read())
                time.sleep(self.ms / 1e3)
        except BaseException as e:  # noqa: BLE001 (raised again in __exit__)
            self._error = e

    def __enter__(self) -> ClockSampler:
        self._got: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"ClockSampler: read failed: {self._error}") from self._error
        self.samples = self._got[self.trim : len(self._got) - self.trim]
