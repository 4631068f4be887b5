"""The shared Triton compile cache: real Triton compiles (sm_90, no GPU) against a real Redis.

Redis: ``$PORTATTN_TEST_REDIS`` (``host:port``, which .ci/run starts), else a private
``redis-server`` from PATH. Without either the Redis tests skip with the reason, but under
``CI=true`` they fail: CI must run them. Each test keeps its keys apart with its own
``TRITON_REDIS_KEY_FORMAT`` prefix, so tests share one server safely.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from kubematrix.cachestats import (
    BACKEND,
    MANAGER,
    STATS_DIR_ENV,
    TIMEOUT_ENV,
    CacheStats,
    cache_env,
    read_stats,
)

pytestmark = pytest.mark.ci

PROBE = Path(__file__).with_name("cache_probe.py")
SHARED_ENV = "PORTATTN_TEST_REDIS"
WARNING = "Triton remote cache at"


def _redis_missing(why: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true, and {why}; .ci/run installs and starts redis-server")
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Redis:
    host: str
    port: int
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def client(self):
        import redis

        return redis.Redis(host=self.host, port=self.port, socket_timeout=5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def _start_private(tmp_path: Path) -> Redis:
    binary = shutil.which("redis-server")
    if binary is None:
        _redis_missing(f"no redis-server on PATH and ${SHARED_ENV} unset")
    port = _free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", tmp_path]
    proc = subprocess.Popen([str(a) for a in args], stdout=subprocess.DEVNULL)
    server = Redis("127.0.0.1", port, proc)
    deadline = time.monotonic() + 10
    while True:
        try:
            server.client().ping()
            return server
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                server.stop()
                raise
            time.sleep(0.05)


@pytest.fixture
def private_redis(tmp_path):
    """A redis-server of this test's own (one it may stop)."""
    server = _start_private(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def redis_server(tmp_path):
    """The shared test Redis (.ci/run's) if there is one, else a private one."""
    shared = os.environ.get(SHARED_ENV, "").strip()
    if not shared:
        server = _start_private(tmp_path)
        yield server
        server.stop()
        return
    host, _, port = shared.rpartition(":")
    server = Redis(host, int(port))
    try:
        server.client().ping()
    except Exception as err:
        _redis_missing(f"${SHARED_ENV}={shared} does not answer ({err})")
    yield server


class Probe:
    """Runs tests/ci/cache_probe.py in fresh processes against one Redis and one key prefix."""

    def __init__(self, tmp_path: Path, redis: str) -> None:
        self.tmp, self.redis, self.runs = tmp_path, redis, 0
        self.prefix = f"test-{uuid.uuid4().hex[:12]}"

    def env(self, local: str, stats: Path, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(cache_env(stats, redis=self.redis))
        env["TRITON_CACHE_DIR"] = str(self.tmp / local)
        env["TRITON_HOME"] = str(self.tmp / "home")
        env["TRITON_REDIS_KEY_FORMAT"] = self.prefix + ":{key}:{filename}"
        return {**env, **extra}

    def start(self, *blocks: int, local: str, pause_after: int | None = None, **extra: str):
        self.runs += 1
        stats = self.tmp / f"stats{self.runs}"
        args = [sys.executable, str(PROBE), *map(str, blocks)]
        if pause_after is not None:
            args += ["--pause-after", str(pause_after)]
        proc = subprocess.Popen(
            args,
            env=self.env(local, stats, **extra),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        return proc, stats

    @staticmethod
    def finish(proc, stats, stdin: str = ""):
        out, err = proc.communicate(stdin, timeout=240)
        assert proc.returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1]), read_stats(stats), err

    def run(self, *blocks: int, local: str, **extra: str):
        return self.finish(*self.start(*blocks, local=local, **extra))


def test_a_fresh_process_with_an_empty_local_folder_compiles_nothing_that_redis_holds(
    tmp_path, redis_server
):
    probe = Probe(tmp_path, redis_server.address)
    seen, stats, _ = probe.run(64, 128, local="a")
    assert seen["compiled"] == 2 and stats.compiled == 2 and stats.remote == 0
    assert stats.compile_s > 0
    assert redis_server.client().keys(probe.prefix + ":*")  # the first process filled Redis

    again, stats, err = probe.run(64, 128, local="b")  # another pod: empty local folder
    assert again["compiled"] == 0 and again["hits"] == 2  # Triton's own count
    assert (stats.remote, stats.compiled, stats.hit_rate) == (2, 0, 1.0)
    assert again["cubin_bytes"] == seen["cubin_bytes"]
    assert WARNING not in err


def test_a_local_hit_is_served_without_asking_redis(tmp_path, redis_server):
    probe = Probe(tmp_path, redis_server.address)
    probe.run(64, local="a")
    # The same local folder, pointed at a port where nothing listens: a local hit never calls.
    dead = Probe(tmp_path, f"127.0.0.1:{_free_port()}")
    dead.prefix = probe.prefix
    seen, stats, err = dead.run(64, local="a")
    assert (seen["compiled"], stats.local, stats.warnings) == (0, 1, ())
    assert WARNING not in err


@pytest.mark.parametrize(
    "damage", ["json cut short", "cubin garbage", "cubin empty", "cubin cut after its header"]
)
def test_a_damaged_local_entry_is_recompiled_and_replaced(damage, tmp_path):
    """A local folder restored in part (e.g. by a CI cache plugin): a metadata JSON cut short
    failed the compile in Triton's json.loads, and a garbage cubin was served as a hit."""
    probe = Probe(tmp_path, "")  # the local layer alone
    seen, _, _ = probe.run(64, local="a")
    assert seen["compiled"] == 1
    suffix, data = {"json cut short": (".json", b'{"trunc'), "cubin garbage": (".cubin", b"\x07"),
                    "cubin empty": (".cubin", b""),
                    "cubin cut after its header": (".cubin", None)}[damage]  # fmt: skip
    (entry,) = [p for p in (tmp_path / "a").rglob(f"*{suffix}") if not p.name.startswith("__grp")]
    # cut after its header: what a copy stopped part-way leaves (the ELF magic is there)
    entry.write_bytes(entry.read_bytes()[:200] if data is None else data)
    again, stats, _ = probe.run(64, local="a")
    assert (again["compiled"], stats.corrupt, stats.local) == (1, 1, 0)
    assert again["cubin_bytes"] == seen["cubin_bytes"]
    third, stats, _ = probe.run(64, local="a")  # written over: a whole local hit again
    assert (third["compiled"], stats.local, stats.corrupt) == (0, 1, 0)


def test_redis_stopped_mid_run_the_run_finishes_compiling_locally_with_one_warning(
    tmp_path, private_redis
):
    probe = Probe(tmp_path, private_redis.address)
    proc, stats_dir = probe.start(64, 128, 256, local="a", pause_after=1)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "paused"
    private_redis.stop()
    seen, stats, err = probe.finish(proc, stats_dir, stdin="go\n")
    assert seen["compiled"] == 3 and len(seen["cubin_bytes"]) == 3
    assert stats.warnings == ("redis",)
    assert err.count(WARNING) == 1, err


def test_a_redis_that_never_answers_costs_one_short_timeout_and_a_warning(tmp_path):
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        probe = Probe(tmp_path, f"127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        seen, stats, err = probe.run(64, 128, local="a", **{TIMEOUT_ENV: "0.3"})
    assert seen["compiled"] == 2 and stats.warnings == ("redis",)
    assert err.count(WARNING) == 1 and "Timeout" in err
    assert time.monotonic() - started < 60


def _silent_server(reply: bytes | None):
    """A loopback server counting its connections; it answers every read with ``reply`` (a
    reply that is not Redis's) or, with ``None``, never."""
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.05)
    conns: list[socket.socket] = []
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            with contextlib.suppress(OSError):  # the accept timeout
                conns.append(server.accept()[0])
            for conn in conns:
                conn.settimeout(0.01)
                try:
                    if conn.recv(65536) and reply is not None:
                        conn.sendall(reply)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def stop() -> None:
        done.set()
        thread.join()
        for conn in conns:
            conn.close()
        server.close()

    return server.getsockname()[1], conns, stop


@pytest.mark.parametrize("reply", [None, b"+OK\r\n", b"*2\r\n"], ids=["silent", "+OK", "*2"])
def test_a_server_that_is_not_redis_costs_one_connection_and_a_warning(reply, tmp_path):
    """redis-py retried a silent server ten times, with backoff, for every kernel's own client
    (10 s and more a process); a reply that is not Redis's raised out of the compile."""
    port, conns, stop = _silent_server(reply)
    try:
        probe = Probe(tmp_path, f"127.0.0.1:{port}")
        seen, stats, err = probe.run(64, 128, 256, local="a", **{TIMEOUT_ENV: "0.3"})
    finally:
        stop()
    assert seen["compiled"] == 3 and stats.warnings == ("redis",)
    assert err.count(WARNING) == 1
    assert len(conns) == 1  # one client a process, no retries


def test_a_name_that_does_not_resolve_in_time_turns_the_layer_off(monkeypatch):
    """The socket timeouts do not bound a name lookup: a silent resolver held every compile."""
    import time as clock

    from kubematrix import compile_cache

    monkeypatch.setattr(compile_cache, "_ADDRESSES", {})

    def silent_resolver(*_, **__):  # answers, but only after the budget
        clock.sleep(5)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 6379))]

    monkeypatch.setattr(compile_cache.socket, "getaddrinfo", silent_resolver)
    started = clock.monotonic()
    with pytest.raises(TimeoutError, match="looking up triton-cache took more than 0.2 s"):
        compile_cache._resolve("triton-cache", 6379, 0.2)
    assert clock.monotonic() - started < 4  # the lookup is left behind, not waited for


