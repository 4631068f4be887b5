"""What every benchmark family shares: the timer, the correctness rule, the read-bandwidth
ceiling, the vLLM anchor's availability, and the row every family returns.

The timing method (`METHOD`, recorded in every results document by the runner) is implemented
once, here, in `Context.time_us`. Families import this module and `bench.inputs`; this module
imports no other bench module but `bench.rows`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bench.rows import row_selected

METHOD = (
    "Each row's call is checked against portattn.reference (fp64; error <= 2x torch's own "
    "low-precision error, or bit-exact for copies) before it is timed; a row that fails is not "
    "timed. GPU: the call is captured in a CUDA graph (eager where it cannot be captured: the "
    "row says so); each repetition writes a 256 MB buffer to flush L2, then replays the graph "
    "between two CUDA events; the row's time is the median of the repetitions (warm-up and "
    "compile excluded). Host rows: perf_counter around back-to-back eager calls, median of "
    "loops. Anchors are measured in the same process: right after their row, or (the prefill "
    "family's) interleaved with it, each repetition timing the row and every anchor in turn. CPU "
    "(TRITON_INTERPRET=1): host clock around the interpreter, timings not meaningful."
)

FLUSH_BYTES = 256 << 20  # larger than any current GPU's L2 (H100/H200: 50 MB, MI300: 256 MB)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``|x - ref| / |ref|`` (Frobenius), in fp64 on the CPU. Bench keeps its own copy (as
    tests/helpers does): ``--compare`` imports older checkouts' portattn, which may lack one."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return float((x - ref).norm() / ref.norm())


def tolerance_check(out: torch.Tensor, oracle: torch.Tensor, lowp: torch.Tensor) -> dict:
    """The project's rule: the kernel's error against the fp64 oracle is finite and at most 2x
    the error of torch doing the same maths in the input's precision."""
    err, err_torch = rel_err(out, oracle), rel_err(lowp, oracle)
    passed = bool(torch.isfinite(out).all()) and err <= 2 * err_torch
    return dict(kind="tolerance", passed=passed, error=err, error_torch=err_torch)


def exact_check(pairs) -> dict:
    """Bit-exact equality of each ``(got, want)`` pair (the copy ops)."""
    passed = all(torch.equal(g.cpu(), w.cpu()) for g, w in pairs)
    return dict(kind="exact", passed=passed, error=None, error_torch=None)


def not_checked(why: str) -> dict:
    return dict(kind="none", passed=True, error=None, error_torch=None, detail=why)


def row(family: str, name: str, params: dict, check: dict, time_us: float | None = None,
        metrics: dict | None = None, anchors: list | None = None,
        timing: str = "") -> dict:  # fmt: skip
    """One result row (bench/schema.json, ``row``)."""
    return dict(family=family, name=name, params=params, check=check, time_us=time_us,
                metrics=metrics or {}, anchors=anchors or [], timing=timing)  # fmt: skip


def anchor(name: str, time_us: float | None, metrics: dict | None = None, note: str = "") -> dict:
    """A reference measurement beside a row (bench/schema.json, ``anchor``); ``time_us`` None
    with a ``note`` saying why it did not run."""
    return dict(name=name, time_us=time_us, metrics=metrics or {}, note=note)


@dataclass(frozen=True)
class Pending:
    """An anchor whose call ran and was checked, to be timed beside its row
    (`Context.time_together`): its name, its call, its metrics from its µs, a note."""

    name: str
    fn: Callable[[], object]
    metrics: Callable[[float], dict]
    note: str = ""

    def anchor(self, time_us: float, how: str) -> dict:
        """The anchor, timed."""
        return anchor(self.name, time_us, self.metrics(time_us),
                      "; ".join(p for p in (how, self.note) if p))  # fmt: skip


