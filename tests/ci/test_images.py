"""The CI images: content keys, digest pins, the build-time environment check, the image steps."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kubematrix import buildkite, images
from kubematrix.__main__ import main
from kubematrix.matrix import BACKENDS

pytestmark = pytest.mark.ci

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A copy of what the image keys read (a fake checkout the tests can edit)."""
    for rel in {p for spec in images.IMAGES.values() for p in spec.inputs} | {"pyproject.toml"}:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    return tmp_path


def test_images_are_built_for_every_architecture_of_their_pools():
    assert images.get_image("cuda").gpu_archs == "9.0;10.0"
    assert images.get_image("rocm").gpu_archs == "gfx942;gfx950"
    for vendor, spec in images.IMAGES.items():
        assert len(spec.gpu_archs.split(";")) == len(BACKENDS[vendor].archs)
        text = (ROOT / spec.dockerfile).read_text()
        assert f'ARG GPU_ARCHS="{spec.gpu_archs}"' in text  # a plain docker build agrees


@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_the_content_key_changes_with_every_input_and_nothing_else(checkout, vendor):
    spec = images.get_image(vendor)
    key = images.content_key(vendor, checkout)
    assert key == images.content_key(vendor, checkout) and len(key) == images.KEY_LENGTH
    for rel in spec.inputs:  # a byte anywhere in an input is a new image
        path = checkout / rel
        original = path.read_bytes()
        path.write_bytes(original + b"\n# changed\n")
        assert images.content_key(vendor, checkout) != key, rel
        path.write_bytes(original)
    pyproject = checkout / "pyproject.toml"
    original = pyproject.read_text()
    # pytest's settings do not reach the image; the extras do.
    pyproject.write_text(original.replace('addopts = "-ra', 'addopts = "-rA'))
    assert images.content_key(vendor, checkout) == key
    pyproject.write_text(original.replace('"pytest>=8"', '"pytest>=8.1"'))
    assert images.content_key(vendor, checkout) != key
    pyproject.write_text(original)
    other = "rocm" if vendor == "cuda" else "cuda"
    assert images.content_key(other, checkout) != key


@pytest.mark.parametrize(
    ("env", "value", "message"),
    [
        ("KUBEMATRIX_REGISTRY", "https://reg.example", "must be a registry host[:port][/path]"),
        ("KUBEMATRIX_REGISTRY", "registry.example/Team", "must be a registry host[:port][/path]"),
        ("KUBEMATRIX_REGISTRY", "a b", "must be a registry host[:port][/path]"),
        ("KUBEMATRIX_IMAGE_ROCM", "reg.example/x:{sha}", "may use only {vendor} and {commit}"),
        ("KUBEMATRIX_IMAGE_ROCM", "reg.example/x:{0}", "may use only {vendor} and {commit}"),
        ("KUBEMATRIX_IMAGE_ROCM", "reg.example/x {commit}", "must give an image reference without"),
        ("KUBEMATRIX_IMAGE_ROCM", "::::", "must give an image reference [registry/]path"),
        ("KUBEMATRIX_IMAGE_ROCM", "UPPER/Img:{commit}", "must give an image reference [registry/]"),
        ("KUBEMATRIX_IMAGE_ROCM", "r.io/x:{commit.__class__}", "may use only {vendor} and"),
        ("KUBEMATRIX_IMAGE_ROCM", "r.io/x:{commit[0]}", "may use only {vendor} and {commit}"),
    ],
)  # fmt: skip
def test_image_settings_that_make_no_reference_are_named(env, value, message, monkeypatch):
    """A scheme, a space or an unknown placeholder used to reach every Job's image field (or a
    KeyError traceback): the variable is named before any step or Job is made."""
    monkeypatch.delenv(images.IMAGE_ENV.format(vendor="ROCM"), raising=False)
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=re.escape(f"{env} {message}")):
        images.default_image("rocm", COMMIT)
    monkeypatch.setenv(
        env, "registry.example:5000/team" if "REGISTRY" in env else "r.io/x:{commit}"
    )
    assert images.default_image("rocm", COMMIT).endswith(COMMIT)