def test_a_redis_that_refuses_writes_is_still_read(tmp_path, private_redis):
    """A Redis that cannot save its snapshot (or a read-only replica) refuses writes: one
    refused write turned reads off too, so every later kernel compiled."""
    probe = Probe(tmp_path, private_redis.address)
    probe.run(64, local="a")  # Redis holds the 64 kernel
    private_redis.client().config_set("min-replicas-to-write", 1)  # writes refused: NOREPLICAS
    seen, stats, err = probe.run(128, 64, local="b")
    assert seen["compiled"] == 1 and (stats.compiled, stats.remote) == (1, 1)
    assert stats.warnings == ("redis-writes",) and "refuses writes" in err
    assert "unavailable" not in err  # the layer itself stayed on


def test_an_overriding_process_shares_nothing(tmp_path, redis_server):
    """TRITON_KERNEL_OVERRIDE stores hand-edited kernels under their normal keys: such a
    process neither writes nor reads the remote layer."""
    probe = Probe(tmp_path, redis_server.address)
    override = {"TRITON_KERNEL_OVERRIDE": "1", "TRITON_OVERRIDE_DIR": str(tmp_path / "edits")}
    seen, stats, err = probe.run(64, local="a", **override)
    assert seen["compiled"] == 1 and stats.warnings == ("override",)
    assert not redis_server.client().keys(probe.prefix + ":*")


