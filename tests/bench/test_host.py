"""The host and cache families' rows on a CPU (interpreter, fp16): every row is checked against
the fp64 reference before it is timed: each host mode (the unbounded and uncached modes run other
host paths than the bounded call), every sequence of a gather. The timer is the device's
business: stood in for here."""

from __future__ import annotations

import torch

from bench import core, host


def _rows(monkeypatch, broken: str | None = None) -> dict[str, dict]:
    monkeypatch.setattr(host, "DTYPE", torch.float16)  # the interpreter's dots: fp16, not bf16
    monkeypatch.setenv("PORTATTN_TARGET", "sm_90")  # the metadata builder's target
    monkeypatch.setattr(host, "host_us", lambda call, calls, repeats: 1.0)
    real_ops = host._ops

    def ops(device):
        found = real_ops(device)
        if broken is not None:  # that op's unbounded call returns zeros (a wrong answer)
            modes, check = found[broken]
            good = modes["unbounded"]
            modes["unbounded"] = lambda: good().zero_()
        return found

    monkeypatch.setattr(host, "_ops", ops)
    child = {op: dict(check=core.not_checked("stand-in"), us=2.0) for op in host.OPS}
    monkeypatch.setattr(host, "_uncached", lambda quick: child)
    ctx = core.Context("cpu", quick=True)
    ctx.only_rows = [f"host {op} " for op in host.OPS]
    return {r["name"]: r for r in host.rows(ctx)}


def test_every_mode_is_checked_before_it_is_timed(monkeypatch):
    rows = _rows(monkeypatch)
    for op in host.OPS:
        for mode in ("cached", "unbounded"):
            r = rows[f"host {op} {mode}"]
            assert r["check"]["passed"] and r["check"]["kind"] == "tolerance", r
            assert r["time_us"] == 1.0
        assert rows[f"host {op} uncached"]["time_us"] == 2.0  # the child's own check and time


def test_a_wrong_unbounded_answer_is_a_failed_row_not_a_time(monkeypatch):
    """The unbounded rows were timed behind the bounded call's check: a path that wrote zeros
    (or NaN) was published as passed, with a time."""
    rows = _rows(monkeypatch, broken="paged_attention")
    bad = rows["host paged_attention unbounded"]
    assert not bad["check"]["passed"] and bad["time_us"] is None
    assert rows["host paged_attention cached"]["check"]["passed"]
    assert rows["host mla_decode unbounded"]["check"]["passed"]


def test_a_gather_wrong_past_its_third_sequence_is_a_failed_row(monkeypatch):
    """The gather and page-index rows checked their first 3 sequences only: a gather that
    zeroed the later ones was timed and shown as exact."""
    import portattn
    from bench import cache

    real = portattn.gather_kv_cache

    def wrong_after_three(kc, vc, table, cu, out=None):
        got = real(kc, vc, table, cu, out=out)
        for t in got:
            t[int(cu[3]) :].zero_()
        return got

    ctx = core.Context("cpu", quick=True)
    assert cache._gather(ctx, "gather", 6, 32, 16)["check"]["passed"]
    monkeypatch.setattr(portattn, "gather_kv_cache", wrong_after_three)
    row = cache._gather(ctx, "gather", 6, 32, 16)
    assert not row["check"]["passed"] and row["time_us"] is None
