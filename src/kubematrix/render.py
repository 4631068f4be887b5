"""Render a CI cell's Kubernetes Job from the kustomize templates in kubematrix (pure).

The templates are package data (the repository's ``k8s/`` is a symlink to them), so
``kubectl apply -k k8s/overlays/<vendor>`` and this module read the SAME files, from a checkout or
an installed wheel: the base Job in ``base/job.yaml`` and the vendor overlay's strategic-merge
patch and image. This module
implements exactly the kustomize fields those files use (``resources``, ``namespace``,
``patches`` with a ``path``, ``images``) and raises on any other field, so a template change
that the launcher cannot follow fails the tests instead of drifting. ``tests/ci`` compares the
result with ``kubectl kustomize`` where kubectl is installed.

Then the cell's parameters are filled in: name, image, suite, commit, pytest arguments,
timeouts. Nothing here talks to a cluster; every function returns plain dicts.

Example::

    job = render_job(vendor="rocm", suite="mla", image="ghcr.io/x/portattn-ci:rocm-abc123",
                     commit="abc123", nox_args=["-k", "decode"])
    job["metadata"]["name"]   # 'pa-abc123-rocm-mla-<8 hex>', the same for the same inputs
"""

from __future__ import annotations

import copy
import hashlib
import importlib.resources
import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from kubematrix.cachestats import REDIS_ENV, cache_env, k8s_redis
from kubematrix.images import IMAGE_REF
from kubematrix.matrix import BACKENDS

#: The largest value of a Kubernetes int64 field (``activeDeadlineSeconds``).
INT64_MAX = 2**63 - 1
#: The largest Linux group id (``gid_t`` is 32 bits, and ``(gid_t) -1`` means "no group").
MAX_GID = 2**32 - 2

__all__ = [
    "CELL_CONTAINER",
    "DNS_LABEL_RULE",
    "RESULTS_PATH",
    "SUITES",
    "VENDORS",
    "is_dns_label",
    "job_name",
    "load_kustomization",
    "render_job",
    "render_pod_spec",
    "results_token",
]

VENDORS = ("cuda", "rocm")
#: Suites a cell can run; each is a nox session of the same name running ``pytest -m <suite>``.
SUITES = ("paged", "mla", "hybrid", "specdec", "policy", "compile", "gpu")
CELL_CONTAINER = "cell"
# Kueue admission, behind one setting: the LocalQueue named by $KUBEMATRIX_KUEUE_QUEUE.
KUEUE_QUEUE_ENV = "KUBEMATRIX_KUEUE_QUEUE"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
RESULTS_PATH = "/results/junit.xml"
DEFAULT_NAMESPACE = "portattn-ci"

