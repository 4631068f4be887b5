"""Two-CTA clusters for a Gluon kernel on sm_90: TMA multicast and the peer's barriers.

Triton 3.6's Gluon cannot say "copy this box into both CTAs of my cluster" (TMA ``.multicast
::cluster``) or "arrive on my peer's barrier" (``mapa`` + ``mbarrier.arrive.shared::cluster``),
and it launches every kernel without clusters. Everything else a paired kernel needs it can
say. So a paired kernel is written in Gluon as if each CTA worked alone, with two marks, and
this module finishes it:

* each CTA copies **its share** of a tile (an ordinary TMA copy of part of the rows) and sets
  its barrier to expect the **whole** tile; the PTX pass (`multicast_ptx`) turns every TMA
  copy of the kernel into a multicast to both CTAs (mask ``0b11``), so each CTA's barrier
  receives both shares, at the same shared-memory offset in each CTA;
* an arrive with count `PEER_TAG` (`release_both`) becomes an arrive of count 1 on the same
  barrier in the **other** CTA of the pair;
* `cluster_sync` (inline PTX, no address needed) is ``barrier.cluster`` arrive + wait.

`clustered` assembles the rewritten PTX with Triton's own ``ptxas`` and returns a Triton
`CompiledKernel` whose metadata says 2 CTAs a cluster, kept in Triton's cache under a hash of
the original kernel's and this pass's version. Triton's launcher then launches clusters of 2
(``CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION``) over ``grid[0] * 2`` CTAs: a paired launch's grid
counts pairs. `ClusterKernel` wraps the Gluon kernel so that a `Launch` runs it this way; the
unrewritten kernel is compiled but never launched (its barriers would wait for the peer's
share forever).

The pass is strict: it counts what it rewrites and refuses PTX whose copies or arrives do not
have the one form it knows (`ClusterPassError`), so a Triton that emits something else fails at
compile time, in the compile matrix, not on a GPU.
"""

from __future__ import annotations

import hashlib
import json
import re
from types import SimpleNamespace
from typing import Any

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

#: The arrive count that marks "arrive on the peer CTA's barrier instead" (no kernel arrives
#: with this count for itself: `multicast_ptx` refuses PTX that arrives with it otherwise).
PEER_TAG = gl.constexpr(13)
#: CTAs in a cluster (the pass's masks and the peer's rank assume 2).
CTAS = 2
#: Bumped whenever `multicast_ptx`'s output changes (part of the rewritten kernel's cache key).
PASS_VERSION = 2


class ClusterPassError(RuntimeError):
    """PTX the pass does not know how to rewrite (module doc)."""