def test_a_missing_input_is_named(checkout):
    (checkout / "constraints" / "rocm.txt").unlink()
    with pytest.raises(ValueError, match=r"image inputs missing under .*constraints/rocm.txt"):
        images.content_key("rocm", checkout)


def test_references_use_one_registry_setting(monkeypatch):
    monkeypatch.delenv(images.REGISTRY_ENV, raising=False)
    assert images.env_image("cuda", "k" * 20) == f"ghcr.io/portattn/portattn-ci-env:cuda-{'k' * 20}"
    monkeypatch.setenv(images.REGISTRY_ENV, "registry.example:5000/team/")
    assert (
        images.cell_image("rocm", COMMIT) == f"registry.example:5000/team/portattn-ci:rocm-{COMMIT}"
    )
    # the image every runner gives a cell is the same reference
    monkeypatch.delenv(images.IMAGE_ENV.format(vendor="ROCM"), raising=False)
    assert images.default_image("rocm", COMMIT) == images.cell_image("rocm", COMMIT)


def test_a_base_image_is_refused_until_pinned_by_digest_and_pin_writes_it(checkout):
    dockerfile = checkout / "Dockerfile.cuda"
    text = dockerfile.read_text()
    name, digest = images.split_ref(images.base_ref(text))
    assert name == "pytorch/pytorch:2.10.0-cuda12.8-cudnn9-devel"
    pinned = images.pin(text, DIGEST)
    assert images.is_pinned(pinned) and images.base_ref(pinned) == f"{name}@{DIGEST}"
    assert images.base_ref(images.pin(pinned, "sha256:" + "cd" * 32)).endswith("cd" * 32)
    with pytest.raises(ValueError, match="digest must be sha256:<64 lowercase hex>"):
        images.pin(text, "sha256:abc")
    with pytest.raises(ValueError, match="expected one 'ARG BASE_IMAGE=<image>' line; found 0"):
        images.base_ref("FROM scratch\n")
    # the CLI: check fails until pinned, pin --digest writes the Dockerfile
    args = ["image", "--vendor", "cuda", "--root", str(checkout)]
    assert main(["image", "check", *args[1:]]) == (0 if digest else 1)
    assert main(["image", "pin", *args[1:], "--digest", DIGEST]) == 0
    assert images.is_pinned(dockerfile.read_text())
    assert main(["image", "check", *args[1:]]) == 0


def test_an_unpinned_base_gets_an_image_step_that_refuses_by_name(checkout):
    step = buildkite.image_step("rocm", lanes="queues", commit=COMMIT, root=str(checkout))
    assert step["command"].endswith("exit 1")
    assert "Dockerfile.rocm: BASE_IMAGE rocm/pytorch:" in step["command"]
    assert "kubematrix image pin --vendor rocm" in step["command"]
    proc = subprocess.run(["bash", "-c", step["command"]], capture_output=True, text=True)
    assert proc.returncode == 1 and "not pinned by digest" in proc.stderr


@pytest.mark.parametrize("lanes", buildkite.LANES)
def test_a_pinned_base_gets_the_build_or_reuse_script(checkout, lanes):
    df = checkout / "Dockerfile.cuda"
    df.write_text(images.pin(df.read_text(), DIGEST))
    key = images.content_key("cuda", checkout)
    step = buildkite.image_step("cuda", lanes=lanes, commit=COMMIT, root=str(checkout))
    env, cell = images.env_image("cuda", key), images.cell_image("cuda", COMMIT)
    assert step["key"] == "image-cuda" and step["env"] == {"KUBEMATRIX_IMAGE_KEY": key}
    command = step["command"]
    assert command.count("--target env") + command.count("target=env") == 1
    assert f"ENV_IMAGE={env}" in command and cell in command
    if lanes == "queues":
        # the env image is reused when the registry has its content key, else built
        assert f"docker buildx imagetools inspect {env}" in command.splitlines()[1]
        assert step["agents"] == {"queue": buildkite.DEFAULT_IMAGE_QUEUE}
    else:
        assert "buildctl-daemonless.sh build" in command and f"ref={env}-cache" in command
        plugin = step["plugins"][0]["kubernetes"]
        # the builder runs the step's script itself under agent-stack-k8s's interposer
        assert plugin["commandParams"] == {"interposer": "buildkite"}
        (container,) = plugin["podSpec"]["containers"]
        assert container["command"] == [command] and "args" not in container
    proc = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr  # the script is valid shell


