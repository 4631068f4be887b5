"""The Buildkite pipeline, generated from the matrix (dynamic pipeline upload).

``.buildkite/pipeline.yml`` is a bootstrap: one step runs ``nox -s pipeline`` and pipes the result
to ``buildkite-agent pipeline upload``. What it uploads, built by :func:`generate`:

- one image step per GPU vendor (:mod:`kubematrix.images`): it reuses the vendor's environment
  image when the registry has one under its content key (else builds it) and adds this commit's
  project on top; every GPU step ``depends_on`` it and runs inside that image, on both lanes;
- one command step per cell of :func:`kubematrix.matrix.all_cells` — the CPU, CUDA and ROCm lanes
  come from the same cells, so they cannot drift. Each step only calls nox (the cell's own
  session), uploads the cell's JUnit, has the backend's timeout, retries automatically only on
  infrastructure failures (:data:`INFRA_RETRY`), and may soft-fail only when the cell is declared
  experimental;
- GPU lanes either on their own agent queues with the ``docker`` plugin (``lanes="queues"``) or
  on the agent-stack-k8s queue with the ``kubernetes`` plugin, whose ``podSpec`` is rendered from
  the same ``k8s/`` templates the launcher and ``kubectl apply -k`` use (``lanes="k8s"``); the
  image step builds with docker on a docker-capable queue, or with rootless BuildKit in a pod;
- on agent queues, each GPU cell's Triton cache kept between builds by the ``cache`` plugin,
  keyed by the cell, the image's Triton pin and its content key (:func:`cache_plugin`); in the
  k8s lane the cluster's Redis (``k8s/cache``) plays that part;
- selection by changed files: a cell none of whose paths changed is not dropped but put behind
  its own block step ("Run ..."), one click away, with the build staying green while it waits;
- a final step, after every selected cell whatever its outcome, that annotates the build with the
  matrix summary (``nox -s report -- --buildkite``), each cell judged by its JUnit and by its
  step's outcome.

Every step declares ``depends_on`` explicitly, so a block step never holds back anything but its
own cell (Buildkite: explicit dependencies override the implicit ordering of block steps).
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import subprocess
from collections.abc import Iterable, Sequence
from typing import Any

import yaml

from kubematrix import checkout, images
from kubematrix.cachestats import STATS_DIR_ENV, cache_env
from kubematrix.matrix import BACKENDS, Cell, all_cells
from kubematrix.render import CELL_CONTAINER, render_job

LANES = ("queues", "k8s")
RESULTS_DIR = "results/matrix"
K8S_QUEUE = "kubernetes"  # agent-stack-k8s's default queue
SUMMARY_KEY = "matrix-summary"
NOT_SELECTED_ENV = "KUBEMATRIX_NOT_SELECTED"

# Where images are built: a queue whose agents run docker (buildx), or BuildKit in a pod.
IMAGE_QUEUE_ENV, DEFAULT_IMAGE_QUEUE = "KUBEMATRIX_IMAGE_QUEUE", "docker"
BUILDKIT_IMAGE_ENV, DEFAULT_BUILDKIT_IMAGE = (
    "KUBEMATRIX_BUILDKIT_IMAGE",
    "moby/buildkit:v0.18.2-rootless",
)
# A kubernetes.io/dockerconfigjson Secret with push rights to the registry (k8s lane's builder).
REGISTRY_SECRET_ENV, DEFAULT_REGISTRY_SECRET = "KUBEMATRIX_REGISTRY_SECRET", "portattn-ci-registry"
DOCKER_PLUGIN = "docker#v5.12.0"
IMAGE_TIMEOUT_MINUTES = 120  # a cold environment builds the Mamba extensions for every arch
# The cell's writable places under the docker plugin (the image's HOME is for uid 10001; the step
# runs as the agent's uid so that it can write results into the checkout).
_DOCKER_HOME = "/tmp/portattn-home"
# Where the docker plugin mounts the checkout in the container (set explicitly, not left to the
# plugin's default, because the Triton cache's path inside the container depends on it).
DOCKER_WORKDIR = "/workdir"

# The agent-queue lane keeps each GPU cell's Triton cache between builds with Buildkite's cache
# plugin: the folder under the checkout is restored before the docker run and saved after a
# passing one. Its backend: fs (the agent host's disk), s3, gcs or azure (shared by all hosts,
# configured by the plugin's own BUILDKITE_PLUGIN_<BACKEND>_CACHE_* variables); "none": not kept.
CACHE_PLUGIN = "cache#v1.10.0"
CACHE_BACKEND_ENV, DEFAULT_CACHE_BACKEND = "KUBEMATRIX_CACHE_BACKEND", "fs"
TRITON_CACHE_FOLDER = ".triton-cache"

# Retried automatically: failures of the machine, never of the code under test.
INFRA_RETRY: tuple[dict[str, Any], ...] = (
    {"exit_status": -1, "limit": 2},  # the agent was lost (host died, spot reclaim)
    {"signal_reason": "agent_stop", "limit": 2},  # the agent was stopped mid-job
    {"signal_reason": "stack_error", "limit": 2},  # the stack could not start the job (k8s)
)
# ROCm reports a GPU hang (a wedged queue, not our assertion) as SIGABRT from the runtime: exit
# 134. On CPU and CUDA lanes an abort is a real crash of the code under test and is not retried.
ROCM_HANG_RETRY: dict[str, Any] = {"exit_status": 134, "limit": 1}


def changed_files_since(base: str, *, cwd: str | None = None) -> list[str]:
    """Files changed between the merge base of ``base`` and HEAD (``git diff base...HEAD``).

    Raises:
        ValueError: ``base`` starts with ``-`` (git would read an option), or git is missing
            or cannot diff (an unknown ``base``, not a checkout), with git's own words.
    """
    if base.startswith("-"):  # git would take it as one of its options
        raise ValueError(f"--changed-since must be a git revision, not an option; got {base!r}")
    if cwd is not None and not os.path.isdir(cwd):
        raise ValueError(f"--root {cwd}: no such folder (the checkout whose changes are read)")
    cmd = ["git", "diff", "--name-only", f"{base}...HEAD"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=cwd)
    except OSError as exc:
        raise ValueError(f"--changed-since {base}: cannot run git ({exc})") from None
    if out.returncode != 0:
        why = out.stderr.strip().splitlines()
        raise ValueError(
            f"--changed-since {base}: `{' '.join(cmd)}` failed: {why[0] if why else out.returncode}"
        )
    return [line for line in out.stdout.splitlines() if line]


def checkout_paths(paths: Iterable[str], root: str) -> list[str]:
    """``paths`` as the checkout-relative, ``/``-separated paths the cells' globs match:
    ``./x`` and ``a/../x`` normalized, an absolute path made relative to ``root``.

    Raises:
        ValueError: a path outside ``root``, naming it.
    """
    base = os.path.realpath(root)
    out = []
    for p in paths:
        rel = os.path.relpath(os.path.realpath(p), base) if os.path.isabs(p) else p
        rel = os.path.normpath(rel).replace(os.sep, "/")
        if rel == ".." or rel.startswith("../") or os.path.isabs(rel):
            raise ValueError(
                f"--changed-files {p}: must be a path inside the checkout (--root {root})"
            )
        out.append(rel)
    return out


def is_selected(cell: Cell, changed_files: Iterable[str] | None) -> bool:
    """Whether a change to ``changed_files`` concerns ``cell`` (None: no selection, all run)."""
    if changed_files is None:
        return True
    return any(fnmatch.fnmatchcase(f, pattern) for f in changed_files for pattern in cell.paths)


def retry_rules(cell: Cell) -> list[dict[str, Any]]:
    rules = [dict(r) for r in INFRA_RETRY]
    if cell.backend == "rocm":
        rules.append(dict(ROCM_HANG_RETRY))
    return rules


def artifact_paths(cell: Cell, results_dir: str = RESULTS_DIR) -> list[str]:
    """The cell's JUnit (for the compile cell its report folder: the summary step derives the
    JUnit from ``compile_matrix.json``) and its Triton cache counters."""
    counters = f"{results_dir}/{cell.name}.cache/*.jsonl"
    if cell.suite == "compile":
        return [f"{results_dir}/compile/*", counters]
    return [f"{results_dir}/{cell.name}.xml", counters]


def image_key(vendor: str) -> str:
    return f"image-{vendor}"


def image_step(vendor: str, *, lanes: str, commit: str, root: str = ".") -> dict[str, Any]:
    """The step that provides ``vendor``'s cell image for ``commit`` (see :mod:`images`).

    A Dockerfile whose base image is not pinned by digest gets a step that fails at once, saying
    how to pin it: the image is never built from a movable tag.
    """
    spec = images.get_image(vendor)
    key = images.content_key(vendor, root)
    _, text, ref = images.read_dockerfile(vendor, root)
    refuse = None
    if not images.is_pinned(text):
        why = (
            f"{spec.dockerfile}: BASE_IMAGE {ref} is not pinned by digest; pin it with "
            f"'kubematrix image pin --vendor {vendor}' and commit the change"
        )
        refuse = f"echo {shlex.quote(why)} >&2\nexit 1"
    step: dict[str, Any] = {
        "label": f":docker: {vendor} image",
        "key": image_key(vendor),
        "depends_on": [],
        "timeout_in_minutes": IMAGE_TIMEOUT_MINUTES,
        "retry": {"automatic": [dict(r) for r in INFRA_RETRY]},
        "env": {"KUBEMATRIX_IMAGE_KEY": key},
    }
    if lanes == "k8s":
        script = images.buildkit_build_script(vendor, key, commit)
        step["command"] = refuse or script
        step["agents"] = {"queue": K8S_QUEUE}
        step["plugins"] = [{"kubernetes": k8s_step(_builder_pod(step["command"]))}]
    else:
        step["command"] = refuse or images.docker_build_script(vendor, key, commit)
        step["agents"] = {"queue": _setting(IMAGE_QUEUE_ENV, DEFAULT_IMAGE_QUEUE, _NO_SPACE)}
    return step


_NO_SPACE = (re.compile(r"\S+"), "a name without spaces")
_IMAGE = (images.IMAGE_REF, "an image reference (lowercase repository, e.g. moby/buildkit:v0.16.0)")
_DNS_SUBDOMAIN = (
    re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"),
    "a Kubernetes object name (DNS-1123 subdomain)",
)


def _setting(env: str, default: str, rule: tuple[re.Pattern[str], str]) -> str:
    """``$env`` (else ``default``), which must match ``rule``.

    Raises:
        ValueError: naming the variable and the rule.
    """
    value = os.environ.get(env, "").strip() or default
    pattern, what = rule
    if not pattern.fullmatch(value) or len(value) > 253:
        raise ValueError(f"{env} must be {what}; got {value!r}")
    return value


#: How agent-stack-k8s turns a podSpec container's command and args into the step's command:
#: "buildkite" joins the command's entries as lines of a script (args appended, quoted, to the
#: last line), which the agent runs with its shell. Named in every step, so that a controller
#: whose default is "vector" or "legacy" runs the same script.
INTERPOSER = "buildkite"


def k8s_step(pod: dict[str, Any]) -> dict[str, Any]:
    """The kubernetes plugin's settings for a pod whose command container holds its whole shell
    script as the one entry of ``command`` (no ``args``): under the "buildkite" interposer the
    agent runs exactly that script. A Kubernetes-style ``["/bin/sh", "-c"]`` + ``[script]``
    would become the two lines ``/bin/sh`` and ``-c 'script'``."""
    return {"podSpec": pod, "commandParams": {"interposer": INTERPOSER}}


def _builder_pod(command: str) -> dict[str, Any]:
    """Rootless BuildKit in a pod: no privileges, no docker daemon; pushes with the registry
    Secret's credentials."""
    return {
        "containers": [
            {
                "name": "build",
                "image": _setting(BUILDKIT_IMAGE_ENV, DEFAULT_BUILDKIT_IMAGE, _IMAGE),
                # One entry, no args: agent-stack-k8s runs it as the step's command (`k8s_step`).
                "command": [command],
                "env": [
                    {"name": "BUILDKITD_FLAGS", "value": "--oci-worker-no-process-sandbox"},
                    {"name": "DOCKER_CONFIG", "value": "/home/user/.docker"},
                ],
                "securityContext": {
                    "seccompProfile": {"type": "Unconfined"},
                    "appArmorProfile": {"type": "Unconfined"},
                    "runAsUser": 1000,
                    "runAsGroup": 1000,
                },
                "resources": {"requests": {"cpu": "8", "memory": "32Gi"}},
                "volumeMounts": [
                    {"name": "registry-auth", "mountPath": "/home/user/.docker", "readOnly": True},
                    {"name": "buildkitd", "mountPath": "/home/user/.local/share/buildkit"},
                ],
            }
        ],
        "volumes": [
            {
                "name": "registry-auth",
                "secret": {
                    "secretName": _setting(
                        REGISTRY_SECRET_ENV, DEFAULT_REGISTRY_SECRET, _DNS_SUBDOMAIN
                    ),
                    "items": [{"key": ".dockerconfigjson", "path": "config.json"}],
                },
            },
            {"name": "buildkitd", "emptyDir": {}},
        ],
    }


