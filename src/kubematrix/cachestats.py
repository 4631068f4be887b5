"""The shared Triton compile cache, seen from the CI layer: the cells' environment and counters.

Every runner gives a cell :func:`cache_env`: Triton then loads
``kubematrix.compile_cache.LayeredCacheManager`` (Triton's ``TRITON_CACHE_MANAGER``), which keeps
the local folder (``TRITON_CACHE_DIR``, default ``~/.triton/cache``) in front of Redis when a
Redis address is given, and appends its counters to ``<stats dir>/<pid>.jsonl``.
:func:`read_stats` sums them into the cell's :class:`CacheStats`. Standard library only: the CI
layer never imports triton; only Triton imports the manager.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

MANAGER = "kubematrix.compile_cache:LayeredCacheManager"
BACKEND = "kubematrix.compile_cache:GuardedRedisBackend"
# The folder the manager appends its counters to, one JSONL file per process.
STATS_DIR_ENV = "KUBEMATRIX_CACHE_STATS"
# Seconds Redis may take to connect or answer before the process gives up on it.
TIMEOUT_ENV = "KUBEMATRIX_CACHE_TIMEOUT"
# ``host:port`` of the shared Redis for the runners (unset or empty: the local layer only).
REDIS_ENV = "KUBEMATRIX_TRITON_REDIS"
# In Kubernetes: the Service of the optional triton-cache component (k8s/cache).
K8S_REDIS_SERVICE, K8S_REDIS_PORT = "triton-cache", 6379


def k8s_redis(namespace: str) -> str:
    """The cache Service's address from any namespace: agent-stack-k8s runs the k8s lane's pods
    in its own, where the Service's short name would not resolve."""
    return f"{K8S_REDIS_SERVICE}.{namespace}.svc:{K8S_REDIS_PORT}"


def cache_env(stats_dir: str | os.PathLike[str] | None, redis: str | None = None) -> dict[str, str]:
    """The variables that put a cell's Triton compiles through the layered cache.

    ``redis`` is ``host:port`` (``None``: ``$KUBEMATRIX_TRITON_REDIS``; empty: no remote layer).
    """
    env = {"TRITON_CACHE_MANAGER": MANAGER}
    if stats_dir is not None:
        env[STATS_DIR_ENV] = str(stats_dir)
    redis = os.environ.get(REDIS_ENV, "") if redis is None else redis
    if redis.strip():
        host, port = redis_address(redis)
        env.update(
            TRITON_REMOTE_CACHE_BACKEND=BACKEND, TRITON_REDIS_HOST=host, TRITON_REDIS_PORT=port
        )
    return env


def redis_address(value: str) -> tuple[str, str]:
    """``host:port`` (``[v6 address]:port`` for IPv6) as the host and port a Redis client takes.

    Raises:
        ValueError: naming `REDIS_ENV` and the rule: a host name or address (no scheme such as
            ``redis://``, which the client would take as part of the host), a port in 1-65535.
    """
    host, _, port = value.strip().rpartition(":")
    v6 = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if v6 else host
    good_host = re.fullmatch(r"[0-9A-Fa-f:.]+" if v6 else r"[A-Za-z0-9_.-]+", host)
    if not good_host or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 2**16:
        raise ValueError(
            f"{REDIS_ENV} must be host:port ([address]:port for IPv6), a host name or address "
            f"(no scheme) and a port in 1-65535; got {value!r}"
        )
    return host, port