def test_image_command_prints_the_content_key_and_both_references(checkout, capsys):
    assert main(["image", "key", "--vendor", "rocm", "--root", str(checkout)]) == 0
    assert capsys.readouterr().out.strip() == images.content_key("rocm", checkout)
    args = ["image", "refs", "--vendor", "rocm", "--root", str(checkout), "--commit", COMMIT]
    assert main(args) == 0
    env, cell = capsys.readouterr().out.split()
    assert env.endswith(images.content_key("rocm", checkout)) and cell.endswith(COMMIT)
    for bad in ("a b", "x" * 128, "a:b", "a/b"):  # no Docker tag: nothing printed, exit 2
        assert main([*args[:-2], f"--commit={bad}"]) == 2
        out = capsys.readouterr()
        assert (
            out.out == ""
            and "commit must make the image tag <vendor>-<commit> a Docker tag" in (out.err)
        )


@pytest.mark.parametrize(
    ("action", "option", "rule"),
    [
        ("key", ["--digest", DIGEST], "--digest applies to pin only; got it with key"),
        ("key", ["--builder", "buildkit"], "--builder applies to script only; got it with key"),
        ("refs", ["--builder", "docker"], "--builder applies to script only; got it with refs"),
        ("key", ["--commit", COMMIT], "--commit applies to refs and script only; got it with key"),
        ("check", ["--digest", DIGEST], "--digest applies to pin only; got it with check"),
    ],
)  # fmt: skip
def test_an_option_the_action_does_not_use_is_refused(action, option, rule, checkout, capsys):
    """It was ignored with exit 0 (``image key --digest ...`` printed the key)."""
    assert main(["image", action, "--vendor", "cuda", "--root", str(checkout), *option]) == 2
    out = capsys.readouterr()
    assert out.out == "" and rule in out.err


# -- tools/check_image.py: the image build's torch / Triton check -------------------------------


def _check(tmp_path: Path, text: str, *extra: str) -> subprocess.CompletedProcess:
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(text)
    cmd = [sys.executable, str(ROOT / "tools" / "check_image.py"), str(constraints), *extra]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_check_image_passes_the_environment_it_was_pinned_to(tmp_path):
    import torch
    import triton

    pins = f"torch=={torch.__version__}\ntriton=={triton.__version__}  # tested\n"
    proc = _check(tmp_path, pins)
    assert proc.returncode == 0, proc.stderr
    assert "torch, triton as pinned" in proc.stdout


def test_check_image_fails_the_build_by_name(tmp_path):
    import torch

    proc = _check(tmp_path, f"torch=={torch.__version__}\ntriton==3.5.1\n")
    assert proc.returncode == 1
    assert "check_image: triton: the image has 3.6.0 but" in proc.stderr
    assert "pins 3.5.1 (the version the kernels are tested with)" in proc.stderr
    proc = _check(tmp_path, "triton>=3\n", "--package", "triton")
    assert proc.returncode == 1 and "triton: " in proc.stderr and "pins no version" in proc.stderr


