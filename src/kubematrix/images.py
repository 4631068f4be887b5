"""The CI images: what goes into each vendor's image, its content key, and how CI builds it.

Each Dockerfile has two stages. ``env`` is everything but the project: the vendor's PyTorch base
(pinned by digest), the Mamba extensions built for the backend's architectures, every extra the
suites need under the backend's constraints, nox, and a build-time check that the Triton and
torch in it are the ones the constraints name. ``cell`` is ``env`` plus this commit's project
(``pip install --no-deps``), and is what a GPU step runs.

``env`` is keyed by a hash of what goes into it (:func:`content_key`), so an unchanged
environment is pulled, not rebuilt; ``cell`` is a thin layer per commit
(``<registry>/portattn-ci:<vendor>-<commit>``, the launcher's default image). The registry is one
setting, ``$KUBEMATRIX_REGISTRY``. Pure: nothing here runs docker or talks to a registry; the
build commands are returned as shell text for a pipeline step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import string
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kubematrix import checkout
from kubematrix.matrix import BACKENDS, image_inputs

REGISTRY_ENV = "KUBEMATRIX_REGISTRY"
DEFAULT_REGISTRY = "ghcr.io/portattn"
ENV_REPOSITORY = "portattn-ci-env"
CELL_REPOSITORY = "portattn-ci"
#: Per-vendor override of the image a GPU cell runs (a template: ``{vendor}``, ``{commit}``).
IMAGE_ENV = "KUBEMATRIX_IMAGE_{vendor}"
ENV_TARGET, CELL_TARGET = "env", "cell"
KEY_LENGTH = 20  # hex digits of the content key in the env image's tag
# The pyproject.toml tables that reach the env image (the rest of the file does not).
_PYPROJECT_TABLES = (
    ("project", "dependencies"),
    ("project", "optional-dependencies"),
    ("tool", "portattn", "mamba-extensions"),
)
# The extras the GPU suites import (pytest plugins, hypothesis; transformers for hybrid).
IMAGE_EXTRAS = ("test", "hybrid")


@dataclass(frozen=True)
class ImageSpec:
    """One vendor's image: its Dockerfile, constraints and the architectures it is built for."""

    vendor: str
    dockerfile: str
    constraints: str

    @property
    def gpu_archs(self) -> str:
        """The native builds' architecture list (``9.0;10.0``, ``gfx942;gfx950``): every arch of
        the backend's pools, in matrix order."""
        return ";".join(a.build_arch for a in BACKENDS[self.vendor].archs)

    @property
    def inputs(self) -> tuple[str, ...]:
        """The files hashed into the content key (besides pyproject's dependency tables)."""
        return image_inputs(self.vendor)


IMAGES: dict[str, ImageSpec] = {v: ImageSpec(v, *image_inputs(v)[:2]) for v in ("cuda", "rocm")}


def get_image(vendor: str) -> ImageSpec:
    if vendor not in IMAGES:
        raise ValueError(f"images: vendor must be one of {sorted(IMAGES)}; got {vendor!r}")
    return IMAGES[vendor]


#: A registry and repository prefix as an image reference starts: ``host[:port][/path]``
#: (Docker's reference grammar: no scheme, lowercase path components).
_HOST = (
    r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*(:[0-9]+)?"
)
REGISTRY = re.compile(_HOST + r"(/[a-z0-9]+([._-][a-z0-9]+)*)*")


#: A whole image reference: ``[registry/]path[:tag][@algorithm:hex]`` (Docker's reference
#: grammar: lowercase path components joined by ``.``, ``_``, ``__`` or dashes).
IMAGE_REF = re.compile(
    r"(" + _HOST + r"/)?"
    r"[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*(/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*"
    r":[0-9a-fA-F]{32,})?"
)