def triton_cache_path(cell: Cell) -> str:
    """The cell's Triton cache folder, relative to the checkout (one per cell, so that cells
    running at once never save over each other's)."""
    return f"{TRITON_CACHE_FOLDER}/{cell.name}"


def cache_plugin(cell: Cell, *, root: str = ".") -> dict[str, Any] | None:
    """The ``cache`` plugin that keeps a GPU cell's Triton cache between builds on its agent
    queue, or ``None`` when ``$KUBEMATRIX_CACHE_BACKEND`` is ``none``.

    The key is the cell, the Triton version its image pins and the image's content key
    (:func:`images.content_key`): a new Triton or a new environment starts a new cache, and
    Triton's own cache key (its version, the kernel source, the target, the options) keeps a
    restored kernel from being used for anything it was not compiled for. The manifest, the
    files the content key hashes, keys the cache by them too where ``key-extra`` is not read.
    The plugin saves after every passing run (``force``), so the folder follows kernel edits;
    a failing cache operation only warns (``soft-fail``): the verdict never depends on it.

    Raises:
        ValueError: the cell is not a GPU cell, or the backend is not a name.
    """
    vendor = cell.spec.vendor
    if vendor is None:
        raise ValueError(f"cache_plugin: cell must be a GPU cell; got {cell.name!r}")
    backend = os.environ.get(CACHE_BACKEND_ENV, "").strip() or DEFAULT_CACHE_BACKEND
    if backend == "none":
        return None
    if not backend.isidentifier():
        raise ValueError(
            f"{CACHE_BACKEND_ENV} must be fs, s3, gcs, azure, another backend's name or none; "
            f"got {backend!r}"
        )
    spec = images.get_image(vendor)
    triton = images.pinned_version(vendor, "triton", root)
    key = images.content_key(vendor, root)
    return {
        CACHE_PLUGIN: {
            "backend": backend,
            "path": triton_cache_path(cell),
            "manifest": [*spec.inputs, "pyproject.toml"],
            "key-extra": f"{cell.name}-triton-{triton}-{vendor}-{key}",
            "restore": "file",
            "save": "file",
            "force": True,
            "compression": "tgz",
            "soft-fail": True,
        }
    }