def test_check_image_takes_a_package_under_any_spelling_of_its_name(tmp_path):
    """A distribution whose import name differs (``jsonschema-specifications`` imports as
    ``jsonschema_specifications``, as ``mamba-ssm`` as ``mamba_ssm``) is found under either
    spelling, its version from its metadata where the module has no ``__version__``; an
    ``===`` pin is no ``==`` pin; a non-UTF-8 file is named."""
    import importlib.metadata

    version = importlib.metadata.version("jsonschema-specifications")
    for spelling in (
        "jsonschema_specifications",
        "jsonschema-specifications",
        "Jsonschema.Specifications",
    ):
        proc = _check(tmp_path, f"jsonschema-specifications=={version}\n", "--package", spelling)
        assert proc.returncode == 0, (spelling, proc.stderr)
    proc = _check(tmp_path, "torch===2.13.0\n", "--package", "torch")
    assert proc.returncode == 1 and "pins no version" in proc.stderr
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe")
    cmd = [sys.executable, str(ROOT / "tools" / "check_image.py"), str(tmp_path / "bin.txt")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2 and "is not UTF-8 text" in proc.stderr


def test_constraints_pin_the_triton_the_cpu_sessions_test_with():
    from nox.project import load_toml

    for vendor, spec in images.IMAGES.items():
        text = (ROOT / spec.constraints).read_text()
        assert "triton==3.6.0" in text.split(), vendor
        assert "torch==" in text, vendor
    deps = load_toml(ROOT / "pyproject.toml")["project"]["dependencies"]
    assert not [d for d in deps if "==" in d], deps  # the library declares ranges only


# -- the `kubematrix image` command's bad inputs: one line naming the file, exit 2 --------------


@pytest.mark.parametrize("action", ["check", "pin"])
@pytest.mark.parametrize(
    ("root", "message"),
    [
        ("missing", "--root {root} does not exist: point it at a checkout"),
        ("empty", "{root}/Dockerfile.cuda does not exist: point --root at a checkout"),
        ("a-file", "--root {root} is not a folder: point it at a checkout"),
        ("folder-named-dockerfile", "{root}/Dockerfile.cuda is a folder, not a file"),
    ],
)
def test_check_and_pin_name_a_root_that_is_no_checkout(tmp_path, action, root, message):
    """A missing root, one without the Dockerfile, a file, or a folder named like the Dockerfile:
    exit 2 and one line (`key` and `refs` did so already), never a traceback."""
    path = tmp_path / root
    if root == "empty":
        path.mkdir()
    elif root == "a-file":
        path.write_text("")
    elif root == "folder-named-dockerfile":
        (path / "Dockerfile.cuda").mkdir(parents=True)
    cmd = [sys.executable, "-m", "kubematrix", "image", action, "--vendor", "cuda"]
    pin_digest = ["--digest", DIGEST] if action == "pin" else []
    proc = subprocess.run([*cmd, "--root", str(path), *pin_digest], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("kubematrix image: ")
    assert message.format(root=path) in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"FROM scratch\n", "Dockerfile.cuda: expected one 'ARG BASE_IMAGE=<image>' line; found 0"),
        (b"ARG BASE_IMAGE=a\nARG BASE_IMAGE=b\n", "Dockerfile.cuda: expected one 'ARG BASE_IMAGE"),
        (b"\x7fELF\x02\x01\x01\x00\xd0\xff\n", "Dockerfile.cuda is not UTF-8 text"),
    ],
)  # fmt: skip
def test_check_names_a_dockerfile_without_its_base_line_or_not_text(
    checkout, content, message, capsys
):
    (checkout / "Dockerfile.cuda").write_bytes(content)
    for action in ("check", "pin"):
        argv = ["image", action, "--vendor", "cuda", "--root", str(checkout)]
        argv += ["--digest", DIGEST] if action == "pin" else []
        assert main(argv) == 2
        out = capsys.readouterr()
        assert out.out == "" and f"kubematrix image: {checkout}/{message}" in out.err, out.err
    assert (checkout / "Dockerfile.cuda").read_bytes() == content  # pin wrote nothing
    # the pipeline's image step reads it the same way
    with pytest.raises(ValueError, match=re.escape(message)):
        buildkite.image_step("cuda", lanes="queues", commit=COMMIT, root=str(checkout))


@pytest.mark.parametrize("option", ["--digest", "--root", "--commit"])
def test_an_empty_value_is_refused_not_replaced_by_the_default(checkout, option, capsys):
    """`pin --digest ""` used to ask the registry, `--root ""` to read the current folder,
    `--commit ""` to take HEAD."""
    before = (checkout / "Dockerfile.cuda").read_bytes()
    action = "refs" if option == "--commit" else "pin"
    argv = ["image", action, "--vendor", "cuda", "--root", str(checkout), option, ""]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert f"argument {option}: must not be empty" in capsys.readouterr().err
    assert (checkout / "Dockerfile.cuda").read_bytes() == before


