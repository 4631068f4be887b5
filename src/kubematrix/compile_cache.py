"""Triton's compile cache for the matrix's test processes: a local layer in front of Redis.

Triton loads this module itself, by name, when a cell's environment says so (see
:func:`kubematrix.cachestats.cache_env`)::

    TRITON_CACHE_MANAGER=kubematrix.compile_cache:LayeredCacheManager
    TRITON_REMOTE_CACHE_BACKEND=kubematrix.compile_cache:GuardedRedisBackend   # optional
    TRITON_REDIS_HOST=... TRITON_REDIS_PORT=...

Nothing else imports it (it imports triton; the CI layer never does). What it adds to Triton's
own :class:`~triton.runtime.cache.RemoteCacheManager`:

* A local hit (``TRITON_CACHE_DIR``) is served without asking Redis; a remote hit is written to
  the local folder, so a process fetches a kernel once. Without a remote backend configured it is
  Triton's :class:`~triton.runtime.cache.FileCacheManager` plus counters.
* Values in Redis carry an envelope: a magic tag and the SHA-256 of (Redis key, data). A value
  that does not verify (garbage, truncated, copied from another key) is a miss: Triton compiles,
  and the fresh result overwrites it. Keys are Triton's: ``TRITON_REDIS_KEY_FORMAT`` over the
  hash of Triton's cache key (Triton's own hash, source, target, backend options, env).
* Redis down or slow: short socket timeouts, one warning, and the process carries on with the
  local layer only. A cell never fails because of the cache.
* Counters (lookups served locally, from Redis, or compiled, and the seconds spent compiling)
  go to ``$KUBEMATRIX_CACHE_STATS/<pid>.jsonl`` when that folder is set; the runners sum them.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
import warnings
from typing import Any

from triton import knobs
from triton.runtime.cache import FileCacheManager, RedisRemoteCacheBackend, RemoteCacheManager

from kubematrix.cachestats import STATS_DIR_ENV, TIMEOUT_ENV

_MAGIC = b"portattn-triton-cache/1\n"
_DIGEST = hashlib.sha256().digest_size
_GRP = "__grp__"
DEFAULT_TIMEOUT_S = 0.5


def seal(redis_key: str, data: bytes) -> bytes:
    """``data`` in its envelope: magic, SHA-256 of (key, data), data."""
    digest = hashlib.sha256(redis_key.encode() + b"\0" + data).digest()
    return _MAGIC + digest + data


def unseal(redis_key: str, value: bytes) -> bytes | None:
    """The data in ``value`` if its envelope verifies for ``redis_key``, else ``None``."""
    if not value.startswith(_MAGIC) or len(value) < len(_MAGIC) + _DIGEST:
        return None
    digest = value[len(_MAGIC) : len(_MAGIC) + _DIGEST]
    data = value[len(_MAGIC) + _DIGEST :]
    if hashlib.sha256(redis_key.encode() + b"\0" + data).digest() != digest:
        return None
    return data


class _Stats:
    """This process's counters, appended one event per line to its own JSONL file."""

    _lock = threading.Lock()
    _warned: set[str] = set()

    @classmethod
    def record(cls, event: str, compile_s: float = 0.0, key: str | None = None) -> None:
        """Append one event; ``key``: the kernel's Triton cache key (for compiles, so that a
        cell can count the kernels its processes compiled more than once)."""
        folder = os.environ.get(STATS_DIR_ENV)
        if not folder:
            return
        event_d: dict[str, Any] = {"event": event, "compile_s": round(compile_s, 6)}
        if key is not None:
            event_d["key"] = key
        line = json.dumps(event_d) + "\n"
        try:
            os.makedirs(folder, exist_ok=True)
            with cls._lock, open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as f:
                f.write(line)
        except OSError:  # counters are a report, never a reason to fail a compile
            pass

    @classmethod
    def warn_once(cls, what: str, message: str) -> None:
        with cls._lock:
            if what in cls._warned:
                return
            cls._warned.add(what)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        cls.record(f"warning:{what}")


