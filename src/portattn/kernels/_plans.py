"""Cached plans: the host path of a repeated call (docs/design.md, "Host path").

An op's plan (validation, policy tiles, keyword arguments, grid) depends only on the call's
*description*: each tensor's shape, strides, dtype, device and 16-byte base alignment, every other
argument's type and value, the current device and the target override. Two calls with equal
descriptions get the same plan except for which tensors fill the pointer slots. So the first call
of a description plans as always (`plan_<op>`, `Launch.run`) and leaves a `Plan` behind:

* a pointer slot names the call input it came from (by identity, at plan time; a call passing
  one tensor as two inputs is not planned);
* a buffer the plan allocated (``out=None``, split-KV partials) is allocated afresh on every call
  with the first call's shape and dtype (a zero-size placeholder is kept: it is never touched);
* a TMA descriptor is rebuilt around the call's tensor (its shape, strides and block shape are
  functions of the description);
* every other argument is a constant.

A hit skips validation by construction: every check that reads no device memory is a function of
the description, so a description that passed once passes again -- except overlap, which depends
on the addresses too: each hit checks that the tensors the launches write (`Launch.writes`)
overlap no other input (`_checks.Disjoint`: a few pointer comparisons), and an overlapping call
is planned afresh, whose validation refuses it. A call whose plan reads the
metadata's contents (CPU tensors, or a GPU call without the bounds that make reads unnecessary)
is never cached: its key is ``None``. A call that raises is never cached either.

Triton's own specialization (16-byte pointer alignment, integers equal to 1 or divisible by 16)
is a function of the description too (alignment is in it, the integers come from its shapes,
strides and scalars), so the kernel the first call compiled is the one Triton would pick again,
and a hit launches it directly, skipping `JITFunction.run`'s binder and cache lookup: on NVIDIA
through Triton's C launcher with an argument list built at plan time (`_DirectLaunch`; tensors
passed as their addresses), elsewhere (or with a launch hook registered) through
`CompiledKernel.run`. Under Triton's interpreter (no compiled kernel)
a plan runs through ``kernel[grid]`` with the rebuilt arguments, which is how the CPU tests run
cached plans.

A repeated call can skip building its key: `PlanCache.probe` checks the call's tensors against
the recent plans of its op and scalars with torch's C tensor guards (`PlanCache`'s ``guards``).

``PORTATTN_PLAN_CACHE=0`` in the environment when portattn is imported turns caching off for the
process (`PLANS` is built then); tests build their own `PlanCache` with ``enabled`` or
``guards`` given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
from collections.abc import Callable, Hashable, Sequence
from operator import is_, is_not, itemgetter, or_
from typing import Any

import torch
from triton import knobs

from portattn.kernels._checks import Disjoint
from portattn.kernels._launch import Launch
from portattn.platform import override_key

_knobs = knobs.runtime

#: Pointer alignment Triton specializes on (and TMA descriptors need).
ALIGN = 16
#: Plans kept (the oldest dropped first): one per distinct call description.
MAX_PLANS = 1024
#: Distinct ``exact`` value tuples numbered by `exact_id` before its table is emptied.
MAX_EXACT = 4096
#: Guarded plans kept per op and scalars (`PlanCache.probe` tries them newest first).
MAX_GUARDS = 4

try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - a torch without dynamo's C guards
    _TensorGuards = None  # type: ignore[misc,assignment]
_data_ptr = torch.Tensor.data_ptr
_NONES = itertools.repeat(None)  # stateless: `map` takes one None per input


class Uncacheable(Exception):
    """A call (or a plan) that cannot be described or replayed; it runs uncached."""


class _PassedTwice(Uncacheable):
    """One tensor passed as two inputs: the plan could not tell which input a slot came from.
    Only this call runs uncached (a later call of the description may be planned)."""


def describe(x: Any) -> Hashable:
    """A hashable description of one argument: what a plan may depend on.

    Tensors: shape, strides, dtype, device and ``data_ptr() % ALIGN``; ``None``; ints, floats,
    strings and bools with their type (``True`` and ``1`` differ, as the ops' checks say);
    tuples and lists element-wise; dtypes; frozen dataclasses without tensor fields (`Target`,
    tiles) by value. Anything else raises `Uncacheable`.
    """
    if isinstance(x, torch.Tensor):
        if x.is_neg() or x.is_conj():  # planned afresh, where the op's checks refuse it
            raise Uncacheable("a tensor with torch's lazy negation or conjugation bit")
        if x.layout != torch.strided:  # (sparse: no strides, no storage) refused by the checks
            raise Uncacheable(f"a tensor of layout {x.layout}")
        return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % ALIGN)
    if x is None or type(x) in (int, float, str, bool):
        return (type(x), x)
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(describe(v) for v in x))
    if isinstance(x, torch.dtype) or _value_dataclass(type(x)):
        return x
    raise Uncacheable(f"cannot describe {type(x).__name__}")


_VALUE_TYPES: dict[type, bool] = {}


def _value_dataclass(cls: type) -> bool:
    """A frozen dataclass none of whose fields is declared a tensor: hashed and compared by
    value (a tensor field would compare element-wise; such a type is described field by field
    by its op instead)."""
    ok = _VALUE_TYPES.get(cls)
    if ok is None:
        params = getattr(cls, "__dataclass_params__", None)
        ok = bool(params is not None and params.frozen) and not any(
            "Tensor" in str(f.type) for f in dataclasses.fields(cls)
        )
        _VALUE_TYPES[cls] = ok
    return ok


_SCALARS = frozenset((int, float, str, bool, type(None)))


def call_key(op: str, *args: Any, exact: Hashable = ()) -> Hashable | None:
    """The cache key of a call of ``op`` with ``args`` (every argument the plan may read), plus
    the current CUDA device (compiled kernels are per device) and the target override; ``None``
    when some argument cannot be described (the call then runs uncached and reports its errors).
    ``exact``: values that go into the key as they are, for fields the library made itself (an
    `MlaMetadata`'s tiles and sizes, or their `exact_id`), whose equality is already exact. A key
    that turns out unhashable (a value in ``exact`` or a dataclass field) is not cached either
    (`PlanCache.call`).

    One flat tuple; each argument as `describe` gives it (tensors and plain scalars inline),
    ``None`` as itself.
    """
    tensor, scalars, strided = torch.Tensor, _SCALARS, torch.strided
    try:
        described = [
            (a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % ALIGN)
            if type(a) is tensor and a.layout is strided and not (a.is_neg() or a.is_conj())
            else a
            if a is None  # no other argument's description is None
            else (type(a), a)
            if type(a) in scalars
            else describe(a)
            for a in args
        ]
    except Uncacheable:
        return None
    return (op, _current_device(), override_key(), exact, *described)


_EXACT: dict[Hashable, int] = {}
_EXACT_IDS = itertools.count(1)


def exact_id(values: Hashable) -> int | None:
    """A number standing for ``values`` in a key (`call_key`'s ``exact``): equal values get equal
    numbers, and a number is never given to other values (the table is emptied past `MAX_EXACT`
    entries, but the count goes on: values seen again get a new number, their old plans are
    merely never hit). Hashing ``values`` once here spares every lookup of the key from hashing
    them again (frozen dataclasses hash field by field in Python). ``None``: unhashable."""
    try:
        n = _EXACT.get(values)
    except TypeError:
        return None
    if n is None:
        if len(_EXACT) >= MAX_EXACT:
            _EXACT.clear()
        n = _EXACT[values] = next(_EXACT_IDS)
    return n


def evict_oldest(table: dict, keep: int) -> None:
    """Drop ``table``'s oldest entries until it holds ``keep``. Threads share the tables
    unlocked: an entry another thread removed meanwhile is skipped, and a lookup made while
    another thread changed the table's size is made again."""
    while len(table) > keep:
        with contextlib.suppress(RuntimeError, StopIteration):  # changed size; emptied
            table.pop(next(iter(table)), None)


class _Bound:
    """Device and stream getters, bound on first use (CUDA initialised lazily, as torch does)."""

    device: Callable[[], int | None] | None = None
    stream: Callable[[int | None], Any] | None = None


def _current_device() -> int | None:
    """The current CUDA/HIP device index; ``None`` on a machine without one."""
    get = _Bound.device
    if get is None:
        get = _bind_device()
    return get()


def _bind_device() -> Callable[[], int | None]:
    """The device getter: torch's own C getter once CUDA is initialised (what
    `torch.cuda.current_device` calls after its initialisation check), until then
    `torch.cuda.current_device` itself (it initialises CUDA; the C getter is bound next time)."""
    if not torch.cuda.is_available():
        _Bound.device = _no_device
    elif torch.cuda.is_initialized():
        _Bound.device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
    else:
        return torch.cuda.current_device
    return _Bound.device


def _no_device() -> None:
    return None


def _current_stream(device: int | None) -> Any:
    """The raw CUDA/HIP stream Triton launches on (its driver's getter)."""
    if _Bound.stream is None:
        from triton.runtime.driver import driver

        _Bound.stream = driver.active.get_current_stream
    return _Bound.stream(device)


def _is_descriptor(x: Any) -> bool:
    """A TMA tensor descriptor (Triton's or Gluon's): a dataclass with a tensor ``base``."""
    return (
        dataclasses.is_dataclass(x)
        and not isinstance(x, type)
        and isinstance(getattr(x, "base", None), torch.Tensor)
    )


# How one argument of a cached launch is filled on a hit.
_INPUT, _ALLOC = 0, 1


@dataclasses.dataclass
class _Replay:
    """One launch of a `Plan`: kernel, grid, options and the argument list's recipe."""

    kernel: Any
    grid: tuple[int, ...]
    options: dict[str, int]
    names: list[str]
    consts: list[Any]  # None where `fills` puts a tensor or a descriptor
    fills: list[tuple[int, int, int, Any]]  # (position, _INPUT/_ALLOC, index, descriptor recipe)
    compiled: Any = None
    direct: _DirectLaunch | None = None


class Plan:
    """The replayable form of one call's launches (module docstring).

    Built from the launches of a first call and that call's tensor inputs (``inputs``: every
    tensor the op received, in a fixed order; ``None`` for absent ones). It keeps no reference
    to those tensors. `bind` gives the argument lists of a later call with an equal description;
    `run` launches them. Raises `Uncacheable` for a launch argument it cannot rebuild (a view of
    an input, a non-contiguous buffer).
    """

    def __init__(self, launches: Sequence[Launch], inputs: Sequence[torch.Tensor | None]):
        by_id = {id(t): i for i, t in enumerate(inputs) if t is not None}
        if len(by_id) != sum(t is not None for t in inputs):
            # e.g. key_cache is value_cache: both slots would name one input, stale for a
            # later call of the same description with two tensors
            raise _PassedTwice("a tensor passed as two inputs")
        storages = {
            t.untyped_storage().data_ptr()
            for t in inputs
            if t is not None and t.device.type != "meta" and t.numel()
        }
        self._allocs: list[Callable[[], torch.Tensor]] = []  # each allocates one buffer
        alloc_ids: dict[int, int] = {}

        def slot(t: torch.Tensor) -> tuple[int, int] | None:
            """Where a hit takes ``t`` from; ``None``: a zero-size placeholder, kept as is."""
            if id(t) in by_id:
                return _INPUT, by_id[id(t)]
            if t.numel() == 0:
                return None
            return alloc(t)

        def alloc(t: torch.Tensor) -> tuple[int, int]:
            """``t`` as a buffer each hit allocates anew."""
            if id(t) not in alloc_ids:
                shares = t.device.type != "meta" and t.untyped_storage().data_ptr() in storages
                if shares or not t.is_contiguous() or t.storage_offset():
                    raise Uncacheable("a launch argument is a view of an input")
                alloc_ids[id(t)] = len(self._allocs)
                self._allocs.append(_empty(tuple(t.shape), t.dtype, t.device))
            return _ALLOC, alloc_ids[id(t)]

        self._replays: list[_Replay] = []
        for launch in launches:
            names = [name for name, _ in launch._params()]
            consts: list[Any] = []
            fills: list[tuple[int, int, int, Any]] = []
            for pos, name in enumerate(names):
                v = launch.args[name]
                where = None
                recipe = None
                if isinstance(v, torch.Tensor):
                    where = slot(v)
                elif _is_descriptor(v):
                    where = slot(v.base)
                    if where is None:
                        raise Uncacheable("a descriptor of an empty tensor")
                    rest = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
                    del rest["base"]
                    recipe = (type(v), rest)
                consts.append(v if where is None else None)
                if where is not None:
                    fills.append((pos, where[0], where[1], recipe))
            options = launch.options.backend_kwargs(launch.target, launch.backend())
            self._replays.append(_Replay(launch.kernel, launch.grid, options, names, consts, fills))
        # The inputs the launches write: a hit checks they overlap no other input (`_checks`).
        writes = [by_id[id(t)] for launch in launches for t in launch.writes if id(t) in by_id]
        self.disjoint = Disjoint(list(dict.fromkeys(writes)), inputs)
        self.meta = any(t is not None and t.is_meta for t in inputs)
        outputs = launches[0].outputs if launches else ()
        # An output the caller did not pass is its own even at size 0: each hit makes a new one.
        wheres = [(_INPUT, by_id[id(t)]) if id(t) in by_id else alloc(t) for t in outputs]
        self._outputs = wheres
        # Outputs that are all buffers of the plan (``out=None``): gathered in one C call.
        self._out_allocs: Callable[[list], Any] | None = None
        if outputs and all(w[0] == _ALLOC for w in wheres):
            refs = [w[1] for w in wheres]
            self._out_allocs = itemgetter(*refs) if len(refs) > 1 else _one_tuple_getter(refs[0])
        self._direct: list[_DirectLaunch] | None = None

    def keep_compiled(self, compiled: Sequence[Any]) -> None:
        """Record the compiled kernels of the first call's launches (``None``: interpreted, or
        never launched), and build the direct launches (`_DirectLaunch`) when every launch that
        runs has one."""
        direct: list[_DirectLaunch] | None = []
        for replay, kernel in zip(self._replays, compiled, strict=True):
            replay.compiled = kernel
            if any(g == 0 for g in replay.grid):
                continue  # never runs
            try:
                if kernel is None:
                    raise Uncacheable("no compiled kernel")
                replay.direct = _DirectLaunch(replay, kernel)
            except Uncacheable:
                replay.direct = None
            if replay.direct is None or direct is None:
                direct = None
            else:
                direct.append(replay.direct)
        self._direct = direct or None  # nothing to launch: no stream to ask for

    def _allocate(self) -> list[torch.Tensor]:
        return [alloc() for alloc in self._allocs]

    def _args(self, replay: _Replay, inputs: Sequence, allocs: list[torch.Tensor]) -> list[Any]:
        args = list(replay.consts)
        for pos, kind, ref, recipe in replay.fills:
            t = inputs[ref] if kind == _INPUT else allocs[ref]
            args[pos] = t if recipe is None else recipe[0](base=t, **recipe[1])
        return args

    def _outs(self, inputs: Sequence, allocs: list[torch.Tensor]) -> tuple:
        if self._out_allocs is not None:
            return self._out_allocs(allocs)
        return tuple([inputs[i] if kind == _INPUT else allocs[i] for kind, i in self._outputs])

    def bind(self, inputs: Sequence[torch.Tensor | None]) -> tuple[list[list[Any]], tuple]:
        """Argument lists (kernel parameter order, one per launch) and the outputs of a call with
        ``inputs``, whose description equals the first call's."""
        allocs = self._allocate()
        lists = [self._args(replay, inputs, allocs) for replay in self._replays]
        return lists, self._outs(inputs, allocs)

    def bind_launch(self, inputs: Sequence[torch.Tensor | None]) -> tuple[list[list[Any]], tuple]:
        """What `run` builds before launching (the host time's breakdown): the buffers, then per
        launch the direct launcher's argument list (`_DirectLaunch.args`, on the current stream)
        where `run` would launch directly, else `bind`'s lists."""
        if self._direct is None or _hooks() is not None:
            return self.bind(inputs)
        allocs = self._allocate()
        stream = _current_stream(_current_device())
        lists = [launch.args(inputs, allocs, stream) for launch in self._direct]
        return lists, self._outs(inputs, allocs)

    def run(self, inputs: Sequence[torch.Tensor | None], ptrs: tuple | None = None) -> tuple:
        """Launch the plan for ``inputs``; return the first launch's outputs. ``ptrs``: the
        addresses of ``inputs[:len(ptrs)]``, every tensor among them, just read (`probe`);
        direct launches take them instead of asking the tensors again."""
        allocs = self._allocate()
        direct = self._direct
        if direct is not None and _hooks() is None:
            stream = _current_stream(_current_device())
            for launch in direct:
                launch.launch(inputs, allocs, stream, ptrs)
            return self._outs(inputs, allocs)
        return self._run_compiled(inputs, allocs)

    def prepare(
        self, inputs: Sequence[torch.Tensor | None], ptrs: tuple | None = None
    ) -> Callable[[], tuple]:
        """`run` in two steps: everything but the launches now (the buffers, and the direct
        launches' argument lists on the current stream), and a callable that launches them and
        returns the first launch's outputs. An unbounded call prepares while the device checks
        its metadata, and launches once the check has passed. Arguments as `run`'s."""
        allocs = self._allocate()
        direct = self._direct
        if direct is None or _hooks() is not None:
            return functools.partial(self._run_compiled, inputs, allocs)
        stream = _current_stream(_current_device())
        lists = [launch.args(inputs, allocs, stream, ptrs) for launch in direct]
        outs = self._outs(inputs, allocs)

        def fire() -> tuple:
            for launch, args in zip(direct, lists, strict=True):
                launch.fire(args)
            return outs

        return fire

    def _run_compiled(self, inputs: Sequence[torch.Tensor | None], allocs: list) -> tuple:
        """`run` where a launch cannot go direct (not NVIDIA, a launch hook registered, the
        interpreter): each compiled kernel through `CompiledKernel.run`, else ``kernel[grid]``."""
        for replay in self._replays:
            if any(g == 0 for g in replay.grid):
                continue
            args = self._args(replay, inputs, allocs)
            if replay.compiled is None and self.meta:
                continue  # meta tensors have no memory: nothing to run (as `Launch.run`)
            if replay.compiled is None:
                named = dict(zip(replay.names, args, strict=True))
                replay.kernel[replay.grid](**named, **replay.options)
            else:
                _launch_compiled(replay.compiled, replay.grid, args)
        return self._outs(inputs, allocs)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Callable:
    """A buffer's allocation, ready to call. Where it exists: torch's C allocation
    without argument parsing or dispatch (`_FAST_EMPTY`: what Inductor's generated code calls),
    tried once here and kept only if it gives the buffer `torch.empty` would. Otherwise
    `torch.empty` with the sizes as separate arguments (torch parses them faster than a tuple),
    bound once."""
    if not shape:
        slow = functools.partial(torch.empty, (), dtype=dtype, device=device)
    else:
        slow = functools.partial(torch.empty, *shape, dtype=dtype, device=device)
    fast = _FAST_EMPTY.get(device.type)
    # CUDA's allocates on the current device, which the key pins: the buffer's device only
    if fast is None or (device.type == "cuda" and device.index != _current_device()):
        return slow
    strides = []
    n = 1
    for size in reversed(shape):
        strides.append(n)
        n *= max(size, 1)
    fast = functools.partial(fast, tuple(shape), tuple(reversed(strides)), dtype)
    try:
        got, want = fast(), slow()
    except Exception:  # noqa: BLE001 - a build without it: torch.empty, as always
        return slow
    same = [(t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in (got, want)]
    return fast if same[0] == same[1] else slow


def present(inputs: Sequence[Any]) -> tuple[tuple[bool, ...], tuple]:
    """Which of ``inputs`` are not ``None`` (for a `PlanCache.probe` guard), and those inputs
    (its tensors), in two C passes."""
    mask = tuple(map(is_not, inputs, _NONES))
    return mask, tuple(itertools.compress(inputs, mask))


def _fast_empty() -> dict[str, Callable]:
    try:
        from torch._C._dynamo import guards
    except ImportError:  # pragma: no cover - a torch without dynamo's C helpers
        return {}
    found = {"cpu": "_empty_strided_cpu", "cuda": "_empty_strided_cuda"}
    return {dev: getattr(guards, name) for dev, name in found.items() if hasattr(guards, name)}


#: Allocation functions by device type (`_empty`).
_FAST_EMPTY = _fast_empty()


def _one_tuple_getter(i: int) -> Callable[[list], tuple]:
    """The 1-tuple of item ``i`` (`itemgetter` of one index gives the item itself)."""
    return lambda xs: (xs[i],)


class _DirectLaunch:
    """A cached launch of a compiled NVIDIA kernel straight through Triton's C launcher.

    `CompiledKernel.run` is Triton's `CudaLauncher`: per launch it defines and calls its scratch
    allocator twice, then (with TMA descriptors) a Python wrapper walks every argument, encoding
    each host descriptor into a ``CUtensorMap`` (``make_tensordesc_arg``, a driver call), and the
    C launcher calls ``data_ptr()`` and ``cuPointerGetAttribute`` for each tensor. A cached plan
    knows all of it up front: the argument list (grid, launcher head, every constant) is built
    once, already expanded for the C launcher underneath; a hit fills in its tensors (their
    addresses: the C launcher then neither calls ``data_ptr()`` nor asks the driver about them)
    and the stream. A descriptor's shape, strides and block shape are
    functions of the call's description, so its encoding depends only on the base address: it
    is memoized by address (no reference to the tensor is kept; a map encodes the address, the
    geometry and nothing else). Built only where the launcher has exactly the expected form
    (Triton 3.6: a `CudaLauncher` without scratch buffers whose ``launch`` is the C function, or
    the descriptor wrapper around it); anything else raises `Uncacheable` and the launch goes
    through `CompiledKernel.run` as usual.
    """

    MAX_MEMO = 64
    #: Arguments before the kernel's own: grid (3), stream, function, cooperative grid, PDL,
    #: the two scratch buffers, packed metadata, launch metadata and the two hooks.
    HEAD = 13

    def __init__(self, replay: _Replay, kernel: Any):
        run = kernel.run
        if (
            type(run).__name__ != "CudaLauncher"
            or getattr(run, "global_scratch_size", 1) != 0
            or getattr(run, "profile_scratch_size", 1) != 0
        ):
            raise Uncacheable("launcher of an unexpected form")
        desc_at = {pos: (kind, ref, recipe) for pos, kind, ref, recipe in replay.fills if recipe}
        launcher = getattr(run, "launch", None)
        meta_of: dict[int, Any] = {}
        if desc_at:
            code = getattr(launcher, "__code__", None)
            closure = getattr(launcher, "__closure__", None)
            if code is None or not closure:
                raise Uncacheable("launcher without a descriptor wrapper")
            cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure), strict=False))
            indices, metas = cells.get("tensordesc_indices"), cells.get("tensordesc_meta")
            if (
                "launcher" not in cells
                or not isinstance(indices, set)
                or sorted(indices) != sorted(desc_at)
                or not isinstance(metas, list)
                or len(metas) != len(indices)
            ):
                raise Uncacheable("launcher of an unexpected form")
            from triton.backends.nvidia.driver import make_tensordesc_arg

            self._encode = make_tensordesc_arg
            launcher = cells["launcher"]
            meta_of = dict(zip(sorted(indices), metas, strict=True))
        if not callable(launcher) or hasattr(launcher, "__code__"):  # C, not a Python wrapper
            raise Uncacheable("launcher of an unexpected form")
        self._launcher = launcher
        grid = (tuple(replay.grid) + (1, 1))[:3]
        self._flat: list[Any] = [*grid, None, kernel.function, run.launch_cooperative_grid,
                                 run.launch_pdl, None, None, kernel.packed_metadata, None, None,
                                 None]  # fmt: skip
        assert len(self._flat) == self.HEAD
        fill_at = {pos: (kind, ref) for pos, kind, ref, recipe in replay.fills if not recipe}
        # A tensor's slot: its first one reads it (`_from_inputs`, `_from_allocs`), later ones
        # of the same tensor copy that value (`_copies`: (position, first position)).
        self._from_inputs: list[tuple[int, int]] = []
        self._from_allocs: list[tuple[int, int]] = []
        self._copies: list[tuple[int, int]] = []
        first: dict[tuple[int, int], int] = {}

        def slot(kind: int, ref: int) -> None:
            at = len(self._flat)
            if (kind, ref) in first:
                self._copies.append((at, first[kind, ref]))
            else:
                first[kind, ref] = at
                (self._from_inputs if kind == _INPUT else self._from_allocs).append((at, ref))
            self._flat.append(None)

        self._descs: list[tuple[int, int, int, int, Any, Any]] = []  # encoded descriptors
        for pos, const in enumerate(replay.consts):
            if pos in fill_at:
                slot(*fill_at[pos])
            elif pos in desc_at:
                kind, ref, recipe = desc_at[pos]
                dims = [*recipe[1]["shape"], *recipe[1]["strides"]]
                meta = meta_of[pos]
                if meta is None:  # passed decomposed: base, dims, NaN padding flag, dims again
                    slot(kind, ref)
                    self._flat += [*dims, recipe[1].get("padding") == "nan", *dims]
                else:  # encoded tensor map, then the dims
                    width = 1 + len(dims)
                    self._descs.append((len(self._flat), width, kind, ref, recipe, meta))
                    self._flat.extend([None] * width)
            else:
                self._flat.append(const)
        self._memo: dict[tuple[int, int], list[Any]] = {}
        self.launches = 0

    def launch(
        self, inputs: Sequence, allocs: list[torch.Tensor], stream: Any, ptrs: tuple | None = None
    ) -> None:
        self.fire(self.args(inputs, allocs, stream, ptrs))

    def fire(self, args: list[Any]) -> None:
        """Launch with an argument list `args` built."""
        self._launcher(*args)
        self.launches += 1

    def args(
        self, inputs: Sequence, allocs: list[torch.Tensor], stream: Any, ptrs: tuple | None = None
    ) -> list[Any]:
        """The C launcher's whole argument list for ``inputs``, ``allocs`` and ``stream``: what
        `CompiledKernel.run` would hand it, tensors as their addresses (the
        inputs' from ``ptrs`` where given: `Plan.run`)."""
        args = self._flat.copy()
        args[3] = stream
        if ptrs is not None:
            for at, ref in self._from_inputs:
                args[at] = ptrs[ref]
        else:
            for at, ref in self._from_inputs:
                args[at] = inputs[ref].data_ptr()
        for at, ref in self._from_allocs:
            args[at] = allocs[ref].data_ptr()
        for at, src in self._copies:
            args[at] = args[src]
        for at, width, kind, ref, recipe, meta in self._descs:
            t = inputs[ref] if kind == _INPUT else allocs[ref]
            memo_key = (at, t.data_ptr())
            encoded = self._memo.get(memo_key)
            if encoded is None:
                encoded = self._encode(recipe[0](base=t, **recipe[1]), meta)
                if len(encoded) != width:
                    raise RuntimeError(f"plan cache: descriptor encoded to {len(encoded)} values")
                if len(self._memo) >= self.MAX_MEMO:
                    self._memo.clear()
                self._memo[memo_key] = encoded
            args[at : at + width] = encoded
        return args


def _launch_compiled(kernel: Any, grid: tuple[int, ...], args: list[Any]) -> None:
    """What `JITFunction.run` does after its cache lookup: the compiled kernel's launcher on the
    current stream, with Triton's launch hooks (profilers) honoured."""
    stream = _current_stream(_current_device())
    g = (tuple(grid) + (1, 1))[:3]
    hooks = _hooks()
    if hooks is None:
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None,
                   None, *args)  # fmt: skip
        return
    meta = kernel.launch_metadata(g, stream, *args)
    kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, meta, *hooks,
               *args)  # fmt: skip


