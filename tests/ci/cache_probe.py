"""Compile a small kernel for sm_90 through Triton, the way a cell's process would; print counts.

Run as a script by tests/ci/test_compile_cache.py, with ``TRITON_INTERPRET`` unset and the cache
environment the test chose. Arguments are BLOCK sizes, one compile each (one
that is no power of 2 fails to compile, counted as failed); ``--pause-after N``
prints ``paused`` after N compiles and waits for a line on stdin (the test stops Redis then).
The last line printed is JSON: Triton's own count of compiles and cache hits (its compilation
listener), independent of the cache manager's counters.
"""

from __future__ import annotations

import argparse
import json
import sys

import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.errors import CompilationError

TARGET = GPUTarget("cuda", 90, 32)
SIGNATURE = {"x": "*fp32", "y": "*fp32", "out": "*fp32", "n": "i32", "BLOCK": "constexpr"}


@triton.jit
def add(x, y, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out + i, tl.load(x + i, mask=m) + tl.load(y + i, mask=m), mask=m)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("blocks", type=int, nargs="+")
    parser.add_argument("--pause-after", type=int, default=None)
    args = parser.parse_args()
    seen = {"compiled": 0, "hits": 0, "failed": 0}

    def listener(*, cache_hit: bool, **_: object) -> None:
        seen["hits" if cache_hit else "compiled"] += 1

    knobs.compilation.listener = listener
    cubins = []
    for done, block in enumerate(args.blocks):
        if done == args.pause_after:
            print("paused", flush=True)
            sys.stdin.readline()
        src = ASTSource(add, SIGNATURE, constexprs={"BLOCK": block})
        try:
            kernel = triton.compile(src, target=TARGET)
        except CompilationError:  # e.g. a BLOCK that is no power of 2
            seen["failed"] += 1
            continue
        cubins.append(len(kernel.asm["cubin"]))
    print(json.dumps({**seen, "cubin_bytes": cubins}), flush=True)


if __name__ == "__main__":
    main()