def _timeout() -> float:
    """``$KUBEMATRIX_CACHE_TIMEOUT`` seconds, else `DEFAULT_TIMEOUT_S`; a value that is no
    positive number warns, naming the variable, and the default serves (never a failed cell)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        _Stats.warn_once(
            "timeout",
            f"{TIMEOUT_ENV} must be a number of seconds > 0; got {raw!r}: using "
            f"{DEFAULT_TIMEOUT_S} s",
        )
        return DEFAULT_TIMEOUT_S
    return value


_CLIENTS: dict[tuple[str, int, float], Any] = {}
_ADDRESSES: dict[tuple[str, int], str] = {}


def _resolve(host: str, port: int, timeout: float) -> str:
    """``host``'s address, looked up once a process within ``timeout`` seconds (the socket
    timeouts do not bound a name lookup: a silent resolver would hold every compile)."""
    if (host, port) in _ADDRESSES:
        return _ADDRESSES[(host, port)]
    found: list[str] = []
    failed: list[BaseException] = []

    def look_up() -> None:
        try:
            found.append(str(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]))
        except OSError as err:
            failed.append(err)

    worker = threading.Thread(target=look_up, daemon=True)  # left behind if the lookup hangs
    worker.start()
    worker.join(timeout)
    if failed:
        raise failed[0]
    if not found:
        raise TimeoutError(f"looking up {host} took more than {timeout} s")
    _ADDRESSES[(host, port)] = found[0]
    return found[0]


def _client(host: str, port: int, timeout: float) -> Any:
    """This process's Redis client for an address (one connection pool for every kernel's
    backend), without retries: the first error turns the remote layer off."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    key = (host, port, timeout)
    if key not in _CLIENTS:
        _CLIENTS[key] = redis.Redis(
            host=_resolve(host, port, timeout),
            port=port,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
        )
    return _CLIENTS[key]


class GuardedRedisBackend(RedisRemoteCacheBackend):
    """Triton's Redis backend with short timeouts, sealed values, and no error ever raised.

    Its settings are Triton's ``knobs.redis`` (``TRITON_REDIS_HOST``, ``_PORT``, ``_KEY_FORMAT``);
    Triton 3.6's own backend reads them from ``knobs.cache.redis``, which does not exist.

    The first Redis error (name lookup, refused, timed out, reset, a reply that is not Redis's)
    warns once and turns this process's remote layer off: one slow server costs one timeout, not
    one per kernel. A write that the server refuses (a Redis that cannot save its snapshot, a
    read-only replica, out of memory) turns writes off and keeps reading.
    """

    _down = False  # per process: once Redis failed, stop asking
    _no_writes = False  # per process: once Redis refused a write, stop writing

    def __init__(self, key: str) -> None:
        import redis

        self._key = key
        self._key_fmt = knobs.redis.key_format
        self._refused = redis.ResponseError  # the server's answer to a write it will not take
        self.rejected = 0  # values of the last `get` that failed their envelope
        if type(self)._down:
            return
        try:
            self._redis = _client(knobs.redis.host, int(knobs.redis.port), _timeout())
        except Exception as err:  # noqa: BLE001 - a remote layer never fails a compile
            self._fail(err)

    def _fail(self, err: BaseException) -> None:
        type(self)._down = True
        where = f"{knobs.redis.host}:{knobs.redis.port}"
        _Stats.warn_once(
            "redis",
            f"Triton remote cache at {where} unavailable ({type(err).__name__}: {err}); "
            "compiling locally for the rest of this process",
        )

    def get(self, filenames: list[str]) -> dict[str, bytes]:  # type: ignore[override]
        self.rejected = 0
        if type(self)._down or not filenames:
            return {}
        keys = [self._get_key(f) for f in filenames]
        try:
            values = self._redis.mget(keys)
            triples = list(zip(filenames, keys, values, strict=True))
        except Exception as err:  # noqa: BLE001 - any failure (a reply that is not Redis's too)
            self._fail(err)
            return {}
        found: dict[str, bytes] = {}
        for filename, key, value in triples:
            if not isinstance(value, bytes):  # None: not cached
                continue
            data = unseal(key, value)
            if data is None:
                self.rejected += 1
                continue
            found[filename] = data
        return found

    def put(self, filename: str, data: bytes) -> None:  # type: ignore[override]
        if type(self)._down or type(self)._no_writes:
            return
        key = self._get_key(filename)
        try:
            self._redis.set(key, seal(key, data))
        except self._refused as err:
            type(self)._no_writes = True
            _Stats.warn_once(
                "redis-writes",
                f"Triton remote cache at {knobs.redis.host}:{knobs.redis.port} refuses writes "
                f"({err}); reading it, writing nothing more from this process",
            )
        except Exception as err:  # noqa: BLE001 - a remote layer never fails a compile
            self._fail(err)


#: Compiled binaries, which are ELF objects (NVIDIA cubin, AMD hsaco).
_ELF_SUFFIXES = (".cubin", ".hsaco")


def _elf_whole(head: bytes, size: int) -> bool:
    """Whether an ELF file of ``size`` bytes starting with ``head`` (its first 64) holds the
    program and section header tables its header places (a file cut short does not)."""
    if len(head) < 64 or head[:4] != b"\x7fELF":
        return False
    if head[4] != 2:  # not ELF64 (cubin and hsaco are): the magic is all there is to check
        return True
    big = head[5] == 2  # EI_DATA: 1 little-endian, 2 big-endian

    def field(at: int, width: int) -> int:
        return int.from_bytes(head[at : at + width], "big" if big else "little")

    tables = ((field(0x20, 8), field(0x36, 2), field(0x38, 2)),  # program headers
              (field(0x28, 8), field(0x3A, 2), field(0x3C, 2)))  # section headers  # fmt: skip
    return all(offset + entry * count <= size for offset, entry, count in tables)


