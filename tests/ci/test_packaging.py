"""kubematrix as an installed tool: console scripts, the Kubernetes templates as package data, and
the built wheel working in a fresh virtual environment, away from any checkout."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
import yaml
from nox.project import load_toml
from packaging.requirements import Requirement  # tomllib is 3.11+; the project supports 3.10

from kubematrix import buildkite
from kubematrix.matrix import all_cells
from kubematrix.render import default_k8s_dir, load_kustomization, render_job

pytestmark = pytest.mark.ci

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = load_toml(ROOT / "pyproject.toml")
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# What the CI layer needs beside the wheel: PyYAML (a dependency) and the `ci` extra's Kubernetes
# client (as noxfile.py's CI-layer sessions install them).
CI_LAYER_REQUIREMENTS = [
    r
    for r in [
        *PYPROJECT["project"]["dependencies"],
        *PYPROJECT["project"]["optional-dependencies"]["ci"],
    ]
    if r.startswith(("pyyaml", "kubernetes="))
]


def _third_party_imports(code: str) -> set[str]:
    """The distributions whose modules ``code`` loads in a fresh interpreter, beyond those a
    bare interpreter loads (site's .pth hooks), this project's own excepted."""
    probe = (
        "import importlib.metadata as md, sys; before = set(sys.modules); "
        f"{code}; "
        "names = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "dists = md.packages_distributions(); "
        "print('\\n'.join(sorted({d for n in names for d in dists.get(n, ())})))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    ).stdout
    return {d.lower() for d in out.split()} - {"portattn"}


def test_the_kubematrix_command_imports_only_what_the_package_declares():
    """`kubematrix` crashed on a plain install (No module named 'yaml'): PyYAML was only in the
    `ci` extra. The command's modules may import only the package's declared dependencies."""
    declared = {Requirement(r).name.lower() for r in PYPROJECT["project"]["dependencies"]}
    loaded = _third_party_imports("import kubematrix.__main__, kubematrix.render")
    assert loaded and loaded <= declared, loaded - declared


def test_console_scripts_name_callable_entry_points():
    scripts = PYPROJECT["project"]["scripts"]
    assert set(scripts) == {"kubematrix", "portattn-compile"}
    for target in scripts.values():
        module, _, attr = target.partition(":")
        if module.startswith("portattn."):  # importing it imports triton: check the source only
            path = ROOT / "src" / (module.replace(".", "/") + ".py")
            assert f"\ndef {attr}(" in path.read_text(), target
        else:
            assert callable(getattr(importlib.import_module(module), attr)), target


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _sdist_names(tmp_path: Path) -> set[str]:
    """The paths an sdist built from the tracked files of this checkout holds."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")  # fmt: skip
    source = tmp_path / "source"
    for name in filter(None, tracked):
        if (ROOT / name).exists() or (ROOT / name).is_symlink():  # a deletion not committed
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / name).is_symlink():
                (source / name).symlink_to(os.readlink(ROOT / name))
            else:
                shutil.copy(ROOT / name, source / name)
    build = "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run([sys.executable, "-c", build, str(tmp_path / "dist")], source, env)
    (sdist,) = (tmp_path / "dist").glob("portattn-*.tar.gz")
    with tarfile.open(sdist) as tar:
        return {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()}


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the repository's checkout")
def test_the_sdist_holds_the_tree_its_tests_need(tmp_path):
    """The source distribution held the top-level tests without their conftest and helpers:
    it now holds every tracked file (k8s/ as a copy of the templates it links to), so its
    tests run from it."""
    names = _sdist_names(tmp_path)
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()  # fmt: skip
    templates = ROOT / "src" / "kubematrix" / "manifests"
    want = {n for n in tracked if n != "k8s" and (ROOT / n).is_file()}
    want |= {f"k8s/{n}" for n in _files(templates)}
    assert want - names == set()
    built = {"PKG-INFO", "setup.cfg"}  # what building adds: metadata and the egg-info
    extra = {n for n in names - want if n not in built and ".egg-info/" not in n}
    assert extra == set()


def test_templates_are_found_in_the_package(monkeypatch):
    monkeypatch.delenv("KUBEMATRIX_K8S_DIR", raising=False)
    templates = default_k8s_dir()
    assert templates == ROOT / "src" / "kubematrix" / "manifests"
    # the repository's k8s/ is a link to them; an sdist holds their copy there
    assert _files(ROOT / "k8s") == _files(templates)
    for vendor in ("cuda", "rocm"):
        assert [d["kind"] for d in load_kustomization(templates / "overlays" / vendor)].count(
            "Job"
        ) == 1