def docker_plugin(cell: Cell, image: str) -> dict[str, Any]:
    """The ``docker`` plugin that runs a GPU cell's step in its image on an agent-queue host:
    the checkout mounted as the working directory, the vendor's devices, the cell's env, and
    Triton's cache in the checkout (where the cache plugin restores and saves it)."""
    opts: dict[str, Any] = {
        "image": image,
        "always-pull": True,
        "propagate-environment": True,
        "propagate-uid-gid": True,
        "workdir": DOCKER_WORKDIR,
        "shm-size": "8g",
        "environment": [
            f"HOME={_DOCKER_HOME}",
            f"TRITON_CACHE_DIR={DOCKER_WORKDIR}/{triton_cache_path(cell)}",
        ],
    }
    if cell.spec.vendor == "cuda":
        opts["gpus"] = "all"
    else:  # /dev/kfd and the render nodes, opened through the node's video and render groups
        opts["devices"] = ["/dev/kfd", "/dev/dri"]
        opts["additional-groups"] = ["video", "render"]
    return {DOCKER_PLUGIN: opts}


def k8s_plugin(
    cell: Cell, command: Sequence[str], *, commit: str, image: str, results_dir: str = RESULTS_DIR
) -> dict:
    """The ``kubernetes`` plugin of a GPU cell's step, from the ``k8s/`` templates: the rendered
    Job's pod as the ``podSpec``, and its labels and annotations (the cell, its commit, a Kueue
    queue from ``$KUBEMATRIX_KUEUE_QUEUE``) as the ``metadata`` agent-stack-k8s gives the Job.

    The rendered Job's pod runs the cell through ``kubematrix.cell`` (which streams the JUnit back
    through the log for the launcher). Under agent-stack-k8s the step's artifact upload brings the
    JUnit back instead, so the cell container runs the step's nox command directly, in the
    checked-out workspace, with the template's environment, resources, security context,
    tolerations and node selector unchanged.
    """
    vendor = cell.spec.vendor
    if vendor is None:
        raise ValueError(f"k8s_plugin: cell must be a GPU cell; got {cell.name!r}")
    job = render_job(
        vendor=vendor,
        suite=cell.suite,
        image=image,
        commit=commit,
        cell=cell.name,
        arch=cell.target,
        session=cell.nox_session,
        nox_args=cell.nox_args(),
        cell_timeout_s=max(60, cell.timeout_minutes * 60 - 300),
        active_deadline_s=cell.timeout_minutes * 60,
        test_timeout_s=min(900, max(30, cell.timeout_minutes * 60 - 600)),
    )
    pod = job["spec"]["template"]["spec"]
    for container in pod["containers"]:
        if container["name"] != CELL_CONTAINER:
            continue
        container["command"] = [shlex.join(command)]  # one entry, no args: `k8s_step`
        container.pop("args", None)
        container.pop("workingDir", None)  # agent-stack-k8s runs commands in the workspace
        for env in container.get("env", []):
            if env["name"] == STATS_DIR_ENV:
                # the step's own folder, which its artifact upload takes (the template's is the
                # launcher's /results, read back through the log): the same value whichever of
                # the step's env and the podSpec's the agent lets win
                env["value"] = f"{results_dir}/{cell.name}.cache"
            if env["name"] == "PYTEST_ADDOPTS":
                # The step passes its own --junitxml (the uploaded artifact).
                env["value"] = " ".join(
                    a for a in env["value"].split() if not a.startswith("--junitxml")
                )
    meta = job["metadata"]
    return {
        **k8s_step(pod),
        "metadata": {"labels": meta["labels"], "annotations": meta["annotations"]},
    }