def registry() -> str:
    """``$KUBEMATRIX_REGISTRY`` (no trailing slash), else :data:`DEFAULT_REGISTRY`.

    Raises:
        ValueError: naming the variable, when it is no ``host[:port][/path]`` (a scheme, a
            space, an uppercase path).
    """
    value = os.environ.get(REGISTRY_ENV, "").strip().rstrip("/")
    if value and not REGISTRY.fullmatch(value):
        raise ValueError(
            f"{REGISTRY_ENV} must be a registry host[:port][/path] as image references start "
            f"(no scheme, lowercase path); got {value!r}"
        )
    return value or DEFAULT_REGISTRY


def read_text(path: Path) -> str:
    """An input file's text.

    Raises:
        ValueError: naming the file, when it is missing, a folder, unreadable or not UTF-8 text.
    """
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a folder, not a file") from None
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(f"{path} does not exist") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it: {exc.strerror}") from None


def _pyproject_part(root: Path) -> object:
    """pyproject.toml's dependency tables; on Python 3.10 (no tomllib) the whole file."""
    text = read_text(root / "pyproject.toml")
    try:
        import tomllib
    except ModuleNotFoundError:
        return text
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{root / 'pyproject.toml'} is not valid TOML: {exc}") from None
    part = {}
    for keys in _PYPROJECT_TABLES:
        node = data
        for k in keys:
            node = node.get(k, {}) if isinstance(node, dict) else {}
        part[".".join(keys)] = node
    return part


def content_key(vendor: str, root: str | os.PathLike[str] = ".") -> str:
    """A hash of everything that goes into ``vendor``'s env image: its input files' bytes,
    pyproject's dependency tables (canonical JSON) and the architecture list.

    Raises:
        ValueError: an input file is missing (named, with the root it was looked for under).
    """
    spec, base = get_image(vendor), Path(root)
    digest = hashlib.sha256()
    missing = [p for p in (*spec.inputs, "pyproject.toml") if not (base / p).is_file()]
    if missing:
        raise ValueError(
            f"content_key: image inputs missing under {os.path.abspath(base)}: "
            f"{', '.join(missing)} (run it in a checkout of the project, or point --root at one)"
        )
    for rel in spec.inputs:
        digest.update(rel.encode() + b"\0" + (base / rel).read_bytes() + b"\0")
    digest.update(json.dumps(_pyproject_part(base), sort_keys=True).encode() + b"\0")
    digest.update(f"GPU_ARCHS={spec.gpu_archs}".encode())
    return digest.hexdigest()[:KEY_LENGTH]


def pinned_version(vendor: str, package: str, root: str | os.PathLike[str] = ".") -> str:
    """The version ``constraints/<vendor>.txt`` pins ``package`` to (``triton`` -> ``3.6.0``).

    Raises:
        ValueError: the constraints file does not pin ``package`` with ``==`` (named).
    """
    path = Path(root) / get_image(vendor).constraints
    pattern = re.compile(rf"^\s*{re.escape(package)}\s*==\s*([^\s;#]+)", re.IGNORECASE)
    for line in read_text(path).splitlines():
        match = pattern.match(line)
        if match:
            return match.group(1)
    raise ValueError(f"pinned_version: {path} must pin {package} with '=='; it does not")


#: Docker's tag grammar (the reference's ``tag`` rule of the distribution spec).
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def env_image(vendor: str, key: str, reg: str | None = None) -> str:
    return f"{reg or registry()}/{ENV_REPOSITORY}:{get_image(vendor).vendor}-{key}"


def cell_image(vendor: str, commit: str, reg: str | None = None) -> str:
    """The image a GPU cell of ``commit`` runs: the env image plus the commit's project.

    Raises:
        ValueError: ``<vendor>-<commit>`` is no Docker tag (`TAG`), e.g. a commit with a space.
    """
    tag = f"{get_image(vendor).vendor}-{commit}"
    if not isinstance(commit, str) or not TAG.fullmatch(tag):
        raise ValueError(
            f"commit must make the image tag <vendor>-<commit> a Docker tag ({TAG.pattern}); "
            f"got {commit!r}"
        )
    return f"{reg or registry()}/{CELL_REPOSITORY}:{tag}"