def _hooks() -> tuple[Any, Any] | None:
    """Triton's launch enter/exit hooks, or ``None`` when no hook is registered (Triton 3.6 keeps
    them as always-present `HookChain` objects; an empty chain is no hook, so the launcher is not
    asked to call it and no launch metadata is built)."""
    enter, leave = _knobs.launch_enter_hook, _knobs.launch_exit_hook
    if not getattr(enter, "calls", enter) and not getattr(leave, "calls", leave):
        return None
    return enter, leave


_MISSING = object()


class PlanCache:
    """Plans by call key; past `MAX_PLANS` the oldest is dropped (one dictionary lookup per
    hit, no recency bookkeeping).

    Args:
        max_plans: plans kept.
        enabled: cache at all; default: unless the environment sets ``PORTATTN_PLAN_CACHE=0``.
        guards: let `probe` match a call's tensors by torch's C tensor guards (dynamo's
            `TensorGuards`: type, dispatch keys, device, dtype, sizes, strides, requires_grad)
            and their alignment instead of building its key; default: where this torch has them.

    Raises:
        ValueError: ``guards=True`` on a torch without dynamo's C guards.
    """

    def __init__(
        self, max_plans: int = MAX_PLANS, *, enabled: bool | None = None, guards: bool | None = None
    ):
        if guards and _TensorGuards is None:
            raise ValueError("PlanCache: guards must be False on a torch without TensorGuards")
        self.max_plans = max_plans
        if enabled is None:
            enabled = os.environ.get("PORTATTN_PLAN_CACHE", "1") != "0"
        self._enabled = enabled
        self._guards = _TensorGuards is not None if guards is None else guards
        self._plans: dict[Hashable, Plan | None] = {}
        # (guard, number of tensors) -> [(the tensors' `TensorGuards`, plan, whether the
        # tensors are the first inputs)], newest first (`probe`).
        self._guarded: dict[Hashable, list[tuple[Any, Plan, bool]]] = {}
        self.hits = self.misses = 0

    @property
    def enabled(self) -> bool:
        """Whether calls are cached (fixed at construction)."""
        return self._enabled

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()
        self._guarded.clear()
        self.hits = self.misses = 0

    def probe(
        self, guard: Hashable, tensors: tuple, inputs: Sequence[torch.Tensor | None]
    ) -> tuple | None:
        """The outputs of a guarded plan (``guards``) run on ``inputs``; ``None`` where none fits
        (the caller then builds its key: `hit`, `call`).

        ``guard``: everything of the call's description but its tensors (the op, the current
        device, the target override, every non-tensor argument with its type, and which
        inputs are ``None``), as the op passes it to `call`, which keeps each plan it runs
        under ``guard`` and the guards of ``tensors``: the inputs that are not ``None``, in
        order (`present`). A plan fits when every tensor passes the C guard built from its
        first call's (same Python type, dispatch keys, device, dtype, sizes, strides,
        requires_grad) and all are 16-byte aligned (as a guarded first call's were): the
        description is then equal, so is the key, and the plan is the one `call` would
        run."""
        fit = self._fit(guard, tensors)
        if fit is None or not fit[0].disjoint.check(inputs):
            return None  # an overlapping write goes on to `call`, which plans it and refuses it
        self.hits += 1
        return fit[0].run(inputs, fit[1])

    def prepare(
        self, guard: Hashable, tensors: tuple, inputs: Sequence[torch.Tensor | None]
    ) -> Callable[[], tuple] | None:
        """`probe` in two steps (`Plan.prepare`): the guarded plan's launches made ready for
        ``inputs``, as a callable that launches them and returns the outputs; ``None`` where no
        plan fits or a write overlaps an input (arguments as `probe`'s)."""
        fit = self._fit(guard, tensors)
        if fit is None or not fit[0].disjoint.check(inputs):
            return None
        self.hits += 1
        return fit[0].prepare(inputs, fit[1])

    def guarded(self, guard: Hashable, tensors: tuple) -> Plan | None:
        """`probe`'s plan for ``guard`` and ``tensors`` (not run, not counted); ``None``: none
        fits, or caching or ``guards`` is off."""
        fit = self._fit(guard, tensors)
        return None if fit is None else fit[0]

    def _fit(self, guard: Hashable, tensors: tuple) -> tuple[Plan, tuple | None] | None:
        """`probe`'s plan and, where its tensors are the first inputs (so at its first call,
        and the guard holds which inputs are ``None``), their addresses for its launches."""
        if not self._enabled or not self._guards:
            return None
        try:
            entries = self._guarded.get((guard, len(tensors)))
        except TypeError:  # an unhashable scalar
            return None
        if entries:
            for guards, plan, first in entries:
                if guards.check(*tensors):  # tensors all (not a subclass): their addresses next
                    ptrs = tuple(map(_data_ptr, tensors))
                    if functools.reduce(or_, ptrs) % ALIGN:
                        return None
                    return plan, ptrs if first else None
        return None

    def _keep_guard(self, guard: tuple[Hashable, tuple], inputs: Sequence, plan: Plan) -> None:
        """Keep ``plan`` for `probe` under ``guard`` (the guard and the tensors, as `probe`
        takes them) when the tensors are all tensors, all aligned; noting whether they are
        the first of ``inputs``."""
        scalars, tensors = guard
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            return
        if functools.reduce(or_, map(_data_ptr, tensors)) % ALIGN:
            return
        try:
            guards = _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
            entries = self._guarded.setdefault((scalars, len(tensors)), [])
        except Exception:  # noqa: BLE001 - a guard torch cannot build: no shortcut, no harm
            return
        first = len(tensors) <= len(inputs) and all(map(is_, tensors, inputs))
        entries.insert(0, (guards, plan, first))
        del entries[MAX_GUARDS:]
        evict_oldest(self._guarded, self.max_plans)

    def hit(
        self,
        key: Hashable | None,
        inputs: Sequence[torch.Tensor | None],
        guard: tuple[Hashable, tuple] | None = None,
    ) -> tuple | None:
        """The outputs of ``key``'s cached plan run on ``inputs``; ``None`` where there is no
        replayable plan (none yet, a known unreplayable one, no key, caching off): the caller
        then goes through `call` with its planner, which it need not build on a hit.
        ``guard``: as `call`'s."""
        if key is None or not self._enabled:
            return None
        try:
            cached = self._plans.get(key)
        except TypeError:  # an unhashable value in the key (`call_key`)
            return None
        if cached is None or not cached.disjoint.check(inputs):
            return None
        self.hits += 1
        if guard is not None and self._guards:
            self._keep_guard(guard, inputs, cached)
        return cached.run(inputs)

    def call(
        self,
        key: Hashable | None,
        inputs: Sequence[torch.Tensor | None],
        plan: Callable[[], list[Launch]],
        guard: tuple[Hashable, tuple] | None = None,
    ) -> tuple:
        """Run a call: its cached plan if ``key`` has one, else ``plan()`` (validating), kept
        for the next call with this key. Returns the first launch's outputs. ``guard``:
        `probe`'s guard and tensors; a plan run with them is kept for `probe` too (``None``:
        not)."""
        if key is None or not self._enabled:
            return _run_fresh(plan())
        try:
            cached = self._plans.get(key, _MISSING)
        except TypeError:  # an unhashable value in the key (`call_key`)
            return _run_fresh(plan())
        if cached is not _MISSING:
            if isinstance(cached, Plan) and not cached.disjoint.check(inputs):
                return _run_fresh(plan())  # its validation refuses the overlapping write
            self.hits += 1
            if isinstance(cached, Plan):
                if guard is not None and self._guards:
                    self._keep_guard(guard, inputs, cached)
                return cached.run(inputs)
            return _run_fresh(plan())  # known not to be replayable
        self.misses += 1
        launches = plan()
        try:
            replay: Plan | None = Plan(launches, inputs)
        except _PassedTwice:
            return _run_fresh(launches)  # nothing kept: the next call plans again
        except Uncacheable:
            replay = None
        compiled = [launch.run() for launch in launches]
        if replay is not None:
            replay.keep_compiled(compiled)
            if guard is not None and self._guards:
                self._keep_guard(guard, inputs, replay)
        self._plans[key] = replay
        evict_oldest(self._plans, self.max_plans)
        return launches[0].outputs if launches else ()