def cell_step(
    cell: Cell,
    *,
    lanes: str = "queues",
    commit: str | None = None,
    depends_on: Sequence[str] = (),
    results_dir: str = RESULTS_DIR,
    root: str = ".",
) -> dict[str, Any]:
    """The command step of one cell (``root``: the checkout whose image inputs key the GPU
    cells' Triton caches)."""
    if lanes not in LANES:
        raise ValueError(f"cell_step: lanes must be one of {LANES}; got {lanes!r}")
    command = cell.nox_command(results_dir)
    step: dict[str, Any] = {
        "label": f":{'pytest' if cell.suite != 'compile' else 'hammer_and_wrench'}: {cell.label}",
        "key": cell.name,
        "command": shlex.join(command),
        "depends_on": list(depends_on),
        "artifact_paths": artifact_paths(cell, results_dir),
        "timeout_in_minutes": cell.timeout_minutes,
        "retry": {"automatic": retry_rules(cell)},
        # Triton's compiles through the layered cache; its counters go up with the JUnit.
        "env": {
            "PORTATTN_CELL": cell.name,
            **cache_env(f"{results_dir}/{cell.name}.cache"),
            **cell.env,
        },
    }
    if cell.spec.is_gpu:
        commit = commit or _default_commit(root)
        image = images.default_image(cell.spec.vendor or "", commit)
        # In the image the environment is the image's: nox neither creates nor installs.
        in_image = ["nox", "--no-venv", "--no-install", *command[1:]]
        step["depends_on"] = [image_key(cell.spec.vendor or ""), *step["depends_on"]]
        step["command"] = shlex.join(in_image)
        if lanes == "k8s":
            plugin = k8s_plugin(cell, in_image, commit=commit, image=image,
                                results_dir=results_dir)  # fmt: skip
            step["agents"] = {"queue": K8S_QUEUE}
            step["plugins"] = [{"kubernetes": plugin}]
        else:
            step["agents"] = {"queue": cell.spec.queue}
            cache = cache_plugin(cell, root=root)
            # The cache plugin first: its restore runs before the docker run, its save after.
            step["plugins"] = [*([cache] if cache else []), docker_plugin(cell, image)]
    else:
        step["agents"] = {"queue": cell.spec.queue}
    if cell.experimental:
        step["soft_fail"] = True
        step["label"] += " (experimental)"
    return step


