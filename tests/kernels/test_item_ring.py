"""The sm_90 prefill kernel's item ring (`portattn.kernels.paged_prefill_sm90`, `_claim_item` /
`_receive_item`) as a model of its partitions' rules, run over random interleavings on the CPU.

The producer writes item ``s``'s slot once it has issued item ``s-1``'s last tile, and issues
global tile ``g`` only after every consumer warpgroup released tile ``g - STAGES``. A warpgroup
reads item ``s``'s slot before its first tile, and releases each tile after it (lag 0), or
during the next tile of the item and the item's last at its end (lag 2: ``LATE_RELEASE``).
Every item has at least one tile (`_item_at`). The ring has ``STAGES + ITEM_RING_EXTRA`` slots:
a write must never land on a slot some warpgroup has not read yet. The model finds such writes
with fewer slots, so it can fail."""

from __future__ import annotations

import random

import pytest

from portattn.kernels.paged_prefill_sm90 import ITEM_RING_EXTRA

pytestmark = pytest.mark.paged


class Overwrite(AssertionError):
    pass


def run(tiles: list[int], stages: int, lag: int, ring: int, seed: int, warpgroups: int = 2):
    """One random interleaving to the end; raises `Overwrite` at a write onto an unread slot."""
    rnd = random.Random(seed)
    n = len(tiles)
    first = [sum(tiles[:s]) for s in range(n + 1)]  # each item's first global tile
    written, issued, p_item, p_tile = -1, 0, 0, 0  # the producer
    wgs = [dict(read=-1, t=0, held=None, released=0) for _ in range(warpgroups)]
    while True:
        acts = []
        if written < p_item <= n and (p_item == 0 or p_tile == 0):
            acts.append(("write", None))
        elif written == p_item < n:
            g = issued
            if g < stages or min(w["released"] for w in wgs) >= g - stages + 1:
                acts.append(("issue", None))
        for w in wgs:
            s = w["read"]
            if s == n:
                continue  # read the stop
            if s >= 0 and w["t"] < tiles[s]:
                if first[s] + w["t"] < issued:
                    acts.append(("tile", w))
            elif s >= 0 and w["held"] is not None:
                acts.append(("end", w))
            elif written >= s + 1:
                acts.append(("read", w))
        if not acts:
            break
        kind, w = rnd.choice(acts)
        if kind == "write":
            if p_item >= ring and any(x["read"] < p_item - ring for x in wgs):
                raise Overwrite(p_item)
            written = p_item
        elif kind == "issue":
            issued += 1
            p_tile += 1
            if p_tile == tiles[p_item]:
                p_item, p_tile = p_item + 1, 0
        elif kind == "read":
            w["read"], w["t"] = w["read"] + 1, 0
        elif kind == "tile":
            g = first[w["read"]] + w["t"]
            if lag == 0:
                w["released"] = g + 1
            else:
                if w["held"] is not None:
                    w["released"] = w["held"] + 1
                w["held"] = g
            w["t"] += 1
        else:  # the item's last tile, released at its end
            w["released"], w["held"] = w["held"] + 1, None
    assert all(w["read"] == n for w in wgs), "a partition never reached the stop"


def _items(seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.choice([1, 1, 1, 2, 3, 8]) for _ in range(rnd.randint(1, 40))]


@pytest.mark.parametrize(("stages", "lag", "warpgroups"), [(2, 0, 2), (3, 2, 2), (4, 0, 3)])
def test_the_ring_is_never_overwritten_before_it_is_read(stages, lag, warpgroups):
    for seed in range(200):
        run(_items(seed), stages, lag, stages + ITEM_RING_EXTRA.value, seed, warpgroups)


@pytest.mark.parametrize(("stages", "lag"), [(2, 0), (3, 2)])
def test_a_ring_of_stages_slots_is_overwritten(stages, lag):
    """The model can fail: with ``STAGES`` slots some interleaving writes onto an unread slot."""
    with pytest.raises(Overwrite):
        for seed in range(200):
            run(_items(seed), stages, lag, stages, seed)