def _whole(name: str, path: str) -> bool:
    """Whether a local cache file looks whole: not empty, its JSON parses, its binary is an ELF
    file as long as its header says (Triton reads these without a check of its own: a damaged
    one failed the compile, or the kernel's load)."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            return False
        if name.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                json.load(f)
        elif name.endswith(_ELF_SUFFIXES):
            with open(path, "rb") as f:
                return _elf_whole(f.read(64), size)
    except (OSError, ValueError):
        return False
    return True


class LayeredCacheManager(RemoteCacheManager):
    """The local folder first, then the remote backend (if one is configured), then a compile."""

    def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
        self._override = override
        self._dump = dump
        self._file_cache_manager = FileCacheManager(key, override=override, dump=dump)
        backend_cls = knobs.cache.remote_manager_class
        self._backend: Any = None
        if backend_cls is not None and knobs.compilation.override:
            # hand-edited kernels are stored under their normal keys: never share them
            _Stats.warn_once(
                "override", "TRITON_KERNEL_OVERRIDE is set: this process's compiles stay local"
            )
        elif backend_cls is not None and not (override or dump):
            try:
                self._backend = backend_cls(key)
            except Exception as err:  # e.g. the redis client missing from this environment
                _Stats.warn_once(
                    "backend", f"Triton remote cache backend unusable ({err}); local cache only"
                )
        self._missed: dict[str, float] = {}

    @property
    def _local(self) -> FileCacheManager:
        return self._file_cache_manager

    def get_file(self, filename: str) -> str | None:
        if (path := self._local.get_file(filename)) is not None or self._backend is None:
            return path
        data = self._backend.get([filename]).get(filename)
        return None if data is None else self._materialize(filename, data)

    def put(self, data: Any, filename: str, binary: bool = True) -> str:
        if self._backend is None or self._dump or self._override:
            return self._local.put(data, filename, binary=binary)
        if not isinstance(data, bytes):
            data = str(data).encode("utf-8")
        self._backend.put(filename, data)
        return self._materialize(filename, data)

    def _local_group(self, filename: str) -> dict[str, str] | None:
        """The local group if every file it names is still there and whole (else a miss)."""
        path = self._local.get_file(_GRP + filename)
        if path is None:
            return None
        try:
            with open(path) as f:
                children = json.load(f).get("child_paths")
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(children, dict) or filename not in children:
            return None
        if not all(isinstance(p, str) and os.path.exists(p) for p in children.values()):
            return None
        if not all(_whole(name, path) for name, path in children.items()):
            # (e.g. a cache folder restored in part): recompiled and written over, not served
            _Stats.record("corrupt")
            return None
        return children

    def _remote_group(self, filename: str) -> dict[str, str] | None:
        """The group from the backend, every file verified and written to the local folder."""
        if self._backend is None:
            return None
        found = self._backend.get([_GRP + filename]).get(_GRP + filename)
        if found is None:
            if getattr(self._backend, "rejected", 0):
                _Stats.record("corrupt")
            return None
        try:
            names = json.loads(found).get("child_paths")
        except (ValueError, AttributeError):
            names = None
        if not isinstance(names, list) or filename not in names:
            return None
        files = self._backend.get(names)
        if set(files) != set(names):  # a file missing or failing its envelope: compile anew
            if getattr(self._backend, "rejected", 0):
                _Stats.record("corrupt")  # one damaged entry, however many of its files
            return None
        group = {name: self._materialize(name, data) for name, data in files.items()}
        self._local.put_group(filename, group)
        return group

    def get_group(self, filename: str) -> dict[str, str] | None:
        if self._dump or self._override:
            return self._local.get_group(filename)
        if not knobs.compilation.always_compile:  # else Triton compiles whatever it finds
            if (group := self._local_group(filename)) is not None:
                _Stats.record("local")
                return group
            if (group := self._remote_group(filename)) is not None:
                _Stats.record("remote")
                return group
        # Triton compiles, then calls put_group; a compile that raises records no more
        _Stats.record("missed")
        self._missed[filename] = time.monotonic()
        return None

    def put_group(self, filename: str, group: dict[str, str]) -> str:
        if self._dump or self._override:
            return self._local.put_group(filename, group)
        started = self._missed.pop(filename, None)
        if self._backend is not None:
            names = json.dumps({"child_paths": sorted(group)})
            self._backend.put(_GRP + filename, names.encode())
        path = self._local.put_group(filename, group)
        elapsed = 0.0 if started is None else time.monotonic() - started
        _Stats.record("compiled", elapsed, key=self._local.key)
        return path