def rate(amount: float, time_us: float | None, unit: float) -> float | None:
    """``amount / time`` in ``unit`` per second (1e9: GB/s from bytes, 1e12: TFLOP/s)."""
    if not time_us or not math.isfinite(time_us):
        return None
    return amount / (time_us * 1e-6) / unit


@triton.jit
def _read_stream_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # x: [n] int32, read once; out: [programs] int32, one partial sum a program (4 bytes
    # written per 32 KB read: a read-only stream)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0, cache_modifier=".cg")
    tl.store(out_ptr + tl.program_id(0), tl.sum(x, axis=0))


def read_stream(nbytes: int, device: str) -> Callable[[], None]:
    """A launch of the streaming read over a fresh int32 buffer of ``nbytes`` (the read
    ceiling's kernel: one partial sum a program), run once and checked exactly.

    Raises:
        RuntimeError: the partial sums do not add up to the buffer's sum.
    """
    block, n = 8192, nbytes // 4
    x = torch.randint(-8, 8, (n,), dtype=torch.int32, device=device)
    out = torch.empty(triton.cdiv(n, block), dtype=torch.int32, device=device)

    def launch() -> None:
        _read_stream_kernel[(out.numel(),)](x, out, n, BLOCK=block, num_warps=8)

    launch()
    if int(out.sum()) != int(x.sum()):
        raise RuntimeError("read_stream: the streaming kernel's sums are wrong")
    return launch


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after one call on a side stream (the first call's
    allocations happen outside the capture).

    Raises:
        RuntimeError: what the capture raises (e.g. a host read of a device tensor).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def require_gpu(prog: str) -> None:
    """Stop ``prog`` (a diagnostic) where no CUDA/HIP device is visible, saying so: its timings
    under the interpreter would mean nothing."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{prog}: needs a CUDA/HIP device (interpreter timings mean nothing)")


@dataclass
class Context:
    """What a family's ``rows`` gets: the device, the size switch, the row filter, the timer."""

    device: str
    quick: bool = False
    only_rows: tuple[str, ...] = ()  # `row_selected` entries; a row runs when one selects it
    reps: int = 50
    _flush: torch.Tensor | None = None

    @property
    def meaningful(self) -> bool:
        """Timings mean something: a real GPU, not the interpreter."""
        return self.device == "cuda"

    def want(self, name: str) -> bool:
        return not self.only_rows or any(row_selected(name, s) for s in self.only_rows)

    def check_once(self, fn: Callable[[], object], out: torch.Tensor,
                   check: Callable[[], dict]) -> dict:  # fmt: skip
        """``fn`` run once over a scrambled ``out`` (stale values must not pass), then
        ``check()``'s verdict."""
        out.normal_()
        fn()
        return check()

    def checked_time_us(
        self, fn: Callable[[], object], out: torch.Tensor, check: Callable[[], dict]
    ) -> tuple[dict, float | None, str | None]:
        """`check_once`, then timed by `time_us` only if the check passed: ``(check, µs,
        how)``, or ``(check, None, None)`` for a row that is recorded without a time."""
        result = self.check_once(fn, out, check)
        if not result["passed"]:
            return result, None, None
        us, how = self.time_us(fn)
        return result, us, how

    def time_us(self, fn: Callable[[], object], graph: bool = True) -> tuple[float, str]:
        """Median µs of ``fn`` (`METHOD`) and how it was timed (``graph`` or ``eager``)."""
        return self.time_together([fn], graph)[0]

    def time_together(
        self, fns: Sequence[Callable[[], object]], graph: bool = True
    ) -> list[tuple[float, str]]:
        """Each of ``fns``' median µs and how it was timed (`METHOD`), their repetitions
        interleaved: each repetition times every call once, in order, so a clock that drifts
        during the run moves their times alike and their ratios stay."""
        for fn in fns:
            fn()  # compile and warm up outside the timing
        if self.device != "cuda":
            times: list[list[float]] = [[] for _ in fns]
            for _ in range(1 if self.quick else 3):
                for fn, t in zip(fns, times, strict=True):
                    t0 = time.perf_counter()
                    fn()
                    t.append((time.perf_counter() - t0) * 1e6)
            return [(statistics.median(t), "host clock (interpreter: not meaningful)")
                    for t in times]  # fmt: skip
        torch.cuda.synchronize()
        runs: list[tuple[Callable[[], object], str]] = []
        for fn in fns:
            run, how = fn, "eager"
            if graph:
                try:
                    run, how = capture(fn).replay, "graph"
                except RuntimeError as err:  # e.g. a host read of a device tensor in capture
                    torch.cuda.synchronize()
                    how = f"eager (graph capture failed: {str(err).splitlines()[0][:80]})"
            runs.append((run, how + (", interleaved" if len(fns) > 1 else "")))
        if self._flush is None:
            self._flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
        for run, _ in runs:
            run()
        torch.cuda.synchronize()
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(self.reps)] for _ in runs]  # fmt: skip
        for r in range(self.reps):
            for (run, _), ev in zip(runs, events, strict=True):
                self._flush.zero_()
                ev[r][0].record()
                run()
                ev[r][1].record()
        torch.cuda.synchronize()
        return [(statistics.median(s.elapsed_time(e) * 1e3 for s, e in ev), how)
                for (_, how), ev in zip(runs, events, strict=True)]  # fmt: skip

    def read_ceiling(self, nbytes: int) -> dict:
        """The card's read bandwidth on ``nbytes`` (1 MB to 4 GB): a Triton kernel streaming an
        int32 buffer of that size once, summing per program (checked exactly), as an anchor
        with the same bytes' time and GB/s, measured now (right after the row, as `METHOD`
        says: not an earlier row's measurement of the same size)."""
        # at least 1 MB; at most 4 GB (the kernel's int32 offsets; the rate is flat long before)
        n = min(max(nbytes, 1 << 20), 1 << 32) // 4
        us, how = self.time_us(read_stream(4 * n, self.device))
        return anchor("read ceiling (Triton stream)", us, {"GB/s": rate(4 * n, us, 1e9)},
                      note=f"{4 * n} bytes read, {how}")  # fmt: skip


