"""bench/_common.py's save_record: the one JSON record every bench script writes to $OUT."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

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
