"""The suite's timer on a CPU: the row and its anchors timed together, repetition by repetition
(`bench.core.Context.time_together`), and an anchor timed beside its row (`bench.core.Pending`).
The GPU side (graphs, events, the L2 flush) is the device's business."""

from __future__ import annotations

from bench import core


def test_calls_are_timed_in_turn_each_repetition():
    """Every call warms up once, then each repetition runs them all in order: a clock that
    drifts over the run reaches each call's repetitions alike."""
    calls: list[int] = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    got = core.Context("cpu").time_together(fns)
    assert calls == [0, 1, 2] + [0, 1, 2] * 3
    assert len(got) == 3 and all(us >= 0 and "host clock" in how for us, how in got)
    calls.clear()
    core.Context("cpu", quick=True).time_together(fns[:2])
    assert calls == [0, 1, 0, 1]


def test_time_us_is_one_call_timed_alone():
    calls: list[str] = []
    us, how = core.Context("cpu").time_us(lambda: calls.append("x"))
    assert calls == ["x"] * 4 and us >= 0 and how.startswith("host clock")


def test_a_pending_anchor_becomes_an_anchor_with_its_metrics_and_notes():
    p = core.Pending("SDPA cudnn", lambda: None, lambda us: {"TFLOP/s": 2.0 / us}, "expanded")
    assert p.anchor(4.0, "graph, interleaved") == dict(
        name="SDPA cudnn", time_us=4.0, metrics={"TFLOP/s": 0.5},
        note="graph, interleaved; expanded",
    )  # fmt: skip
    assert core.Pending("floor", lambda: None, lambda us: {}).anchor(1.0, "graph")["note"] == (
        "graph"
    )


def test_the_read_ceiling_is_measured_beside_each_row(monkeypatch):
    """It was measured once per size and process: a later row's anchor was an earlier row's
    measurement, where the method says anchors are measured right after their row."""
    made: list[int] = []

    def stream(nbytes, device):
        made.append(nbytes)
        return lambda: None

    monkeypatch.setattr(core, "read_stream", stream)
    ctx = core.Context("cpu")
    first, again = ctx.read_ceiling(10_000), ctx.read_ceiling(900_000)
    assert made == [1 << 20, 1 << 20]  # both at the 1 MB floor, each measured
    assert first["note"].startswith("1048576 bytes read") and again["name"] == first["name"]
