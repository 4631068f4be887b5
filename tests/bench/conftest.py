"""The bench tests need the repository's bench/ package. The cell images carry tests/ without it
(.dockerignore): there these modules are not collected, so that any marker selection a cell is
given (a user's ``-m``, the ``gpu`` session) collects the suites instead of failing on import."""

from pathlib import Path

if not (Path(__file__).resolve().parents[2] / "bench" / "__init__.py").is_file():
    collect_ignore_glob = ["*.py"]