def default_image(vendor: str, commit: str) -> str:
    """The image every runner gives a GPU cell of ``commit`` (the launcher, Buildkite's k8s lane):
    ``$KUBEMATRIX_IMAGE_<VENDOR>`` (``{commit}`` and ``{vendor}`` are filled in), else the cell
    image the pipeline's image step pushes (:func:`cell_image`)."""
    name = IMAGE_ENV.format(vendor=vendor.upper())
    template = os.environ.get(name)
    if template:
        try:
            # plain fields only: a format's attribute or index lookups ({commit.x}) are refused
            fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
            unknown = [f for f in fields if f not in ("vendor", "commit")]
            if unknown:
                raise KeyError(unknown[0])
            image = template.format(vendor=vendor, commit=commit)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"{name} may use only {{vendor}} and {{commit}}; got {template!r} ({exc!r})"
            ) from None
        if any(c.isspace() for c in image):
            raise ValueError(f"{name} must give an image reference without spaces; got {image!r}")
        if not IMAGE_REF.fullmatch(image):
            raise ValueError(
                f"{name} must give an image reference [registry/]path[:tag][@digest] "
                f"(lowercase path); got {image!r}"
            )
        return image
    return cell_image(vendor, commit)


def _build_args(spec: ImageSpec) -> list[str]:
    return ["--build-arg", f"GPU_ARCHS={spec.gpu_archs}"]


def docker_build_script(vendor: str, key: str, commit: str, reg: str | None = None) -> str:
    """The image step on a docker-capable agent: pull-or-build the env image, then the cell.

    The env image is built only when the registry has no image under its content key.
    """
    spec = get_image(vendor)
    env, cell = env_image(vendor, key, reg), cell_image(vendor, commit, reg)
    build_env = shlex.join(
        ["docker", "buildx", "build", "--file", spec.dockerfile, "--target", ENV_TARGET]
        + _build_args(spec)
        + ["--tag", env, "--push", "."]
    )
    build_cell = shlex.join(
        ["docker", "buildx", "build", "--file", spec.dockerfile, "--target", CELL_TARGET]
        + ["--build-arg", f"ENV_IMAGE={env}", "--tag", cell, "--push", "."]
    )
    return "\n".join(
        [
            "set -euo pipefail",
            f"if docker buildx imagetools inspect {shlex.quote(env)} >/dev/null 2>&1; then",
            f"  echo '--- {vendor} env image unchanged (content key {key}): reusing {env}'",
            "else",
            f"  echo '--- building the {vendor} env image {env}'",
            f"  {build_env}",
            "fi",
            f"echo '--- the {vendor} cell image {cell}'",
            build_cell,
        ]
    )


def buildkit_build_script(vendor: str, key: str, commit: str, reg: str | None = None) -> str:
    """The image step in a cluster (agent-stack-k8s): rootless BuildKit, no docker daemon.

    The env image is built with its own registry cache (``<env>-cache``): an unchanged
    environment hits every layer and pushes nothing new.
    """
    spec = get_image(vendor)
    env, cell = env_image(vendor, key, reg), cell_image(vendor, commit, reg)

    def build(target: str, ref: str, args: list[str], cache: bool) -> str:
        cmd = ["buildctl-daemonless.sh", "build", "--frontend", "dockerfile.v0"]
        cmd += ["--local", "context=.", "--local", "dockerfile=."]
        cmd += ["--opt", f"filename={spec.dockerfile}", "--opt", f"target={target}"]
        for a in args:
            cmd += ["--opt", f"build-arg:{a}"]
        if cache:
            cache_ref = f"{env}-cache"
            cmd += ["--import-cache", f"type=registry,ref={cache_ref}"]
            cmd += ["--export-cache", f"type=registry,ref={cache_ref},mode=max"]
        cmd += ["--output", f"type=image,name={ref},push=true"]
        return shlex.join(cmd)

    return "\n".join(
        [
            "set -eu",
            f"echo '--- the {vendor} env image {env} (content key {key})'",
            build(ENV_TARGET, env, [f"GPU_ARCHS={spec.gpu_archs}"], cache=True),
            f"echo '--- the {vendor} cell image {cell}'",
            build(CELL_TARGET, cell, [f"ENV_IMAGE={env}"], cache=False),
        ]
    )