def test_the_content_key_names_its_root_a_missing_pyproject_and_a_file_not_text(checkout):
    (checkout / "pyproject.toml").unlink()
    with pytest.raises(ValueError, match=rf"missing under {re.escape(str(checkout))}: pyproject"):
        images.content_key("cuda", checkout)
    (checkout / "pyproject.toml").write_text("[project\n")
    with pytest.raises(ValueError, match=r"pyproject.toml is not valid TOML"):
        images.content_key("cuda", checkout)
    (checkout / "constraints" / "cuda.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=r"constraints/cuda.txt is not UTF-8 text"):
        images.pinned_version("cuda", "triton", checkout)


@pytest.mark.parametrize(
    ("output", "exit_code", "message"),
    [
        ('{"mediaType": "x"}', 0, "expected a manifest with a sha256 digest; got '{\"mediaType\""),
        ("notjson", 0, "expected a manifest with a sha256 digest; got 'notjson'"),
        ('{"digest": "sha256:zz"}', 0, "expected a manifest with a sha256 digest"),
        ("", 1, "docker buildx imagetools inspect r.io/x:1: denied"),
    ],
)  # fmt: skip
def test_pin_names_docker_when_its_answer_is_no_digest(output, exit_code, message, tmp_path,
                                                       monkeypatch):  # fmt: skip
    """A docker (stand-in on PATH) whose answer holds no digest: one error naming the command
    and what it printed (a KeyError traceback, or json's own words, before)."""
    docker = tmp_path / "docker"
    docker.write_text(f"#!/bin/sh\nprintf '%s' '{output}'\necho denied >&2\nexit {exit_code}\n")
    docker.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(RuntimeError, match=re.escape(message)):
        images.resolve_digest("r.io/x:1")
    good = '{"digest": "sha256:' + "ab" * 32 + '"}'
    docker.write_text(f"#!/bin/sh\nprintf '%s' '{good}'\n")
    assert images.resolve_digest("r.io/x:1") == "sha256:" + "ab" * 32


def _cell_stage_copies(dockerfile: Path) -> list[tuple[list[str], str]]:
    """The build-context COPY lines of a Dockerfile's ``cell`` stage: (sources, destination)."""
    lines = dockerfile.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.search(r"\bAS cell\b", line))
    copies = []
    for line in lines[start + 1 :]:
        if line.startswith("FROM "):
            break
        if line.startswith("COPY ") and "--from" not in line:
            *sources, dest = line.split()[1:]
            copies.append((sources, dest))
    return copies


@pytest.mark.parametrize("vendor", ("cuda", "rocm"))
def test_the_cell_image_tree_builds_and_collects_under_any_marker(vendor, tmp_path):
    """The cell stage's files, as its COPY lines take them from the build context: the project
    installs from them (LICENSE is pyproject's licence file), and pytest collects a selection
    that is not a suite's own (the ``gpu`` session's ``-m gpu``, a user's ``-m`` ANDed in).
    tests/bench imports bench/, which the images leave out: it failed that collection."""
    ignored = {line.strip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()}
    tree = tmp_path / "opt" / "portattn"
    for sources, dest in _cell_stage_copies(ROOT / f"Dockerfile.{vendor}"):
        for src in sources:
            assert src.split("/")[0] not in ignored, src  # in the build context
            target = tree / dest / (Path(src).name if dest.endswith("/") else "")
            if (ROOT / src).is_dir():
                shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / src, target)
    assert not (tree / "bench").exists() and (tree / "tests" / "bench").is_dir()
    licence = re.search(r"license-files\s*=\s*\[([^\]]*)\]", (tree / "pyproject.toml").read_text())
    assert licence is not None
    for name in re.findall(r'"([^"]+)"', licence.group(1)):
        assert (tree / name).is_file(), f"pyproject's license-files {name!r} is not in the image"
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}  # the image pip-installs the project
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
           "--ignore=tests/ci", "-m", "gpu"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " collected" in proc.stdout and "error" not in proc.stdout.splitlines()[-1]
