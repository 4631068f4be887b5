"""Check a CI image's environment against the backend's constraints file, at image build time.

The kernels are tested with one Triton and one torch per backend; the constraints file
(``constraints/<vendor>.txt``) pins them. A GPU image that ends up with another Triton (the
vendor base image brought its own), another torch, or two distributions of either (an extra
pulled a second torch) fails its build here, naming the package, instead of testing something
else in CI::

    python tools/check_image.py constraints/cuda.txt            # torch and triton
    python tools/check_image.py constraints/rocm.txt --package triton

A pin is compared with the importable module's ``__version__`` without its local part
(``2.10.0+cu128`` is ``2.10.0``; ``3.6.0+rocm7.1`` is ``3.6.0``). Standard library only: it runs
in the image before the project is installed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import sys
from pathlib import Path

_PIN = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*==(?!=)\s*([^\s;#]+)")


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them (``mamba_ssm`` is ``mamba-ssm``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """``name -> version`` of the file's exact pins (``name==version``; comments, markers and
    other specifiers are ignored). Names are normalized (PEP 503)."""
    out = {}
    for line in path.read_text().splitlines():
        m = _PIN.match(line)
        if m:
            out[normalize(m.group(1))] = m.group(2)
    return out


def public(version: str) -> str:
    return version.split("+", 1)[0]


def providers(module: str) -> list[str]:
    """The installed distributions that ship ``module``'s package directory."""
    found = []
    for dist in importlib.metadata.distributions():
        files = dist.files or []
        if any(str(f).replace("\\", "/") == f"{module}/__init__.py" for f in files):
            found.append(f"{dist.metadata['Name']} {dist.version}")
    return sorted(found)


def problems(constraints: Path, packages: list[str]) -> list[str]:
    """What differs from the constraints: each as ``<package>: <what>``."""
    wanted = pins(constraints)
    errors = []
    for name in dict.fromkeys(packages):
        pin = wanted.get(normalize(name))
        if pin is None:
            errors.append(f"{name}: {constraints} pins no version (add '{name}==X')")
            continue
        module = normalize(name).replace("-", "_")  # the import name of a Mamba extension, torch
        owners = providers(module)
        if len(owners) > 1:
            listed = ", ".join(owners)
            errors.append(
                f"{name}: {len(owners)} distributions ship the '{name}' package ({listed}); "
                "one was pulled in beside the base image's"
            )
        try:
            imported = importlib.import_module(module)
        except Exception as exc:  # an import error of any kind is the finding
            errors.append(f"{name}: cannot be imported ({type(exc).__name__}: {exc})")
            continue
        try:  # the module's own version, else its distribution's
            found = str(getattr(imported, "__version__", None) or importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            errors.append(f"{name}: imports as {module} but has no version to compare")
            continue
        if public(found) != public(pin):
            errors.append(
                f"{name}: the image has {found} but {constraints} pins {pin} "
                "(the version the kernels are tested with)"
            )
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check_image.py", description=__doc__.split("\n")[0])
    parser.add_argument("constraints", type=Path, help="the backend's constraints file")
    parser.add_argument(
        "--package",
        action="append",
        dest="packages",
        help="a package to check (repeatable; default: torch and triton)",
    )
    args = parser.parse_args(argv)
    if not args.constraints.is_file():
        parser.error(f"constraints file not found: {args.constraints}")
    try:
        errors = problems(args.constraints, args.packages or ["torch", "triton"])
    except UnicodeDecodeError:
        parser.error(f"constraints file is not UTF-8 text: {args.constraints}")
    for e in errors:
        print(f"check_image: {e}", file=sys.stderr)
    if not errors:
        checked = dict.fromkeys(args.packages or ["torch", "triton"])
        print(f"check_image: {', '.join(checked)} as pinned")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