def vllm_unified_attention() -> tuple[Callable | None, str]:
    """vLLM's Triton paged-attention kernel where ``import vllm`` works: ``(fn, "")``, else
    ``(None, why)`` for the results document."""
    try:
        import vllm  # noqa: F401
    except Exception as err:  # noqa: BLE001 (any import failure means: no vLLM anchor)
        return None, f"import vllm failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
    for mod in ("vllm.v1.attention.ops.triton_unified_attention",
                "vllm.attention.ops.triton_unified_attention"):  # fmt: skip
        try:
            return __import__(mod, fromlist=["unified_attention"]).unified_attention, ""
        except (ImportError, AttributeError):
            continue
    return None, "vllm imports but has no triton_unified_attention.unified_attention"


def vllm_anchor(fn: Callable | None, why: str, ctx: Context, batch, out_ref: torch.Tensor,
                scale: float) -> dict:  # fmt: skip
    """vLLM's ``unified_attention`` on an NHD paged batch (`bench.inputs.PagedBatch`): its
    output within 2e-2 (relative) of this row's checked output, then timed; a note where it
    cannot run."""
    name = "vLLM triton unified_attention"
    if fn is None:
        return anchor(name, None, note=why)
    if batch.layout != "NHD":
        return anchor(name, None, note="vLLM's kernel reads NHD caches only")
    out = torch.empty_like(batch.query)

    def call():
        fn(q=batch.query, k=batch.key_cache, v=batch.value_cache, out=out,
           cu_seqlens_q=batch.query_start_loc, max_seqlen_q=batch.max_query_len,
           seqused_k=batch.seq_lens, max_seqlen_k=batch.max_seq_len, softmax_scale=scale,
           causal=True, window_size=(-1, -1), block_table=batch.block_table, softcap=0,
           q_descale=None, k_descale=None, v_descale=None)  # fmt: skip

    try:
        call()
    except (TypeError, RuntimeError, ValueError) as err:
        return anchor(name, None, note=f"call failed: {type(err).__name__}: {str(err)[:120]}")
    diff = rel_err(out, out_ref)
    if not diff < 2e-2:
        return anchor(name, None, note=f"output differs from portattn's by {diff:.2e}: not timed")
    us, how = ctx.time_us(call)
    return anchor(name, us, note=how)