@pytest.mark.parametrize("value", ("soon", "0", "-1", "nan", "inf"))
def test_a_bad_cache_timeout_warns_by_name_and_the_default_serves(value, monkeypatch, tmp_path):
    """A typo in the variable must not turn the shared cache off (it did: the backend failed to
    build and the process compiled everything locally) nor fail the cell."""
    from kubematrix import compile_cache

    monkeypatch.setenv(TIMEOUT_ENV, value)
    monkeypatch.setenv(STATS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(compile_cache._Stats, "_warned", set())
    with pytest.warns(RuntimeWarning, match=f"{TIMEOUT_ENV} must be a number of seconds > 0"):
        assert compile_cache._timeout() == compile_cache.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert compile_cache._timeout() == 2.5


def test_a_garbage_value_under_a_real_key_is_recompiled_and_replaced(tmp_path, redis_server):
    probe = Probe(tmp_path, redis_server.address)
    probe.run(64, local="a")
    client = redis_server.client()
    (cubin_key,) = client.keys(probe.prefix + ":*:add.cubin")
    client.set(cubin_key, b"garbage, not a cubin")

    seen, stats, _ = probe.run(64, local="b")
    assert seen["compiled"] == 1 and stats.corrupt == 1 and stats.remote == 0
    assert client.get(cubin_key) != b"garbage, not a cubin"  # the recompile replaced it

    for key in client.keys(probe.prefix + ":*"):  # every file of the entry: still one entry
        if b"__grp__" not in key:
            client.set(key, b"garbage")
    seen, stats, _ = probe.run(64, local="d")
    assert seen["compiled"] == 1 and stats.corrupt == 1

    seen, stats, _ = probe.run(64, local="c")
    assert seen["compiled"] == 0 and stats.remote == 1


def test_a_value_sealed_under_another_key_or_cut_short_does_not_verify():
    from kubematrix.compile_cache import seal, unseal

    value = seal("triton:A:add.cubin", b"\x7fELF...")
    assert unseal("triton:A:add.cubin", value) == b"\x7fELF..."
    assert unseal("triton:B:add.cubin", value) is None  # foreign: another kernel's entry
    assert unseal("triton:A:add.cubin", value[:-1]) is None
    assert unseal("triton:A:add.cubin", b"\x7fELF...") is None  # no envelope (Triton's own)


def test_the_cells_environment_names_the_manager_and_redis_only_when_given(monkeypatch):
    monkeypatch.delenv("KUBEMATRIX_TRITON_REDIS", raising=False)
    assert cache_env("/s") == {"TRITON_CACHE_MANAGER": MANAGER, STATS_DIR_ENV: "/s"}
    env = cache_env(None, redis="triton-cache:6379")
    assert env["TRITON_REMOTE_CACHE_BACKEND"] == BACKEND
    assert (env["TRITON_REDIS_HOST"], env["TRITON_REDIS_PORT"]) == ("triton-cache", "6379")
    monkeypatch.setenv("KUBEMATRIX_TRITON_REDIS", "10.0.0.5:6390")
    assert cache_env(None)["TRITON_REDIS_HOST"] == "10.0.0.5"
    with pytest.raises(ValueError, match="host:port"):
        cache_env(None, redis="no-port")
    # a port past 65535, a host with a space, no host: the variable and the rule named
    # and a URL (its scheme went into the host: the remote layer never connected) and a port of
    # non-ASCII digits (int() refused it unnamed)
    for bad in ("host:99999", "host:0", "a b:1", ":6379", "[]:1", "redis://127.0.0.1:6391",
                "h:\u00b2", "h:\u0661\u0662", "[fe80::1%eth0]:1", "host/x:1"):  # fmt: skip
        with pytest.raises(ValueError, match="KUBEMATRIX_TRITON_REDIS must be host:port"):
            cache_env(None, redis=bad)
    env = cache_env(None, redis="[::1]:6379")  # IPv6: the client takes the bare address
    assert (env["TRITON_REDIS_HOST"], env["TRITON_REDIS_PORT"]) == ("::1", "6379")


def test_a_bad_counter_line_or_file_is_skipped_not_fatal(tmp_path):
    """A compile time that is not a finite number >= 0, a line that is not an object, and a
    counters 'file' that is a folder: skipped (the folder named in the warnings), the rest
    counted; `report` used to stop on them and summarize no cell."""
    (tmp_path / "1.jsonl").write_text(
        '{"event": "compiled", "compile_s": 2}\n{"event": "compiled", "compile_s": "abc"}\n'
        '{"event": "compiled", "compile_s": [1]}\n{"event": "compiled", "compile_s": 1e999}\n'
        '{"event": "compiled", "compile_s": -50}\n{"event": "compiled", "compile_s": NaN}\n'
        '[1, 2]\n"text"\n{"event": "local"}\n'
    )
    (tmp_path / "d.jsonl").mkdir()
    stats = read_stats(tmp_path)
    assert stats is not None
    assert (stats.compiled, stats.local, stats.compile_s) == (1, 1, 2.0)
    assert stats.warnings == ("unreadable counters d.jsonl",)


def test_counters_sum_over_processes_and_skip_a_line_cut_short(tmp_path):
    (tmp_path / "1.jsonl").write_text(
        '{"event": "compiled", "compile_s": 1.5}\n{"event": "local", "compile_s": 0}\n'
    )
    (tmp_path / "2.jsonl").write_text(
        '{"event": "remote", "compile_s": 0}\n{"event": "warning:redis", "compile_s": 0}\n{"ev'
    )
    stats = read_stats(tmp_path)
    assert stats is not None
    assert (stats.local, stats.remote, stats.compiled, stats.compile_s) == (1, 1, 1, 1.5)
    assert stats.warnings == ("redis",) and stats.hit_rate == pytest.approx(2 / 3)
    assert read_stats(tmp_path / "none") is None


def test_counters_count_a_kernel_compiled_again(tmp_path):
    """A key compiled by two processes (or twice by one) counts once as repeated; a compile
    recorded without a key (an older manager's line) is not compared."""
    (tmp_path / "1.jsonl").write_text(
        '{"event": "compiled", "compile_s": 1.0, "key": "k1"}\n'
        '{"event": "compiled", "compile_s": 1.0, "key": "k2"}\n'
    )
    (tmp_path / "2.jsonl").write_text(
        '{"event": "compiled", "compile_s": 1.0, "key": "k1"}\n'
        '{"event": "compiled", "compile_s": 1.0}\n'
    )
    stats = read_stats(tmp_path)
    assert stats is not None and (stats.compiled, stats.repeated) == (4, 1)
    assert "1 of them compiled a kernel again" in stats.describe()
    assert CacheStats.from_dict(stats.to_dict()) == stats


def test_a_failed_compile_is_a_lookup_that_stored_nothing(tmp_path):
    """A miss whose compile raised recorded no event, so the cell's lookups left it out; it is
    counted, and said, as a compile that failed or was stopped."""
    seen, stats, _ = Probe(tmp_path, "").run(64, 3, local="a")
    assert (seen["compiled"], seen["failed"]) == (1, 1)
    assert stats is not None and (stats.compiled, stats.failed, stats.lookups) == (1, 1, 2)
    assert stats.describe().endswith("; 1 compiles failed or were stopped")
    assert CacheStats.from_dict(stats.to_dict()).failed == 1  # the cell's record keeps it


def test_always_compile_counts_one_lookup_a_compile(tmp_path):
    """`TRITON_ALWAYS_COMPILE=1`: Triton asks the cache, then compiles whatever it found; that
    counted a local hit and a compile for one lookup."""
    probe = Probe(tmp_path, "")
    probe.run(64, local="a")
    seen, stats, _ = probe.run(64, local="a", TRITON_ALWAYS_COMPILE="1")
    assert seen["compiled"] == 1
    assert stats is not None and (stats.local, stats.compiled, stats.lookups) == (0, 1, 1)


def test_two_processes_missing_the_same_kernel_count_a_repeat(tmp_path):
    """Two real processes with empty local folders and no Redis compile the same kernel: the
    cell's counters (one stats folder) say one compile repeated the other, by Triton's key."""
    probe = Probe(tmp_path, "")
    stats_dir = tmp_path / "cell-stats"
    for local in ("a", "b"):
        proc = subprocess.run(
            [sys.executable, str(PROBE), "64"], env=probe.env(local, stats_dir),
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1])["compiled"] == 1
    stats = read_stats(stats_dir)
    assert stats is not None and (stats.compiled, stats.repeated) == (2, 1)