# -- base images pinned by digest ----------------------------------------------------------------

_BASE_ARG = re.compile(r"^ARG BASE_IMAGE=(?P<ref>\S+)$", re.MULTILINE)
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def base_ref(dockerfile_text: str) -> str:
    """The ``ARG BASE_IMAGE=`` default of a Dockerfile.

    Raises:
        ValueError: no such line, or more than one.
    """
    refs = _BASE_ARG.findall(dockerfile_text)
    if len(refs) != 1:
        raise ValueError(f"expected one 'ARG BASE_IMAGE=<image>' line; found {len(refs)}")
    return refs[0]


def read_dockerfile(vendor: str, root: str | os.PathLike[str] = ".") -> tuple[Path, str, str]:
    """``vendor``'s Dockerfile under the checkout ``root``: its path, text and base image.

    Raises:
        ValueError: naming the file, when it is missing, no UTF-8 text, or has no single
            ``ARG BASE_IMAGE=`` line.
    """
    path = Path(root) / get_image(vendor).dockerfile
    if not Path(root).is_dir():
        what = "is not a folder" if Path(root).exists() else "does not exist"
        raise ValueError(
            f"--root {root} {what}: point it at a checkout of the project "
            f"(the folder holding {path.name})"
        )
    if not path.exists():
        raise ValueError(
            f"{path} does not exist: point --root at a checkout of the project "
            f"(the folder holding {path.name})"
        )
    text = read_text(path)
    try:
        return path, text, base_ref(text)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def split_ref(ref: str) -> tuple[str, str | None]:
    """``("name:tag", "sha256:...")``, or ``("name:tag", None)`` when not pinned."""
    name, _, digest = ref.partition("@")
    return name, digest or None


def is_pinned(dockerfile_text: str) -> bool:
    """Whether the base image's default carries a digest (a tag can be re-pushed; a digest
    cannot, so the same content key always starts from the same base)."""
    _, digest = split_ref(base_ref(dockerfile_text))
    return digest is not None and bool(_DIGEST.match(digest))


def pin(dockerfile_text: str, digest: str) -> str:
    """The Dockerfile with its base image pinned to ``digest`` (replacing an older one)."""
    if not _DIGEST.match(digest):
        raise ValueError(f"digest must be sha256:<64 lowercase hex>; got {digest!r}")
    name, _ = split_ref(base_ref(dockerfile_text))
    return _BASE_ARG.sub(f"ARG BASE_IMAGE={name}@{digest}", dockerfile_text, count=1)


#: How long ``docker buildx imagetools inspect`` may take to answer.
DOCKER_TIMEOUT_S = 120