def check_windows(seqs, rows: int) -> list[tuple[int, int, int]]:
    """Rows of a paged batch the oracle checks, as ``(sequence, first row, width)``: the first
    and last ``rows`` rows of the first sequence with queries > 1, the last ``rows`` of the last
    one, and the first and last single-query (decode) sequences."""
    pre = [i for i, (_, q) in enumerate(seqs) if q > 1]
    dec = [i for i, (_, q) in enumerate(seqs) if q == 1]
    out: list[tuple[int, int, int]] = []
    if pre:
        q0 = seqs[pre[0]][1]
        w = min(rows, q0)
        out.append((pre[0], 0, w))
        if q0 > w:
            out.append((pre[0], q0 - w, w))
        if pre[-1] != pre[0]:
            q1 = seqs[pre[-1]][1]
            out.append((pre[-1], q1 - min(rows, q1), min(rows, q1)))
    return out + [(i, 0, 1) for i in sorted({*dec[:1], *dec[-1:]})]


def check_paged(batch, out: torch.Tensor, rows: int = 128) -> dict:
    """`tolerance_check` of a paged-attention output ``out`` of ``batch``
    (`bench.inputs.PagedBatch`) on the `check_windows` rows. A window of rows ``a .. a+w`` of a
    sequence ``(S, Q)`` is checked as a sequence ``(S - Q + a + w, w)`` of its own: the same
    causal limits, and the fp64 oracle costs seconds even for 4k-token prefills."""
    from portattn import reference

    qsl = [0]
    for _, q in batch.seqs:
        qsl.append(qsl[-1] + q)
    sel, idx, sl, sub_qsl = [], [], [], [0]
    for i, a, w in check_windows(batch.seqs, rows):
        s, q = batch.seqs[i]
        sel += range(qsl[i] + a, qsl[i] + a + w)
        idx.append(i)
        sl.append(s - q + a + w)
        sub_qsl.append(sub_qsl[-1] + w)
    dev = batch.query.device
    sel_t = torch.tensor(sel, device=dev)
    sub = (batch.query[sel_t], batch.key_cache, batch.value_cache,
           batch.block_table[torch.tensor(idx, device=dev)],
           torch.tensor(sl, dtype=torch.int32, device=dev),
           torch.tensor(sub_qsl, dtype=torch.int32, device=dev))  # fmt: skip
    oracle = reference.paged_attention(*sub, layout=batch.layout)
    lowp = reference.paged_attention(*sub, layout=batch.layout, compute_dtype=batch.query.dtype)
    result = tolerance_check(out[sel_t], oracle, lowp)
    result["detail"] = f"{len(sel)} rows of {len(idx)} sequences"
    return result


def paged_bytes(seqs, num_q_heads: int, num_kv_heads: int, head_dim: int, elem: int) -> int:
    """Bytes a paged-attention call must move: K and V of every context token once per KV head,
    the query and the output."""
    kv = sum(2 * s * num_kv_heads * head_dim * elem for s, _ in seqs)
    return kv + 2 * sum(q for _, q in seqs) * num_q_heads * head_dim * elem


def paged_flops(seqs, num_q_heads: int, head_dim: int) -> int:
    """QK^T and PV flops (2 each per causal (query, key) pair, head and dim)."""
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for s, q in seqs)
    return 4 * num_q_heads * head_dim * pairs