def test_kubematrix_k8s_dir_overrides_the_packaged_templates(monkeypatch, tmp_path):
    shutil.copytree(ROOT / "src" / "kubematrix" / "manifests", tmp_path / "t")
    job = tmp_path / "t" / "base" / "job.yaml"
    job.write_text(job.read_text().replace('cpu: "4"', 'cpu: "3"'))
    monkeypatch.setenv("KUBEMATRIX_K8S_DIR", str(tmp_path / "t"))
    assert default_k8s_dir() == tmp_path / "t"
    rendered = render_job(vendor="cuda", suite="mla", image="r/i:t", commit=COMMIT)
    assert rendered["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"] == {
        "cpu": "3",
        "memory": "16Gi",
    }


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_kubectl_kustomize_resolves_the_overlays_through_the_k8s_link(vendor):
    """`kubectl apply -k k8s/overlays/<vendor>` (the docs' form) builds what the package holds."""

    def kustomize(path: Path) -> list[dict]:
        out = subprocess.run(
            ["kubectl", "kustomize", str(path)], capture_output=True, text=True, check=True
        ).stdout
        return list(yaml.safe_load_all(out))

    packaged = ROOT / "src" / "kubematrix" / "manifests" / "overlays" / vendor
    assert kustomize(ROOT / "k8s" / "overlays" / vendor) == kustomize(packaged)


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_the_wheel_runs_kubematrix_in_a_fresh_venv_outside_the_checkout(tmp_path, monkeypatch):
    """Build the wheel, install it with only the CI layer's dependencies (no torch, no triton:
    the CI layer never imports them), then list and render from an empty folder, and generate the
    pipeline in a project tree without the kubematrix sources (what an adopting repository holds:
    its Dockerfiles, constraints, tools); the installed tool must give what the source tree gives.
    """
    started = time.monotonic()
    # Build from a copy of what the wheel is made of: no build/ or egg-info in the checkout, and
    # nothing from the repository root (the k8s/ link) can leak in.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    junk = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    shutil.copytree(ROOT / "src", source / "src", ignore=junk)
    dist = tmp_path / "dist"
    monkeypatch.delenv("KUBEMATRIX_K8S_DIR", raising=False)  # both sides use their own templates
    hidden = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")  # nothing may reach the source tree
    env = {k: v for k, v in os.environ.items() if k not in hidden}
    build = "import sys; from setuptools import build_meta; build_meta.build_wheel(sys.argv[1])"
    _run([sys.executable, "-c", build, str(dist)], source, env)
    (wheel,) = dist.glob("portattn-*.whl")
    with zipfile.ZipFile(wheel) as whl:  # the declared licence travels with the package
        licence = [n for n in whl.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        assert licence and b"Apache License" in whl.read(licence[0])

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    py, bindir = venv / "bin" / "python", venv / "bin"
    pip = [str(py), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check"]
    _run([*pip, *CI_LAYER_REQUIREMENTS], tmp_path, env, timeout=300)
    _run([*pip, "--no-deps", str(wheel)], tmp_path, env)
    assert (bindir / "portattn-compile").is_file()  # its matrix needs triton: not run here

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    missing = _run(
        [str(py), "-c", "import importlib.util as u; print(u.find_spec('torch'))"], outside, env
    )
    assert missing.strip() == "None"

    listed = json.loads(_run(["kubematrix", "list", "--json"], outside, env))
    assert [row["cell"] for row in listed] == [c.name for c in all_cells()]

    # The pipeline reads the project's image inputs from the folder it runs in (a CI checkout).
    project = tmp_path / "project"
    project.mkdir()
    for entry in ROOT.iterdir():
        if entry.is_file() and not entry.is_symlink():
            shutil.copy(entry, project / entry.name)
    for folder in ("constraints", "tools", ".buildkite", ".ci"):
        shutil.copytree(ROOT / folder, project / folder, ignore=junk)
    monkeypatch.chdir(ROOT)  # the source tree's pipeline, for comparison
    for lanes in ("queues", "k8s"):
        argv = ["kubematrix", "pipeline", "--lanes", lanes, "--commit", COMMIT, "--format", "json"]
        installed = json.loads(_run(argv, project, env))
        assert installed == json.loads(
            json.dumps(buildkite.generate(lanes=lanes, commit=COMMIT))
        ), lanes

    render = (
        "import json, sys; from kubematrix.render import default_k8s_dir, render_job; "
        "print(json.dumps([str(default_k8s_dir()), render_job(vendor='rocm', suite='mla', "
        f"image='r/portattn-ci:rocm', commit='{COMMIT}', nox_args=['-k', 'decode'])]))"
    )
    k8s_dir, job = json.loads(_run([str(py), "-c", render], outside, env))
    assert Path(k8s_dir).is_relative_to(venv), k8s_dir  # the wheel's templates, not the checkout's
    assert job == render_job(
        vendor="rocm",
        suite="mla",
        image="r/portattn-ci:rocm",
        commit=COMMIT,
        nox_args=["-k", "decode"],
    )
    print(f"wheel built, installed and run in {time.monotonic() - started:.1f} s")


@pytest.mark.parametrize(
    "changed, backends",
    [
        ("src/kubematrix/manifests/base/job.yaml", {"cuda", "rocm"}),
        ("src/kubematrix/manifests/setup/namespace.yaml", {"cuda", "rocm"}),
        ("src/kubematrix/manifests/overlays/rocm/job-patch.yaml", {"rocm"}),
        ("src/kubematrix/manifests/overlays/sm_90/kustomization.yaml", {"cuda"}),
        ("src/kubematrix/manifests/overlays/gfx942/kustomization.yaml", {"rocm"}),
    ],
)
def test_a_template_change_selects_the_gpu_cells_it_concerns(changed, backends):
    """The templates live under src/kubematrix/ but concern only their vendors' GPU cells."""
    assert {c.backend for c in all_cells() if buildkite.is_selected(c, [changed])} == backends
