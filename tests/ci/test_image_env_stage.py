"""The images' env stage, run without Docker or network: each Dockerfile's ``env`` stage as written
(its COPYs and its install commands), in a fresh venv standing in for the vendor's base image.

What is stood in, and nothing else:

- the base image: a venv holding torch and the vendor's Triton distribution (``triton``;
  ``pytorch-triton-rocm`` on ROCm) at the versions the backend's constraints pin;
- ``/opt/wheels``: the two wheels tools/mamba_wheels.py builds, with the pinned sdists' real
  ``install_requires`` (`SDISTS`, copied from their setup.py) and no compiled code;
- the index (PyPI): a local folder holding one empty wheel per name any command could ask for
  (the extras, nox, torch, ``triton``, and every name the wheels declare or import), at a version
  meeting every specifier; a command that uses the index gets ``--no-index --find-links`` that
  folder, the one change made to the commands besides their paths.

Each stand-in's module imports what the real package imports when imported (`SDISTS`), so the
stage's closing ``python -c "import ... mamba_ssm, causal_conv1d ..."`` fails on a missing
runtime dependency as the image's would, and tools/check_image.py runs as it does in the image.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.ci.test_mamba_wheels import mw  # tools/mamba_wheels.py, loaded by its path

pytestmark = pytest.mark.ci

ROOT = Path(__file__).resolve().parents[2]

#: The pinned sdists: their setup.py's ``install_requires``, and the third-party modules that
#: ``import mamba_ssm`` (with ``selective_scan_interface``) / ``import causal_conv1d`` import
#: outside a ``try/except ImportError`` (their compiled modules aside). A new pin must update this.
SDISTS = {
    "mamba-ssm==2.3.2.post1": (
        ["torch", "packaging", "ninja", "einops", "triton>=3.5.0", "transformers",
         "tilelang==0.1.8", "apache-tvm-ffi<=0.1.9", "quack-kernels>=0.3.4"],
        ["torch", "triton", "einops", "packaging", "transformers", "huggingface_hub"],
    ),
    "causal-conv1d==1.7.0": (["torch", "packaging", "ninja"], ["torch"]),
}  # fmt: skip
#: The base images' Triton distribution (the module is ``triton`` on both).
BASE_TRITON = {"cuda": "triton", "rocm": "pytorch-triton-rocm"}
#: Where the env stage writes, and what stands in for it here (a key of the test's folders).
STAGE_PATHS = {"/opt/wheels": "wheels", "/tmp/image": "image", "/opt/portattn": "portattn"}


def _pins() -> list[str]:
    line = re.search(r"^mamba-extensions = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert line is not None
    return [p.strip(' "') for p in line.group(1).split(",")]


def test_the_stand_in_metadata_is_the_pinned_sdists_and_the_tool_decides_every_requirement():
    """`SDISTS` is of the versions pyproject pins, and tools/mamba_wheels.py either installs each
    requirement the wheels declare or says why not; what they import is installed."""
    assert sorted(SDISTS) == sorted(_pins())
    runtime = {canonicalize_name(Requirement(r).name) for r in mw.RUNTIME_REQUIREMENTS}
    skipped = {canonicalize_name(n) for n in mw.NOT_INSTALLED}
    assert not runtime & skipped
    for requires, imports in SDISTS.values():
        declared = {canonicalize_name(Requirement(r).name) for r in requires}
        assert declared <= runtime | skipped, declared - runtime - skipped
        assert {canonicalize_name(m) for m in imports} <= runtime | {"torch", "triton"}


def _wheel(folder: Path, name: str, version: str, requires=(), module=None, imports=()) -> Path:
    """An installable wheel of ``name==version`` declaring ``requires``; its package ``module``
    (if any) has ``__version__`` and imports ``imports``."""
    dist = re.sub(r"[-_.]+", "_", name).lower()
    files = {}
    if module:
        body = f"__version__ = {version!r}\n" + "".join(f"import {m}\n" for m in imports)
        files[f"{module}/__init__.py"] = body
    info = f"{dist}-{version}.dist-info"
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires)
    )
    files[f"{info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: portattn-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def _env_stage(dockerfile: str) -> tuple[dict[str, str], list[list[str]], str]:
    """The ``env`` stage's ARG defaults, its COPYs (sources then destination; ``--from`` ones
    left out) and its first RUN's shell text, continuation lines joined."""
    text = (ROOT / dockerfile).read_text()
    stage = re.search(r"^FROM \S+ AS env\n(.*?)^FROM ", text, re.M | re.S)
    assert stage is not None, f"{dockerfile}: no env stage"
    body = re.sub(r"\\\n", " ", stage.group(1))
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", body, re.M))
    copies = [line.split() for line in re.findall(r"^COPY (?!--from)(.*)$", body, re.M)]
    run = re.search(r"^RUN (.*)$", body, re.M)
    assert run is not None, f"{dockerfile}: no RUN in the env stage"
    return args, copies, run.group(1)


def _pinned(constraints: Path) -> dict[str, str]:
    """The constraints file's ``name==version`` pins (names normalized)."""
    found = re.findall(r"^\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;#]+)", constraints.read_text(), re.M)
    return {canonicalize_name(name): version for name, version in found}