_COMMIT_HASH = re.compile(r"[0-9a-f]{7,40}")


def _default_commit(root: str = ".") -> str:
    """``$BUILDKITE_COMMIT`` in a build, else the checkout's HEAD (a local preview). A build
    created for a symbolic commit (``HEAD``, a branch) carries that name in
    ``$BUILDKITE_COMMIT``: the checkout's HEAD is then the commit, so every build's images get
    their own tag rather than one ``<vendor>-HEAD`` tag shared by all."""
    given = os.environ.get("BUILDKITE_COMMIT", "").strip()
    if _COMMIT_HASH.fullmatch(given):
        return given
    resolved = checkout.head(root)
    if resolved is not None:
        return resolved
    if given:
        raise ValueError(
            f"BUILDKITE_COMMIT is {given!r}, not a commit hash, and {os.path.abspath(root)} is no "
            "git checkout to resolve it in; pass --commit"
        )
    return "HEAD"


def block_step(cell: Cell) -> dict[str, Any]:
    """The one-click gate in front of a cell that the change did not select."""
    return {
        "block": f"Run {cell.label}",
        "key": f"run-{cell.name}",
        "depends_on": [],
        "blocked_state": "passed",
        "prompt": f"No changed file matches {cell.name}'s paths; unblock to run it anyway.",
    }


