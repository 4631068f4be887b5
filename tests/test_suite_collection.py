"""A suite's run imports only the test modules that write its marker (`tests/conftest.py`,
``pytest_ignore_collect``): this holds every collected test to that rule, so no suite test is
ever left out of its cell."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import SUITE_MARKERS

ROOT = Path(__file__).resolve().parents[1]

# Collects the whole tree (no -m: nothing is ignored) and writes each module's markers.
_DUMP = textwrap.dedent(
    """
    import json, sys
    import pytest

    class Dump:
        def pytest_collection_finish(self, session):
            found = {}
            for item in session.items:
                found.setdefault(str(item.path), set()).update(m.name for m in item.iter_markers())
            with open(sys.argv[1], "w") as f:
                json.dump({k: sorted(v) for k, v in found.items()}, f)

    sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                         plugins=[Dump()]))
    """
)


def _markers_by_module(tmp_path: Path) -> dict[str, list[str]]:
    out = tmp_path / "markers.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", _DUMP, str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return json.loads(out.read_text())


def test_every_suite_test_writes_its_marker_in_its_module(tmp_path):
    found = _markers_by_module(tmp_path)
    assert len(found) > 30  # the whole tree was collected
    missing = [
        f"{Path(path).relative_to(ROOT)}: {suite}"
        for path, markers in found.items()
        for suite in SUITE_MARKERS
        if suite in markers and f"mark.{suite}" not in Path(path).read_text()
    ]
    assert not missing, f"tests carry a suite marker their module never writes: {missing}"
    for suite in SUITE_MARKERS:
        assert any(suite in markers for markers in found.values()), suite


def test_suite_markers_are_the_matrix_pytest_suites():
    from kubematrix.matrix import SUITES

    assert set(SUITE_MARKERS) == {s for s in SUITES if s != "compile"}


def test_the_xdist_controller_of_a_cell_does_not_import_torch():
    """A cell's pytest-xdist controller only hands out tests: importing torch there (and asking
    for a GPU) would add seconds to every cell's start before any worker exists."""
    code = textwrap.dedent(
        """
        import sys, types
        import tests.conftest as conftest
        config = types.SimpleNamespace(option=types.SimpleNamespace(numprocesses=8))
        conftest.pytest_configure(config)
        assert conftest._is_xdist_controller(config)
        print(sorted(m for m in ("torch", "triton", "portattn") if m in sys.modules))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"