def _index_version(specifiers: list) -> str:
    """A version meeting every specifier: one they name, else 1.0."""
    named = [Version(s.version) for spec in specifiers for s in spec if "*" not in s.version]
    for v in [*sorted(named, reverse=True), Version("1.0")]:
        if all(spec.contains(v, prereleases=True) for spec in specifiers):
            return str(v)
    raise AssertionError(f"no stand-in version meets {specifiers}")


def _base_venv(folder: Path) -> Path:
    """A venv with no packages but pip (the test's own, linked in: ensurepip takes ~8 s)."""
    try:
        import pip
    except ImportError:
        pip = None
    venv.EnvBuilder(with_pip=pip is None, symlinks=os.name != "nt").create(folder)
    python = folder / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if pip is not None:
        purelib = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        (folder / "pip-only").mkdir()
        (folder / "pip-only" / "pip").symlink_to(Path(pip.__file__).parent)
        (Path(purelib) / "portattn-tests-pip.pth").write_text(str(folder / "pip-only") + "\n")
    return python


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the env stage reads pyproject (tomllib)")
@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_the_env_stage_installs_and_imports_offline(vendor, tmp_path):
    """It failed on `No matching distribution found for packaging` (ninja, tilelang==0.1.8 on a
    base that has packaging): /opt/wheels holds the two wheels only, installed without --no-deps.
    """
    import tomllib

    args, copies, run = _env_stage(f"Dockerfile.{vendor}")
    where = {k: tmp_path / v for k, v in STAGE_PATHS.items()}

    def local(text: str) -> str:
        for path, folder in where.items():
            text = text.replace(path, str(folder))
        return text

    pins = _pinned(ROOT / f"constraints/{vendor}.txt")
    python = _base_venv(tmp_path / "venv")
    base = [
        _wheel(tmp_path / "base", "torch", pins["torch"], module="torch"),
        _wheel(tmp_path / "base", BASE_TRITON[vendor], pins["triton"], module="triton"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.pop("VIRTUAL_ENV", None)
    env |= {
        "PIP_CONFIG_FILE": os.devnull,  # none of this machine's pip settings (an index, links)
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_INPUT": "1",
        "PATH": f"{python.parent}{os.pathsep}{env.get('PATH', '')}",  # `python` is the venv's
    }
    pip = [python, "-m", "pip", "install", "--no-cache-dir", "--no-index", "--no-deps"]
    proc = subprocess.run([*pip, *base], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # /opt/wheels: what tools/mamba_wheels.py builds, with the sdists' declared requirements.
    requirements: list[Requirement] = []
    for pin, (requires, imports) in SDISTS.items():
        name, version = pin.split("==")
        module = name.replace("-", "_")
        _wheel(where["/opt/wheels"], name, version, requires, module, imports)
        requirements += map(Requirement, requires)
    # The index: every name a command of the stage could ask for (what PyPI would have): the
    # extras, nox, torch and Triton, and all the wheels declare or import.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    imported = [m for _, imports in SDISTS.values() for m in imports]
    wanted = [*extras["test"], *extras["hybrid"], *imported, "torch", "triton"]
    requirements += map(Requirement, [*wanted, f"nox=={args['NOX_VERSION']}"])
    specifiers: dict[str, list] = {}
    for r in requirements:
        specifiers.setdefault(canonicalize_name(r.name), []).append(r.specifier)
    for name, specs in specifiers.items():
        pin = [SpecifierSet(f"=={pins[name]}")] if name in pins else []
        _wheel(
            tmp_path / "index", name, _index_version([*specs, *pin]), module=name.replace("-", "_")
        )

    for copy in copies:  # COPY src... dest (the build context is the checkout)
        *sources, dest = copy
        dest_path = Path(local(dest))
        for src in sources:
            target = dest_path / Path(src).name if dest.endswith("/") else dest_path
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / src, target)
    commands = []
    for command in re.split(r"\s&&\s", local(run)):
        if re.match(r"\s*python -m pip install\b", command) and "--no-index" not in command:
            command += f" --no-index --find-links {tmp_path / 'index'}"
        commands.append(command)
    env |= args  # a RUN sees its stage's ARGs as variables
    proc = subprocess.run(
        ["/bin/bash", "-o", "pipefail", "-c", " && ".join(commands)],
        env=env, cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check_image: torch, triton as pinned" in proc.stdout

    listed = subprocess.run(
        [python, "-c", "import importlib.metadata as m, json; print(json.dumps("
         "[[d.metadata['Name'], d.version] for d in m.distributions()]))"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    installed = {canonicalize_name(n): v for n, v in json.loads(listed)}
    for pin in SDISTS:
        name, version = pin.split("==")
        assert installed.get(name) == version, pin
    # What the wheels declare but the image must not get: build tools, unused CUDA-only
    # kernels, and (ROCm) PyPI's triton beside the base's pytorch-triton-rocm.
    unwanted = {"ninja", "tilelang", "apache-tvm-ffi", "quack-kernels"}
    if vendor == "rocm":
        unwanted.add("triton")
    assert not unwanted & set(installed), sorted(unwanted & set(installed))