_KUSTOMIZE_FIELDS = {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
# Strategic-merge keys of the pod fields our patches touch (from the Kubernetes API's
# x-kubernetes-patch-merge-key); other lists are replaced, as kustomize does.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}
_CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_LABEL_RULE = (
    "a DNS-1123 label: at most 63 characters of a-z, 0-9 and '-', "
    "starting and ending with a letter or digit"
)


def is_dns_label(value: str) -> bool:
    """Whether ``value`` is a DNS-1123 label: a namespace's name, and a valid label value."""
    return len(value) <= 63 and bool(_DNS_LABEL.match(value))


# Where a cell's processes leave their Triton cache counters, inside the pod.
CACHE_STATS_PATH = "/results/cache"


def default_k8s_dir() -> Path:
    """``$KUBEMATRIX_K8S_DIR`` or the templates shipped in the package (``kubematrix/manifests``).

    Raises:
        RuntimeError: the package is not on a file system (e.g. imported from a zip), so kustomize
            paths cannot be read; set ``$KUBEMATRIX_K8S_DIR``.
    """
    env = os.environ.get("KUBEMATRIX_K8S_DIR")
    if env:
        return Path(env)
    templates = importlib.resources.files("kubematrix") / "manifests"
    if not isinstance(templates, Path):
        raise RuntimeError(
            f"render: the kubematrix templates are not files on disk ({templates!r}); "
            "set KUBEMATRIX_K8S_DIR to a copy of them"
        )
    return templates


# --------------------------------------------------------------------------- kustomize subset


def _strategic_merge(base: Any, patch: Any, key: str = "") -> Any:
    """Kubernetes strategic-merge of ``patch`` into ``base`` for the fields in ``_MERGE_KEYS``."""
    if isinstance(base, dict) and isinstance(patch, dict):
        if "$patch" in patch:
            raise ValueError(f"render: '$patch' directives are not supported; got {patch!r}")
        out = dict(base)
        for k, v in patch.items():
            out[k] = _strategic_merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in _MERGE_KEYS:
        merge_key = _MERGE_KEYS[key]
        out_list, added = list(base), []
        for item in patch:
            idx = next(
                (i for i, b in enumerate(out_list) if b.get(merge_key) == item.get(merge_key)),
                None,
            )
            if idx is None:
                added.append(copy.deepcopy(item))
            else:
                out_list[idx] = _strategic_merge(out_list[idx], item)
        return added + out_list  # kustomize puts a patch's new entries first
    return copy.deepcopy(patch)


def _set_images(doc: dict, images: list[dict]) -> None:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        ref = container.get("image", "")
        name, _, tag = ref.partition(":")
        for rule in images:
            if rule["name"] == name:
                name = rule.get("newName", name)
                tag = rule.get("newTag", tag)
        container["image"] = f"{name}:{tag}" if tag else name


def _set_namespace(doc: dict, namespace: str) -> None:
    if doc["kind"] == "Namespace":
        doc["metadata"]["name"] = namespace
        return
    if doc["kind"] not in _CLUSTER_SCOPED:
        doc["metadata"]["namespace"] = namespace
    if doc["kind"] == "RoleBinding":
        for subject in doc.get("subjects", []):
            if subject.get("kind") == "ServiceAccount":
                subject["namespace"] = namespace


def load_kustomization(directory: Path | str) -> list[dict]:
    """Build ``directory``'s kustomization like ``kubectl kustomize`` (the subset we use).

    Raises:
        ValueError: a kustomize field or patch form this subset does not implement, a patch
            that matches no resource, or files that cannot be read or are not such YAML.
    """
    try:
        return _load_kustomization(Path(directory))
    except (OSError, yaml.YAMLError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(
            f"render: cannot build the kustomization in {directory}: {type(exc).__name__}: {exc}"
        ) from None


def _load_kustomization(directory: Path) -> list[dict]:
    kfile = directory / "kustomization.yaml"
    spec = yaml.safe_load(kfile.read_text())
    unknown = sorted(set(spec) - _KUSTOMIZE_FIELDS)
    if unknown:
        raise ValueError(
            f"render: {kfile} uses kustomize fields the launcher does not implement: {unknown}; "
            f"supported: {sorted(_KUSTOMIZE_FIELDS)}"
        )
    docs: list[dict] = []
    for res in spec.get("resources", []):
        path = directory / res
        if path.is_dir():
            docs.extend(_load_kustomization(path))
        else:
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    for entry in spec.get("patches", []):
        if set(entry) != {"path"}:
            raise ValueError(f"render: {kfile}: only 'patches: - path: <file>' is supported")
        for patch in yaml.safe_load_all((directory / entry["path"]).read_text()):
            targets = [
                i
                for i, d in enumerate(docs)
                if d["kind"] == patch["kind"] and d["metadata"]["name"] == patch["metadata"]["name"]
            ]
            if not targets:
                raise ValueError(f"render: {kfile}: patch {entry['path']} matches no resource")
            for i in targets:
                docs[i] = _strategic_merge(docs[i], patch)
    for doc in docs:
        _set_images(doc, spec.get("images", []))
        if "namespace" in spec:
            _set_namespace(doc, spec["namespace"])
    return docs


# Which kustomize builds the templates: "auto" (kubectl's built-in where kubectl is installed,
# else the subset above), "kubectl" (required) or "builtin" (the subset only).
KUSTOMIZE_ENV = "KUBEMATRIX_KUSTOMIZE"
KUSTOMIZE_MODES = ("auto", "kubectl", "builtin")


def build_kustomization(directory: Path | str, mode: str | None = None) -> list[dict]:
    """``directory``'s kustomization, built by the real kustomize (``kubectl kustomize``) where
    kubectl is installed, so admins' own patches (PVCs, tolerations, replacements) work; else by
    :func:`load_kustomization`, which names any field it does not implement.

    Raises:
        ValueError: an unknown mode, ``kubectl`` asked for but not installed, or kustomize's own
            error (quoted).
    """
    mode = mode or os.environ.get(KUSTOMIZE_ENV, "auto")
    if mode not in KUSTOMIZE_MODES:
        raise ValueError(f"render: {KUSTOMIZE_ENV} must be one of {KUSTOMIZE_MODES}; got {mode!r}")
    kubectl = shutil.which("kubectl") if mode != "builtin" else None
    if kubectl is None:
        if mode == "kubectl":
            raise ValueError(f"render: {KUSTOMIZE_ENV}=kubectl but kubectl is not installed")
        try:
            return load_kustomization(directory)
        except ValueError as exc:
            raise ValueError(
                f"{exc} (install kubectl to build it with the real kustomize)"
            ) from exc
    proc = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise ValueError(f"render: kubectl kustomize {directory} failed: {proc.stderr.strip()}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def archs(vendor: str) -> tuple[str, ...]:
    """The GPU architectures of a vendor's pools (an overlay each), the first the default."""
    return tuple(a.name for a in BACKENDS[vendor].archs) if vendor in BACKENDS else ()


def _job_template(overlay: str, k8s_dir: Path) -> dict:
    try:
        docs = build_kustomization(k8s_dir / "overlays" / overlay)
    except ValueError as exc:  # a template folder the user pointed at: say where it came from
        env = os.environ.get("KUBEMATRIX_K8S_DIR")
        raise ValueError(f"{exc} (KUBEMATRIX_K8S_DIR={env})" if env else str(exc)) from None
    jobs = [d for d in docs if d["kind"] == "Job"]
    if len(jobs) != 1:
        raise ValueError(f"render: overlay {overlay} must build exactly one Job; got {len(jobs)}")
    return json.loads(json.dumps(jobs[0]))  # plain dicts, whichever kustomize built it


# --------------------------------------------------------------------------- cell parameters


def job_name(commit: str, cell_name: str, spec: str = "") -> str:
    """A deterministic DNS-1123 Job name (<= 63 characters) for one cell of one commit.

    ``pa-<commit[:7]>-<cell slug, <= 40>-<8 hex of sha256(commit, cell, spec)>``: readable, and
    unique even when the slug is cut. ``spec``: a digest of everything else the Job runs
    (`render_job`: image, arguments, timeouts, node selection), so the same inputs always give
    the same name and a 409 on create means "this very Job is already running" (attaching to
    it is safe), while the same cell with another image or other pytest arguments is another Job.

    Example::

        job_name("0123456789abcdef", "rocm/gfx942:mla")  # 'pa-0123456-rocm-gfx942-mla-<8 hex>'
    """
    if not commit or not cell_name:
        raise ValueError(
            f"job_name: commit and cell_name must be non-empty; got {commit!r}, {cell_name!r}"
        )
    key = f"{commit}\0{cell_name}" + (f"\0{spec}" if spec else "")
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    short = re.sub(r"[^a-z0-9]+", "-", commit.lower()).strip("-")[:7] or "x"
    slug = re.sub(r"[^a-z0-9]+", "-", cell_name.lower()).strip("-")[:40].strip("-") or "cell"
    name = f"pa-{short}-{slug}-{digest}"
    assert len(name) <= 63 and _DNS_LABEL.match(name), name  # by construction
    return name


def results_token(name: str) -> str:
    """The marker token a cell prints around its JUnit report (derived from the Job name)."""
    return hashlib.sha256(f"kubematrix-results\0{name}".encode()).hexdigest()[:16]


def _set_env(container: dict, name: str, value: str) -> None:
    for item in container.setdefault("env", []):
        if item["name"] == name:
            item["value"] = value
            return
    container["env"].append({"name": name, "value": value})


def render_job(
    *,
    vendor: str,
    suite: str,
    image: str,
    commit: str,
    nox_args: Sequence[str] = (),
    namespace: str = DEFAULT_NAMESPACE,
    cell: str | None = None,
    session: str | None = None,
    test_timeout_s: int = 900,
    cell_timeout_s: int = 3300,
    active_deadline_s: int = 3600,
    ttl_after_finished_s: int = 3600,
    supplemental_groups: Sequence[int] | None = None,
    k8s_dir: Path | str | None = None,
    arch: str | None = None,
    queue_name: str | None = None,
) -> dict:
    """The Job manifest for one cell: its architecture's overlay's Job (the vendor overlay plus
    the arch's node selection) with the cell's parameters.

    Args:
        vendor: ``"cuda"`` or ``"rocm"`` (the overlay under ``overlays/``).
        suite: the test suite (one of ``SUITES``, a pytest marker); labels the Job.
        image: the container image reference, e.g. pinned to the commit.
        commit: the source commit; with ``cell`` it determines the Job name.
        nox_args: arguments forwarded to the session (``nox -s <session> -- <nox_args>``),
            i.e. pytest arguments. Do not pass ``--junitxml``: the cell writes JUnit to
            ``RESULTS_PATH`` (via ``PYTEST_ADDOPTS``) and prints it to the log from there.
        namespace: where the Job is created.
        cell: the cell's name in the matrix; defaults to ``"<vendor>-<suite>"``.
        session: the nox session the container runs; defaults to ``suite`` (the per-suite
            sessions run ``pytest -m <suite>``). E.g. ``session="gpu"`` with
            ``nox_args=["-m", suite]``: the suite's ``gpu`` tests (a session ANDs a given
            ``-m`` with its own marker).
        test_timeout_s: pytest-timeout's per-test limit.
        cell_timeout_s: the whole session's limit; the cell interrupts pytest then, so the
            partial JUnit report still reaches the launcher.
        active_deadline_s: the Job's hard deadline (scheduling and image pull included).
        ttl_after_finished_s: garbage collection of a finished Job the launcher did not delete.
        supplemental_groups: the pod's supplemental GIDs (AMD: the node's video and render
            groups); ``None`` keeps the overlay's value.
        arch: the GPU architecture (``overlays/<arch>``: nodes of that architecture only, and
            the arch the cell's first test expects); defaults to the vendor's first.
        queue_name: a Kueue LocalQueue to admit the Job through (the
            ``kueue.x-k8s.io/queue-name`` label); defaults to ``$KUBEMATRIX_KUEUE_QUEUE``, none
            when that is unset or empty.
        k8s_dir: the template directory; defaults to :func:`default_k8s_dir`.

    Raises:
        ValueError: listing every invalid argument.
    """
    errors = []
    if vendor not in VENDORS:
        errors.append(f"vendor must be one of {VENDORS}; got {vendor!r}")
    if suite not in SUITES:
        errors.append(f"suite must be one of {SUITES}; got {suite!r}")
    if not isinstance(image, str) or not IMAGE_REF.fullmatch(image):
        errors.append(
            f"image must be an image reference [registry/]path[:tag][@digest] (lowercase path); "
            f"got {image!r}"
        )
    if not commit:
        errors.append(f"commit must be non-empty; got {commit!r}")
    if not is_dns_label(namespace):
        errors.append(f"namespace must be {DNS_LABEL_RULE}; got {namespace!r}")
    if not 0 < test_timeout_s < cell_timeout_s < active_deadline_s <= INT64_MAX:
        errors.append(
            "timeouts must satisfy 0 < test_timeout_s < cell_timeout_s < active_deadline_s "
            f"<= 2**63 - 1 (the Job's int64 field); got {test_timeout_s}, {cell_timeout_s}, "
            f"{active_deadline_s}"
        )
    if session is not None and not re.fullmatch(r"[A-Za-z0-9_.()'=-]+", session):
        errors.append(f"session must be a nox session name; got {session!r}")
    if any(a.startswith("--junitxml") or a.startswith("--junit-xml") for a in nox_args):
        errors.append(f"nox_args must not set --junitxml (the cell writes {RESULTS_PATH})")
    if ttl_after_finished_s < 0:
        errors.append(f"ttl_after_finished_s must be >= 0; got {ttl_after_finished_s}")
    if supplemental_groups is not None and any(not 0 <= g <= MAX_GID for g in supplemental_groups):
        errors.append(
            f"supplemental_groups must be GIDs in [0, {MAX_GID}]; got {list(supplemental_groups)}"
        )
    if vendor in VENDORS and arch is not None and arch not in archs(vendor):
        errors.append(f"arch must be one of {archs(vendor)} for {vendor}; got {arch!r}")
    # The queue becomes a label value: named by where it came from when it cannot be one.
    queue_source = "queue_name"
    if queue_name is None:
        queue_name, queue_source = os.environ.get(KUEUE_QUEUE_ENV) or None, KUEUE_QUEUE_ENV
    if queue_name is not None and not is_dns_label(queue_name):
        errors.append(
            f"{queue_source} must be a Kueue LocalQueue name usable as a label value, "
            f"{DNS_LABEL_RULE}; got {queue_name!r} ({len(queue_name)} characters)"
        )
    if errors:
        raise ValueError("render_job: " + "; ".join(errors))

    cell = cell or f"{vendor}-{suite}"
    arch = arch or archs(vendor)[0]
    job = copy.deepcopy(_job_template(arch, Path(k8s_dir) if k8s_dir else default_k8s_dir()))

    meta = job["metadata"]
    meta["namespace"] = namespace
    labels = {"portattn.dev/suite": suite, "portattn.dev/vendor": vendor, "portattn.dev/arch": arch}
    meta.setdefault("labels", {}).update(labels)
    if queue_name:
        meta["labels"][KUEUE_QUEUE_LABEL] = queue_name
    meta["annotations"] = {
        **meta.get("annotations", {}),
        "portattn.dev/commit": commit,
        "portattn.dev/cell": cell,
    }
    spec = job["spec"]
    spec["activeDeadlineSeconds"] = active_deadline_s
    spec["ttlSecondsAfterFinished"] = ttl_after_finished_s
    template = spec["template"]
    template["metadata"].setdefault("labels", {}).update(labels)
    pod = template["spec"]
    if supplemental_groups is not None:
        pod["securityContext"]["supplementalGroups"] = list(supplemental_groups)

    (container,) = [c for c in pod["containers"] if c["name"] == CELL_CONTAINER]
    container["image"] = image
    command = container["command"]
    command[command.index("--timeout") + 1] = str(cell_timeout_s)
    container["args"] = [*container["args"], *nox_args]
    _set_env(container, "PORTATTN_SESSION", session or suite)
    _set_env(container, "PORTATTN_COMMIT", commit)
    _set_env(
        container,
        "PYTEST_ADDOPTS",
        f"--junitxml={RESULTS_PATH} --timeout={test_timeout_s} -p no:cacheprovider",
    )
    # Triton's compiles through the layered cache: the pod's own folder in front of the
    # k8s/cache Redis in the Job's namespace (``$KUBEMATRIX_TRITON_REDIS`` overrides the address;
    # empty: none).
    redis = os.environ.get(REDIS_ENV, k8s_redis(namespace))
    for key, value in cache_env(CACHE_STATS_PATH, redis=redis).items():
        _set_env(container, key, value)
    # the name last: it digests the whole Job as rendered so far (`job_name`)
    spec = hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()
    name = meta["name"] = job_name(commit, cell, spec)
    _set_env(container, "KUBEMATRIX_RESULTS_TOKEN", results_token(name))
    return job


def render_pod_spec(**kwargs: Any) -> dict:
    """The pod template spec of :func:`render_job` (same keyword arguments), e.g. for a
    Buildkite agent-stack-k8s ``podSpec``."""
    return render_job(**kwargs)["spec"]["template"]["spec"]
