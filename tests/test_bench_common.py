"""bench/_common.py's save_record: the one JSON record every bench script writes to $OUT."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "bench_common", Path(__file__).resolve().parents[1] / "bench" / "_common.py"
)
bench_common = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_common)


def test_save_record_writes_fields_and_run_metadata(tmp_path, monkeypatch):
    out = tmp_path / "new" / "dir"  # created on demand
    monkeypatch.setenv("OUT", str(out))
    path = bench_common.save_record("bench_x", rows=[{"us": 1.5}], device="forced")
    assert path == str(out / "bench_x.json")
    rec = json.loads(Path(path).read_text())
    assert rec["rows"] == [{"us": 1.5}]
    assert rec["device"] == "forced"  # a field wins over the metadata of the same name
    assert {"commit", "date", "torch", "triton", "command"} <= rec.keys()
    assert rec["commit"] and rec["torch"]


def test_save_record_without_out_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.chdir(tmp_path)
    assert bench_common.save_record("bench_x", rows=[]) is None
    assert list(tmp_path.iterdir()) == []


def test_set_switch_sets_a_boolean_policy_switch(monkeypatch):
    from portattn.policy import mla as mla_policy

    monkeypatch.setattr(mla_policy, "SM90_ROWS_AHEAD", True)
    bench_common.set_switch(mla_policy, "SM90_ROWS_AHEAD=0")
    assert mla_policy.SM90_ROWS_AHEAD is False
    bench_common.set_switch(mla_policy, "SM90_ROWS_AHEAD=1")
    assert mla_policy.SM90_ROWS_AHEAD is True


@pytest.mark.parametrize(
    ("item", "why"),
    [
        ("SM90_ROWS_AHEAD", "SWITCH=0 or SWITCH=1"),
        ("SM90_ROWS_AHEAD=yes", "SWITCH=0 or SWITCH=1"),
        ("NO_SUCH=1", "not a boolean switch"),
        ("SM90_KERNEL_ARCHS=1", "not a boolean switch"),
    ],
)
def test_set_switch_refuses_what_is_not_a_switch(item, why):
    from portattn.policy import mla as mla_policy

    with pytest.raises(SystemExit, match=why):
        bench_common.set_switch(mla_policy, item)


def test_at_point_ceiling_rescales_the_flops_bound_rows_only():
    """A row bound by flops at both rates moves with the rate; one bound by bytes at both does
    not; one that changes bound takes the new maximum."""
    rows = [
        dict(x_roofline=1.30, roof_bytes=3e9, roof_flops=1e12),  # bytes 1 ms, flops 1.25 / 1.5
        dict(x_roofline=1.10, roof_bytes=6e9, roof_flops=1e12),  # bytes 2 ms: bound by bytes
        dict(x_roofline=1.20, roof_bytes=4e9, roof_flops=1.1e12),  # 1.33 ms; flops 1.375 / 1.65
    ]
    bench_common.at_point_ceiling(rows, 3000.0, 800.0, 666.6666666666666)
    assert rows[0]["x_roofline_point"] == pytest.approx(1.30 * 1.25 / 1.5)
    assert rows[1]["x_roofline_point"] == pytest.approx(1.10)
    assert rows[2]["x_roofline_point"] == pytest.approx(1.20 * 1.375 / 1.65)
    assert all(r["mm_point"] == pytest.approx(666.6666666666666) for r in rows)


def _repo(tmp_path):
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / ".gitignore").write_text("build/\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    return git


def test_git_commit_names_a_clean_tree_by_its_commit(tmp_path):
    git = _repo(tmp_path)
    assert bench_common.git_commit(str(tmp_path)) == git("rev-parse", "--short", "HEAD")


def test_git_commit_names_a_changed_tree_by_its_tree_hash(tmp_path):
    """A tree that differs from HEAD (an edit, a new file; ignored files do not count) is named
    by the tree hash the same files get once committed, and the repository's index is left
    alone."""
    git = _repo(tmp_path)
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "new.py").write_text("y = 3\n")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "out.bin").write_text("ignored\n")
    got = bench_common.git_commit(str(tmp_path))
    assert got.startswith(f"{head}+tree:")
    assert git("diff", "--cached", "--name-only") == ""  # nothing staged in the real index
    git("add", "-A")
    git("commit", "-qm", "two")
    assert git("rev-parse", "HEAD^{tree}").startswith(got.split("+tree:")[1])


def test_git_commit_outside_a_repository_is_unknown(tmp_path):
    assert bench_common.git_commit(str(tmp_path)) == "unknown"


def test_turn_order_rotates_each_round():
    """Each call takes each place in a round once every ``n`` rounds."""
    assert [bench_common.turn_order(3, r) for r in range(4)] == [
        [0, 1, 2],
        [1, 2, 0],
        [2, 0, 1],
        [0, 1, 2],
    ]
    assert bench_common.turn_order(1, 5) == [0]
    for r in range(6):
        assert sorted(bench_common.turn_order(4, r)) == [0, 1, 2, 3]
