"""Block-size negotiation for a KV-cache group shared by several kernels.

Each op declares the kernel block sizes it supports as a tuple of exact ``int`` sizes and/or
`MultipleOf(n)` rules. In speculative decoding a draft model's paged attention and the target
model's MLA share one KV-cache group, so one block size must satisfy both; declaring a single
exact size (upstream lesson 5) makes that impossible. `select_common_block_size` picks one, or
raises listing every participant's constraint.

Example::

    >>> select_common_block_size(Participant("draft", (MultipleOf(16),)),
    ...                          Participant("target", (MultipleOf(1),)), min_block_size=544)
    544
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from portattn.kernels._checks import Problems
from portattn.platform import is_int


@dataclass(frozen=True)
class MultipleOf:
    """Every positive multiple of ``n`` is supported."""

    n: int

    def __post_init__(self) -> None:
        if not _is_size(self.n):
            kind = ValueError if is_int(self.n) else TypeError
            raise kind(f"MultipleOf: n must be an int >= 1; got {self.n!r}")

    def __contains__(self, size: int) -> bool:
        return size >= 1 and size % self.n == 0

    def __str__(self) -> str:
        return f"MultipleOf({self.n})"


BlockSizeRule = int | MultipleOf


def _is_size(x: object) -> bool:
    """An int >= 1 that is not a bool (``True`` is no block size)."""
    return is_int(x) and x >= 1


@dataclass(frozen=True)
class Participant:
    """One user of the shared KV-cache group and the block sizes it supports."""

    name: str
    supported: Sequence[BlockSizeRule]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"Participant: name must be a non-empty str; got {self.name!r}")
        if not isinstance(self.supported, (list, tuple)):
            raise TypeError(
                f"Participant {self.name!r}: supported must be a list or tuple of rules (ints >= 1 "
                f"or MultipleOf); got {type(self.supported).__name__}"
            )
        if not self.supported:
            raise ValueError(f"Participant {self.name!r}: supported must name at least one rule")
        for rule in self.supported:
            if not (isinstance(rule, MultipleOf) or _is_size(rule)):
                kind = ValueError if is_int(rule) else TypeError
                raise kind(
                    f"Participant {self.name!r}: each rule must be an int >= 1 or MultipleOf; "
                    f"got {rule!r}"
                )
        # a tuple of its own: the caller's list changing later cannot bypass these checks
        object.__setattr__(self, "supported", tuple(self.supported))

    def accepts(self, size: int) -> bool:
        return any(size == r if isinstance(r, int) else size in r for r in self.supported)

    def describe(self) -> str:
        return f"{self.name}: " + " | ".join(str(r) for r in self.supported)


def select_common_block_size(
    *participants: Participant,
    min_block_size: int = 1,
    preferred: int | None = None,
    max_block_size: int = 1 << 16,
) -> int:
    """The block size every participant supports.

    Args:
        participants: the kernels sharing the group.
        min_block_size: the smallest acceptable size (e.g. what a hybrid model's Mamba page needs).
        preferred: returned if every participant accepts it and it is >= ``min_block_size``.
        max_block_size: the largest size that may be returned.

    Returns:
        ``preferred`` if every participant accepts it and it lies in ``[min_block_size,
        max_block_size]``, else the smallest common size in that range.

    Raises:
        TypeError: a participant that is no `Participant` or a size that is no int (every
            problem of the call named in one message).
        ValueError: no participants, a size out of range (every one named in one message), no
            common size (the message lists every constraint), or a search past
            `MAX_CANDIDATES` (only many participants with many coprime rules get there).
    """
    p = Problems("select_common_block_size")  # a TypeError when any problem is one of type
    if not participants:
        p.value("participants must name at least one kernel")
    for i, part in enumerate(participants):
        if not isinstance(part, Participant):
            p.type(f"participants[{i}] must be a Participant; got {type(part).__name__}")
    for name, v, optional in (("min_block_size", min_block_size, False),
                              ("preferred", preferred, True),
                              ("max_block_size", max_block_size, False)):  # fmt: skip
        if (optional and v is None) or _is_size(v):
            continue
        rule = f"{name} must be an int >= 1{' or None' if optional else ''}; got {v!r}"
        if is_int(v):
            p.value(rule)
        else:
            p.type(rule)
    if _is_size(min_block_size) and _is_size(max_block_size) and min_block_size > max_block_size:
        p.value(
            f"min_block_size must be <= max_block_size; got {min_block_size} > {max_block_size}"
        )
    p.raise_if_any()
    if (
        preferred is not None
        and min_block_size <= preferred <= max_block_size
        and all(p.accepts(preferred) for p in participants)
    ):
        return preferred
    common = _smallest_common(participants, min_block_size, max_block_size)
    if common is not None:
        return common
    raise ValueError(
        "select_common_block_size: no block size >= "
        f"{min_block_size} (and <= {max_block_size}) is supported by every participant; "
        "constraints: " + "; ".join(p.describe() for p in participants)
    )


#: The most lcms `_smallest_common` keeps at once: the smallest common size is a weighted hitting
#: set problem in general (participants of coprime rules), so the search is bounded.
MAX_CANDIDATES = 4096


def _undivided(ascending: Sequence[int], name: str | None, high: int = 0) -> list[int]:
    """The values of ``ascending`` that no smaller kept value divides (their multiples cover the
    rest). With a participant's ``name``, more than `MAX_CANDIDATES` kept ends the search."""
    kept: list[int] = []
    for m in ascending:  # ascending: a divisor comes first
        if not any(m % k == 0 for k in kept):
            kept.append(m)
            if name is not None and len(kept) > MAX_CANDIDATES:
                raise ValueError(
                    f"select_common_block_size: the search kept over {MAX_CANDIDATES} candidate "
                    f"lcms at participant {name!r}; lower max_block_size (now {high}) or merge "
                    "rules"
                )
    return kept


def _smallest_common(participants: Sequence[Participant], low: int, high: int) -> int | None:
    """The smallest size in ``[low, high]`` that every participant accepts, or ``None``.

    A common size is an exact rule of some participant, or a multiple of one `MultipleOf` rule
    of each participant, so of their lcm: the candidates are the exact rules and, for each
    choice of one multiple a participant, the lcm's first multiple >= ``low``. The lcms are
    built a participant at a time, keeping only those below the best size found so far (an lcm
    only grows) and none that another kept lcm divides (its multiples are the divisor's too).
    No size is scanned, so the answer costs the same at any bound.
    """
    accepted = lambda s: all(p.accepts(s) for p in participants)  # noqa: E731
    exact = {r for p in participants for r in p.supported if not isinstance(r, MultipleOf)}
    best = min((s for s in exact if low <= s <= high and accepted(s)), default=high + 1)
    lcms = [1]
    for p in participants:
        # a rule whose n another rule's n divides adds no size: drop it before combining
        ns = _undivided(sorted({r.n for r in p.supported if isinstance(r, MultipleOf)}), None)
        grown = sorted({m for m in (math.lcm(a, n) for a in lcms for n in ns) if m < best})
        lcms = _undivided(grown, p.name, high)
    for m in lcms:
        best = min(best, -(-low // m) * m)
    return best if best <= high else None