class CheckMemo:
    """The descriptions whose argument checks passed, for the calls that cannot skip them by a
    plan-cache hit (an unbounded call checks its arguments before it reads the maxima that pick
    its plan). The checks a memo stands in for read only the description -- types, dtypes,
    devices, shapes and strides (matched by torch's C tensor guards, as `PlanCache.probe`'s),
    the scalars (``scalars``, compared by value) -- and the addresses, through overlap: each
    lookup checks that the writes overlap no other input (`Disjoint`). So a call that matches
    passes those checks again, and what they returned (``value``) holds for it.

    Args:
        max_entries: descriptions kept per ``scalars`` tuple (newest first); past `MAX_PLANS`
            ``scalars`` tuples the oldest is dropped.
    """

    def __init__(self, max_entries: int = MAX_GUARDS):
        self.max_entries = max_entries
        self._seen: dict[Hashable, list[tuple[Any, Disjoint, Any]]] = {}

    def get(self, scalars: Hashable, tensors: tuple, inputs: Sequence) -> Any:
        """What the checks returned for a matching description (``tensors``: the inputs that
        are not ``None``, `present`; ``inputs``: every input, in `keep`'s order); ``None``: no
        description matches, or a write overlaps an input this time (the checks then run)."""
        if _TensorGuards is None:
            return None
        try:
            entries = self._seen.get((scalars, len(tensors)))
        except TypeError:  # an unhashable scalar
            return None
        if entries:
            for guards, disjoint, value in entries:
                if guards.check(*tensors):
                    return value if disjoint.check(inputs) else None
        return None

    def keep(
        self, scalars: Hashable, tensors: tuple, inputs: Sequence, writes: Sequence[int], value
    ) -> None:
        """Remember that the call (``scalars``, ``tensors``, ``inputs`` as `get` takes them)
        passed its checks, returning ``value``; ``writes``: the indices in ``inputs`` of the
        tensors the call writes."""
        if _TensorGuards is None or not all(type(t) is torch.Tensor for t in tensors):
            return
        try:
            guards = _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
            entries = self._seen.setdefault((scalars, len(tensors)), [])
        except Exception:  # noqa: BLE001 - no guard (or an unhashable scalar): no memo, no harm
            return
        entries.insert(0, (guards, Disjoint(writes, inputs), value))
        del entries[self.max_entries :]
        evict_oldest(self._seen, MAX_PLANS)


def _run_fresh(launches: list[Launch]) -> tuple:
    for launch in launches:
        launch.run()
    return launches[0].outputs if launches else ()


#: The process-wide plan cache every op uses.
PLANS = PlanCache()
