"""SIGTERM handled as Ctrl-C by the CLIs.

A CI system cancels a job, or ends one past its timeout, with SIGTERM (Buildkite, Kubernetes, a
shell's ``timeout``). Python's default for it is to die at once: the running cell's process
group kept running and wrote its report later, a launched Job kept its GPU until its deadline,
and no summary was written. Raised as a ``KeyboardInterrupt`` (with `terminated` set), it takes
the paths Ctrl-C takes: the cell is stopped and recorded, Jobs are deleted, the summary written.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_TERMINATED = 143  # as a shell reports a process that SIGTERM ended


#: Set once SIGTERM arrived: what tells it from Ctrl-C, also after a command caught the
#: interrupt to write its summary (the local runner).
terminated = threading.Event()


def _raise_terminated(signum: int, frame: object) -> None:
    terminated.set()
    raise KeyboardInterrupt


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block, SIGTERM raises ``KeyboardInterrupt`` in the main thread, `terminated`
    set (elsewhere, where no handler can be set, the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    terminated.clear()
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted_exit() -> int:
    """The exit status after cleaning up from an interrupt: 143 for SIGTERM, 130 for Ctrl-C."""
    return EXIT_TERMINATED if terminated.is_set() else 130