def summary_step(selected: Sequence[Cell], not_selected: Sequence[Cell]) -> dict[str, Any]:
    """Annotate the build with the matrix summary once every selected cell has finished."""
    return {
        "label": ":memo: matrix summary",
        "key": SUMMARY_KEY,
        "command": shlex.join(["nox", "-s", "report", "--", "--buildkite"]),
        "depends_on": [{"step": c.name, "allow_failure": True} for c in selected],
        "allow_dependency_failure": True,
        "agents": {"queue": BACKENDS["cpu-interpreter"].queue},
        "timeout_in_minutes": 10,
        "retry": {"automatic": [dict(r) for r in INFRA_RETRY]},
        "env": {NOT_SELECTED_ENV: ",".join(c.name for c in not_selected)},
    }


def generate(
    cells: Sequence[Cell] | None = None,
    *,
    changed_files: Sequence[str] | None = None,
    lanes: str = "queues",
    commit: str | None = None,
    results_dir: str = RESULTS_DIR,
    root: str = ".",
) -> dict[str, Any]:
    """The pipeline as a dict: groups per backend, the cells' steps, the summary step.

    Args:
        cells: the cells (default: the whole matrix).
        changed_files: the change's files; ``None`` selects every cell (main-branch builds).
        lanes: ``"queues"`` (a queue per backend) or ``"k8s"`` (GPU cells through agent-stack-k8s
            with a podSpec rendered from ``k8s/``).
        commit: the commit GPU images are pinned to (k8s lanes); default ``$BUILDKITE_COMMIT``.
        results_dir: where steps write JUnit (relative to the checkout).
        root: the checkout, whose image inputs key the GPU images (the current folder).
    """
    if lanes not in LANES:
        raise ValueError(f"generate: lanes must be one of {LANES}; got {lanes!r}")
    cells = list(all_cells() if cells is None else cells)
    selected = [c for c in cells if is_selected(c, changed_files)]
    not_selected = [c for c in cells if c not in selected]
    commit = commit or _default_commit(root)
    vendors = [
        b.vendor for b in BACKENDS.values() if b.vendor and any(c.backend == b.name for c in cells)
    ]
    image_steps = [image_step(v, lanes=lanes, commit=commit, root=root) for v in vendors]
    groups: list[dict[str, Any]] = []
    if image_steps:
        groups.append(
            {"group": ":docker: images", "key": "images", "depends_on": [], "steps": image_steps}
        )
    for backend in BACKENDS.values():
        steps: list[dict[str, Any]] = []
        for cell in (c for c in cells if c.backend == backend.name):
            if cell in selected:
                steps.append(
                    cell_step(cell, lanes=lanes, commit=commit, results_dir=results_dir, root=root)
                )
            else:
                gate = block_step(cell)
                steps.append(gate)
                steps.append(
                    cell_step(
                        cell,
                        lanes=lanes,
                        commit=commit,
                        results_dir=results_dir,
                        depends_on=[gate["key"]],
                        root=root,
                    )
                )
        if steps:
            title = backend.name + (f" ({', '.join(backend.targets)})" if backend.targets else "")
            groups.append(
                {
                    "group": f":test_tube: {title}",
                    "key": f"lane-{backend.name}",
                    "depends_on": [],
                    "steps": steps,
                }
            )
    return {"steps": [*groups, summary_step(selected, not_selected)]}


def to_yaml(pipeline: dict[str, Any]) -> str:
    header = "# Generated by `python -m kubematrix pipeline` from kubematrix.matrix; do not edit.\n"
    return header + yaml.safe_dump(pipeline, sort_keys=False, width=100, allow_unicode=True)