@gluon.jit
def cluster_sync():
    """Every thread of both CTAs arrives (release), then waits (acquire) for all of them:
    barriers a peer will signal are initialized, and visible to it, once this returns. Called by
    every warp of the CTA (each partition of a warp-specialized kernel calls it once)."""
    gl.inline_asm_elementwise(
        "fence.mbarrier_init.release.cluster;\n\t"
        "barrier.cluster.arrive.release.aligned;\n\t"
        "barrier.cluster.wait.acquire.aligned;\n\t"
        "mov.b32 $0, 0;",
        "=r",
        [],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def release_both(bar, go):
    """This CTA has finished reading a stage both CTAs copy into: arrive on this CTA's ``bar``
    and on the peer's (`PEER_TAG`, rewritten by `multicast_ptx`). Each CTA's producer waits on
    its own ``bar`` (count 2: both CTAs' readers) before it copies its share into both stages.
    ``go``: whether this release happens at all (both CTAs agree)."""
    if go:
        mbarrier.arrive(bar, count=1)
        mbarrier.arrive(bar, count=PEER_TAG)


# ``@%p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [dst],
# [desc, {c0, c1}], [bar];`` (any rank; Triton's form, one per line)
_COPY = re.compile(
    r"^(?P<indent>\s*)(?P<pred>@!?%p\d+\s+)?"
    r"cp\.async\.bulk\.tensor\.(?P<rank>[1-5])d\.shared::cluster\.global\."
    r"mbarrier::complete_tx::bytes\s+(?P<ops>\[[^;]*\]);\s*$",
    re.M,
)
# ``@%p mbarrier.arrive.shared::cta.b64 _, [%r], 13;``
_ARRIVE = re.compile(
    r"^(?P<indent>\s*)(?P<pred>@!?%p\d+\s+)?mbarrier\.arrive\.shared(?:::cta)?\.b64\s+_,\s*"
    r"\[(?P<addr>%r\d+)\],\s*(?P<count>\d+);\s*$",
    re.M,
)


def multicast_ptx(ptx: str, *, min_copies: int = 1, min_peer_arrives: int = 1) -> str:
    """The paired form of a kernel's PTX (module doc): every TMA copy multicast to both CTAs,
    every `PEER_TAG` arrive made on the peer's barrier. Raises `ClusterPassError` when there
    are fewer than ``min_copies`` copies or ``min_peer_arrives`` tagged arrives, when a copy
    already multicasts or has another form, or when a tagged arrive has another form."""
    if ".multicast::cluster" in ptx:
        raise ClusterPassError("the PTX already multicasts")
    copies = 0

    def copy(m: re.Match) -> str:
        nonlocal copies
        copies += 1
        pred = m["pred"] or ""
        return (
            f"{m['indent']}{{\n"
            f"{m['indent']}.reg .b16 %pa_mask;\n"
            f"{m['indent']}mov.b16 %pa_mask, {(1 << CTAS) - 1};\n"
            f"{m['indent']}{pred}cp.async.bulk.tensor.{m['rank']}d.shared::cluster.global."
            f"mbarrier::complete_tx::bytes.multicast::cluster {m['ops']}, %pa_mask;\n"
            f"{m['indent']}}}"
        )

    out = _COPY.sub(copy, ptx)
    if out.count("cp.async.bulk.tensor") != copies:
        raise ClusterPassError("a TMA copy of an unknown form")
    arrives = 0

    def arrive(m: re.Match) -> str:
        nonlocal arrives
        if int(m["count"]) != PEER_TAG.value:
            return m[0]
        arrives += 1
        pred = m["pred"] or ""
        i = m["indent"]
        return (
            f"{i}{{\n"
            f"{i}.reg .b32 %pa_rank;\n"
            f"{i}.reg .b32 %pa_addr;\n"
            f"{i}mov.u32 %pa_rank, %cluster_ctarank;\n"
            f"{i}xor.b32 %pa_rank, %pa_rank, 1;\n"
            f"{i}mapa.shared::cluster.u32 %pa_addr, {m['addr']}, %pa_rank;\n"
            f"{i}{pred}mbarrier.arrive.shared::cluster.b64 _, [%pa_addr];\n"
            f"{i}}}"
        )

    out = _ARRIVE.sub(arrive, out)
    if re.search(rf"mbarrier\.arrive[^;\n]*,\s*{PEER_TAG.value};", out):
        raise ClusterPassError(f"an arrive of count {PEER_TAG} of an unknown form")
    if copies < min_copies:
        raise ClusterPassError(f"{copies} TMA copies, expected at least {min_copies}")
    if arrives < min_peer_arrives:
        raise ClusterPassError(f"{arrives} peer arrives, expected at least {min_peer_arrives}")
    return out


def _assemble(ptx: str, metadata: Any) -> bytes:
    """``ptxas`` of ``ptx`` as Triton assembles the kernel's own (its options, its ptxas)."""
    from triton.compiler import make_backend

    backend = make_backend(metadata.target)
    opt = SimpleNamespace(enable_fp_fusion=metadata.enable_fp_fusion,
                          ptx_options=getattr(metadata, "ptx_options", None))  # fmt: skip
    return backend.make_cubin(ptx, {}, opt, metadata.target.arch)


def _metadata_json(metadata: Any, **changes: Any) -> str:
    md = metadata._asdict()
    md.update(changes)
    target = md["target"]
    md["target"] = {"backend": target.backend, "arch": target.arch, "warp_size": target.warp_size}
    return json.dumps(md)


#: Paired kernels by the original `CompiledKernel` (Triton's JIT keeps one per device; each is
#: loaded on its device when first run): ``id(compiled) -> (compiled, paired)``, the original
#: kept alive so that its id is not reused.
_PAIRED: dict[int, tuple[Any, Any]] = {}


def clustered(compiled: Any) -> Any:
    """The paired kernel of ``compiled`` (a Triton `CompiledKernel` of a kernel written for
    pairs): its PTX rewritten (`multicast_ptx`), assembled, with 2 CTAs a cluster. Triton's cache
    keeps it under a hash of ``compiled``'s and `PASS_VERSION`, so later processes skip
    ``ptxas``."""
    hit = _PAIRED.get(id(compiled))
    if hit is not None:
        return hit[1]
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.cache import get_cache_manager

    name = compiled.name
    key = hashlib.sha256(f"{compiled.hash}-pair-v{PASS_VERSION}".encode()).hexdigest()
    cache = get_cache_manager(key)
    grp_name = f"__grp__{name}.json"
    group = cache.get_group(grp_name)
    if group is None:
        ptx = multicast_ptx(compiled.asm["ptx"])
        cubin = _assemble(ptx, compiled.metadata)
        meta = _metadata_json(compiled.metadata, num_ctas=CTAS, hash=key)
        group = {
            f"{name}.ptx": cache.put(ptx, f"{name}.ptx", binary=False),
            f"{name}.cubin": cache.put(cubin, f"{name}.cubin", binary=True),
            f"{name}.json": cache.put(meta, f"{name}.json", binary=False),
        }
        cache.put_group(grp_name, group)
    paired = CompiledKernel(compiled.src, group, key)
    _PAIRED[id(compiled)] = (compiled, paired)
    return paired


class ClusterKernel:
    """A Gluon kernel written for pairs (module doc), run as one: a `Launch` whose ``kernel``
    is this runs the paired kernel over ``grid[0] * 2`` CTAs in clusters of 2 (its grid counts
    pairs). ``jit`` is the Gluon kernel, which the compile matrix compiles (and `clustered`
    finishes); its other attributes are the Gluon kernel's."""

    def __init__(self, jit: Any):
        self.jit = jit

    def __getattr__(self, name: str) -> Any:
        if name == "jit":  # not set yet (copy, pickle)
            raise AttributeError(name)
        return getattr(self.jit, name)

    def __repr__(self) -> str:
        return f"ClusterKernel({self.jit.__name__})"

    def __getitem__(self, grid: tuple[int, ...]):
        def runner(**kwargs: Any) -> Any:
            from portattn.kernels._plans import _launch_compiled

            compiled = self.jit.warmup(grid=grid, **kwargs)
            paired = clustered(compiled)
            args = [kwargs[name] for name in self.jit.arg_names]
            _launch_compiled(paired, grid, args)
            return paired

        return runner