@dataclass(frozen=True)
class CacheStats:
    """One cell's Triton cache lookups and compile time, summed over its processes."""

    local: int = 0  # served from the local folder
    remote: int = 0  # fetched from Redis (and written to the local folder)
    compiled: int = 0  # not cached (or not verified): Triton compiled it
    compile_s: float = 0.0  # seconds from each miss to its result stored, summed over processes
    corrupt: int = 0  # damaged entries found (local files, Redis values failing their envelope),
    # each replaced by Redis's copy or a compile
    warnings: tuple[str, ...] = ()  # e.g. "redis": the remote layer was unreachable
    # compiles of a kernel (Triton cache key) the cell had compiled already, e.g. by workers that
    # missed the same key at once, each compiling it (included in ``compiled``)
    repeated: int = 0
    # misses whose compile stored nothing: it raised, or its process was stopped
    failed: int = 0

    @property
    def lookups(self) -> int:
        return self.local + self.remote + self.compiled + self.failed

    @property
    def hit_rate(self) -> float | None:
        """Hits over lookups; ``None`` when the cell compiled nothing (e.g. the interpreter)."""
        return (self.local + self.remote) / self.lookups if self.lookups else None

    def describe(self) -> str:
        """One line for a log, e.g. ``85% hits of 528 lookups (449 local, 0 remote, 79 compiled
        in 72.3 s)``, with the remote layer's warnings."""
        if not self.lookups:
            return "no compile recorded"
        line = (
            f"{self.hit_rate:.0%} hits of {self.lookups} lookups ({self.local} local, "
            f"{self.remote} remote, {self.compiled} compiled in {self.compile_s:.1f} s)"
        )
        if self.repeated:
            line += f"; {self.repeated} of them compiled a kernel again"
        if self.failed:
            line += f"; {self.failed} compiles failed or were stopped"
        if self.corrupt:
            line += f"; {self.corrupt} damaged entries replaced"
        if self.warnings:
            line += f"; unavailable: {', '.join(self.warnings)}"
        return line

    def to_dict(self) -> dict:
        return {
            "local": self.local,
            "remote": self.remote,
            "compiled": self.compiled,
            "compile_s": round(self.compile_s, 3),
            "corrupt": self.corrupt,
            "warnings": list(self.warnings),
            "repeated": self.repeated,
            "failed": self.failed,
        }

    @classmethod
    def from_dict(cls, d: dict) -> CacheStats:
        return cls(
            local=int(d.get("local", 0)),
            remote=int(d.get("remote", 0)),
            compiled=int(d.get("compiled", 0)),
            compile_s=float(d.get("compile_s", 0.0)),
            corrupt=int(d.get("corrupt", 0)),
            warnings=tuple(d.get("warnings", ())),
            repeated=int(d.get("repeated", 0)),
            failed=int(d.get("failed", 0)),
        )


def read_stats(stats_dir: str | os.PathLike[str]) -> CacheStats | None:
    """The counters under ``stats_dir`` summed; ``None`` when no process recorded any."""
    counts = {"local": 0, "remote": 0, "compiled": 0, "corrupt": 0, "missed": 0}
    compile_s = 0.0
    warned: set[str] = set()
    keys: list[str] = []  # the compiled kernels' cache keys, where recorded
    files = sorted(Path(stats_dir).glob("*.jsonl")) if Path(stats_dir).is_dir() else []
    if not files:
        return None
    for path in files:
        try:
            text = path.read_text(errors="replace")
        except OSError:  # a folder or an unreadable file: counters are a report, not a verdict
            warned.add(f"unreadable counters {path.name}")
            continue
        for line in text.splitlines():
            try:
                event = json.loads(line)
                name = str(event["event"])
                # a compile's seconds: a finite number >= 0 (else the line is not counted)
                seconds = float(event.get("compile_s") or 0.0) if name == "compiled" else 0.0
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a line cut short by a killed process, or not a counter
            if not math.isfinite(seconds) or seconds < 0:
                continue
            if name in counts:
                counts[name] += 1
            elif name.startswith("warning:"):
                warned.add(name.split(":", 1)[1])
            if name == "compiled":
                compile_s += seconds
                if isinstance(event.get("key"), str):
                    keys.append(event["key"])
    repeated = len(keys) - len(set(keys))
    # every compile follows a recorded miss: the misses beyond the compiles stored nothing
    failed = max(0, counts.pop("missed") - counts["compiled"])
    return CacheStats(
        compile_s=compile_s,
        warnings=tuple(sorted(warned)),
        repeated=repeated,
        failed=failed,
        **counts,
    )