def resolve_digest(name: str) -> str:
    """The registry's digest of ``name`` (``repo:tag``; the multi-arch index's, as
    ``docker pull repo@digest`` takes it), asked through ``docker buildx imagetools``.

    Raises:
        RuntimeError: no docker here, or the registry did not answer.
    """
    docker = shutil.which("docker")
    if docker is None:
        raise RuntimeError(
            "docker is not installed here: resolve the digest where the registry is reachable "
            f"(docker buildx imagetools inspect {name}) and pass it with --digest"
        )
    cmd = f"docker buildx imagetools inspect {name}"
    try:
        proc = subprocess.run(
            [docker, "buildx", "imagetools", "inspect", name, "--format", "{{json .Manifest}}"],
            capture_output=True,
            text=True,
            timeout=DOCKER_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{cmd}: no answer in {DOCKER_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd}: {proc.stderr.strip()}")
    try:
        digest = json.loads(proc.stdout)["digest"]
    except (ValueError, KeyError, TypeError):
        digest = None
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise RuntimeError(
            f"{cmd}: expected a manifest with a sha256 digest; got {proc.stdout.strip()[:200]!r}"
        )
    return digest


# -- the `kubematrix image` command --------------------------------------------------------------


def configure_cli(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=("key", "refs", "script", "pin", "check"),
        help="key: the env image's content key; refs: both image references; script: the build "
        "commands CI runs; pin: pin the base image by digest; check: exit 1 if it is not",
    )
    p.add_argument("--vendor", choices=sorted(IMAGES), required=True)
    p.add_argument(
        "--root",
        type=nonempty_arg,
        default=".",
        help="the repository checkout (the current folder)",
    )
    p.add_argument(
        "--commit",
        type=nonempty_arg,
        help="the commit of the cell image (refs, script; default HEAD)",
    )
    p.add_argument(
        "--builder", choices=("docker", "buildkit"), default=None, help="script (default docker)"
    )
    p.add_argument(
        "--digest", type=nonempty_arg, help="pin: this digest instead of asking the registry"
    )


def nonempty_arg(text: str) -> str:
    """An argparse type that refuses an empty or blank value (rather than falling back to a
    default, or reading the current folder for a path)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def image_arg(text: str) -> str:
    """An argparse type for an image reference (`IMAGE_REF`), named by its rule."""
    nonempty_arg(text)
    if not IMAGE_REF.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"must be an image reference [registry/]path[:tag][@digest] (lowercase path); "
            f"got {text!r}"
        )
    return text


def _commit(root: str, given: str | None) -> str:
    if given is not None:
        return given
    commit = checkout.head(root)
    if commit is None:
        raise ValueError(f"--commit is needed: {root} is not a git checkout")
    return commit


#: The actions each option applies to (an option given to another action is refused, not
#: ignored).
_OPTION_ACTIONS = {"commit": ("refs", "script"), "builder": ("script",), "digest": ("pin",)}


def run_cli(args: argparse.Namespace) -> int:
    for option, actions in _OPTION_ACTIONS.items():
        if getattr(args, option) is not None and args.action not in actions:
            raise ValueError(
                f"--{option} applies to {' and '.join(actions)} only; got it with {args.action}"
            )
    spec = get_image(args.vendor)
    if args.action in ("pin", "check"):
        dockerfile, text, ref = read_dockerfile(args.vendor, args.root)
        if args.action == "check":
            pinned = is_pinned(text)
            print(f"{spec.dockerfile}: {ref} ({'pinned' if pinned else 'NOT pinned by digest'})")
            return 0 if pinned else 1
        name, _ = split_ref(ref)
        try:
            digest = args.digest if args.digest is not None else resolve_digest(name)
        except RuntimeError as exc:
            print(f"kubematrix image pin: {exc}", file=sys.stderr)
            return 1
        try:
            dockerfile.write_text(pin(text, digest))
        except OSError as exc:
            raise ValueError(f"cannot write {dockerfile}: {exc.strerror}") from None
        print(f"{spec.dockerfile}: ARG BASE_IMAGE={name}@{digest}")
        return 0
    key = content_key(args.vendor, args.root)
    if args.action == "key":
        print(key)
        return 0
    commit = _commit(args.root, args.commit)
    if args.action == "refs":
        refs = env_image(args.vendor, key), cell_image(args.vendor, commit)
        print(*refs, sep="\n")
        return 0
    build = buildkit_build_script if args.builder == "buildkit" else docker_build_script
    print(build(args.vendor, key, commit))
    return 0
