"""Job rendering: one template source, valid manifests for every Kubernetes version we support,
the security and lifetime properties the cluster relies on, deterministic names."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes import client

from kubematrix import buildkite, render
from kubematrix.cachestats import K8S_REDIS_PORT, K8S_REDIS_SERVICE, REDIS_ENV, STATS_DIR_ENV
from kubematrix.cell import cache_lines, decode_cache, decode_results, encode_results
from kubematrix.matrix import ARCH_ENV, all_cells
from kubematrix.render import (
    build_kustomization,
    job_name,
    load_kustomization,
    render_job,
    render_pod_spec,
)

pytestmark = pytest.mark.ci

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "src" / "kubematrix" / "manifests"  # the templates (the repository's k8s/ links here)
VENDORS = ("cuda", "rocm")
OLDEST = (1, 29)
K8S_VERSIONS = sorted(
    {
        v
        for v in kubernetes_validate.utils.all_versions()
        if tuple(int(x) for x in v.split(".")[:2]) >= OLDEST
    },
    key=lambda v: tuple(int(x) for x in v.split(".")),
)
GPU = {"cuda": "nvidia.com/gpu", "rocm": "amd.com/gpu"}


def _cell(vendor: str, **kw) -> dict:
    args = {
        "vendor": vendor,
        "suite": "mla",
        "image": f"registry.test/portattn-ci:{vendor}-abc",
        "commit": "abc1234def",
        "nox_args": ["-k", "decode"],
    }
    return render_job(**{**args, **kw})


def _manifests() -> list[tuple[str, dict]]:
    out = []
    for vendor in VENDORS:
        for doc in load_kustomization(K8S / "overlays" / vendor):
            out.append((f"{vendor}:{doc['kind']}", doc))
        out.append((f"{vendor}:rendered-job", _cell(vendor)))
    for doc in load_kustomization(K8S / "cache"):  # the optional Triton cache (Redis + PVC)
        out.append((f"cache:{doc['kind']}", doc))
    return out


def test_supported_versions_span_1_29_to_the_newest_shipped():
    assert K8S_VERSIONS[0].startswith("1.29")
    assert K8S_VERSIONS[-1] == kubernetes_validate.utils.latest_version()


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_is_valid_strict(version):
    for label, doc in _manifests():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{label} invalid for Kubernetes {version}: {exc}")


def test_kubernetes_validate_cli_strict_on_rendered_files(tmp_path):
    exe = shutil.which("kubernetes-validate")
    assert exe, "kubernetes-validate is in the ci extra"
    files = []
    for label, doc in _manifests():
        path = tmp_path / (label.replace(":", "-") + ".yaml")
        path.write_text(yaml.safe_dump(doc))
        files.append(str(path))
    for version in (K8S_VERSIONS[0], K8S_VERSIONS[-1]):
        proc = subprocess.run(
            [exe, "--strict", "--quiet", "-k", version, *files], capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


OVERLAYS = (*VENDORS, "sm_90", "sm_100", "gfx942", "gfx950")


@pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (with kustomize) not installed"
)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_same_manifests_as_kubectl_kustomize(overlay):
    vendor = overlay
    built = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / vendor)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout

    def key(d):
        return d["kind"], d["metadata"]["name"]

    assert sorted(load_kustomization(K8S / "overlays" / vendor), key=key) == sorted(
        (d for d in yaml.safe_load_all(built) if d), key=key
    )


@pytest.mark.parametrize("vendor", VENDORS)
def test_the_typed_client_round_trips_the_job(vendor):
    job = _cell(vendor)
    assert client.ApiClient().sanitize_for_serialization(client.V1Job.from_dict(job)) == job


@pytest.mark.parametrize("vendor", VENDORS)
def test_a_job_never_retries_ignores_disruptions_and_runs_restricted(vendor):
    job = _cell(vendor, supplemental_groups=[44, 110] if vendor == "rocm" else None)
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert spec["backoffLimit"] == 0
    assert spec["podFailurePolicy"]["rules"][0] == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    assert spec["ttlSecondsAfterFinished"] > 0 and pod["restartPolicy"] == "Never"
    # timeouts nest: per-test < whole session < Job deadline
    assert "--timeout=900" in env["PYTEST_ADDOPTS"]
    assert c["command"][c["command"].index("--timeout") + 1] == "3300"
    assert spec["activeDeadlineSeconds"] == 3600
    # restricted security context, no API token in the pod
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    # writable places for a read-only root filesystem; /dev/shm in memory
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert env["TRITON_CACHE_DIR"].startswith(env["HOME"]) and env["HOME"] in mounts
    assert {"/tmp", "/results"} <= set(mounts)
    # vendor parts
    assert c["resources"]["limits"][GPU[vendor]] == "1"
    assert [t["key"] for t in pod["tolerations"]] == [GPU[vendor]]
    assert pod["nodeSelector"]
    assert pod["securityContext"].get("supplementalGroups") == (
        [44, 110] if vendor == "rocm" else None
    )
    # the cell itself
    assert c["image"] == f"registry.test/portattn-ci:{vendor}-abc"
    assert env["PORTATTN_SESSION"] == "mla" and c["args"][-2:] == ["-k", "decode"]
    assert job["metadata"]["labels"]["portattn.dev/vendor"] == vendor
    assert (
        render_pod_spec(
            vendor=vendor,
            suite="mla",
            image=c["image"],
            commit="abc1234def",
            nox_args=["-k", "decode"],
        )
        == _cell(vendor)["spec"]["template"]["spec"]
    )


@pytest.mark.parametrize("mode", ["builtin", "kubectl"])
def test_the_setup_makes_the_namespace_and_rbac_and_nothing_that_runs(mode, monkeypatch):
    """The docs' one-time setup (`kubectl apply -k k8s/setup`) was `k8s/base`, which also made
    Job portattn-cell: its image `portattn-ci` resolves to no registry, so the Job waited in
    ImagePullBackOff for its deadline, and a later overlay apply could not change its template.
    The base still holds the setup, so an overlay's apply makes the namespace too."""
    if mode == "kubectl" and shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed")
    monkeypatch.setenv(render.KUSTOMIZE_ENV, mode)
    setup = build_kustomization(K8S / "setup")
    kinds = {(d["kind"], d["metadata"].get("namespace")) for d in setup}
    assert kinds == {("Namespace", None), ("ServiceAccount", "portattn-ci"),
                     ("Role", "portattn-ci"), ("RoleBinding", "portattn-ci")}  # fmt: skip
    base = build_kustomization(K8S / "base")
    assert [d for d in base if d["kind"] != "Job"] == setup
    assert [d["metadata"]["name"] for d in base if d["kind"] == "Job"] == ["portattn-cell"]


def test_rbac_is_least_privilege():
    docs = {d["kind"]: d for d in load_kustomization(K8S / "base")}
    rules = {
        (r["apiGroups"][0], r["resources"][0]): sorted(r["verbs"]) for r in docs["Role"]["rules"]
    }
    assert rules == {
        ("batch", "jobs"): sorted(["create", "get", "list", "watch", "delete"]),
        ("", "pods"): ["get", "list", "watch"],
        ("", "pods/log"): ["get"],
        ("", "events"): ["list", "watch"],
    }
    assert docs["RoleBinding"]["subjects"][0]["namespace"] == "portattn-ci"


def test_job_name_is_deterministic_dns1123_and_bounded():
    a = job_name("0123456789abcdef0123", "mla-rocm-gfx942")
    assert a == job_name("0123456789abcdef0123", "mla-rocm-gfx942")
    assert a.startswith("pa-0123456-mla-rocm-gfx942-")
    assert a != job_name("0123456789abcdef0123", "mla-cuda-sm_90")
    assert a != job_name("0123456789abcdef0124", "mla-rocm-gfx942")
    long = job_name("F" * 40, "Some/Very Long:Cell_" * 10)
    assert len(long) <= 63 and long == long.lower() and long[0].isalnum() and long[-1].isalnum()
    with pytest.raises(ValueError, match="job_name: commit and cell_name must be non-empty"):
        job_name("", "x")


def test_a_job_name_stands_for_everything_the_job_runs():
    """The same cell of the same commit with another image or other pytest arguments got the
    same name, so the launcher attached to (and later deleted) another run's Job and reported
    its result: the name digests the rendered Job; the very same Job keeps its name."""
    base = dict(vendor="cuda", suite="mla", image="reg/x:cuda-0123456", commit="0123456789ab",
                cell="mla-cuda-sm_90")  # fmt: skip
    name = render_job(**base)["metadata"]["name"]
    assert name == render_job(**base)["metadata"]["name"]
    assert name.startswith("pa-0123456-mla-cuda-sm-90-")
    others = [
        dict(image="reg/x:cuda-experiment"),
        dict(nox_args=["-k", "test_one_trivial_case"]),
        dict(test_timeout_s=60),
        dict(active_deadline_s=7200),
        dict(supplemental_groups=[44]),
    ]
    names = {render_job(**{**base, **kw})["metadata"]["name"] for kw in others}
    assert name not in names and len(names) == len(others)


def test_render_job_reports_every_bad_argument():
    with pytest.raises(ValueError) as err:
        render_job(
            vendor="intel",
            suite="nope",
            image="a b",
            commit="",
            namespace="Bad_NS",
            test_timeout_s=4000,
            nox_args=["--junitxml=x.xml"],
        )
    message = str(err.value)
    for part in (
        "vendor must be one of ('cuda', 'rocm'); got 'intel'",
        "suite must be one of",
        "image must be an image reference [registry/]path[:tag][@digest] (lowercase path)",
        "commit must be non-empty",
        "namespace must be a DNS-1123 label",
        "timeouts must satisfy 0 < test_timeout_s < cell_timeout_s < active_deadline_s",
        "nox_args must not set --junitxml",
    ):
        assert part in message


def test_render_job_refuses_what_the_api_server_would():
    """An upper-case path, a deadline past int64 or a GID past Linux's 32 bits was rendered and
    left for the API server or the kubelet to refuse."""
    base = dict(vendor="rocm", suite="mla", image="reg/x:rocm-0123456", commit="0123456789ab")
    for kw, part in (
        (dict(image="Reg/X:rocm"), "image must be an image reference"),
        (dict(active_deadline_s=2**63, cell_timeout_s=3300), "<= 2**63 - 1 (the Job's int64"),
        (dict(supplemental_groups=[44, 2**32 - 1]), "GIDs in [0, 4294967294]; got [44, 42949"),
    ):
        with pytest.raises(ValueError, match=re.escape(part)):
            render_job(**{**base, **kw})
    job = render_job(**base, supplemental_groups=[0, 2**32 - 2], active_deadline_s=2**63 - 1)
    assert job["spec"]["activeDeadlineSeconds"] == 2**63 - 1


def test_kustomize_fields_the_renderer_does_not_implement_are_refused(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nreplicas: []\n")
    with pytest.raises(
        ValueError,
        match=r"kustomize fields the launcher does not implement: "
        r"\['replicas'\]",
    ):
        load_kustomization(tmp_path)


def test_results_round_trip_through_log_lines():
    data = b"<testsuites>" + b"x" * 5000 + b"</testsuites>"
    lines = ["noise", *encode_results(data, "tok", 1), "after"]
    assert decode_results(lines, "tok") == (data, 1)
    assert decode_results(lines, "other") == (None, None)
    assert decode_results(lines[:-3], "tok") == (None, None)  # cut before END


def test_cache_counters_round_trip_through_log_lines(tmp_path):
    stats = tmp_path / "cache"
    stats.mkdir()
    # Two processes' counters, as the layered cache manager appends them.
    (stats / "11.jsonl").write_text(
        '{"event": "compiled", "compile_s": 2.5}\n{"event": "local", "compile_s": 0}\n'
    )
    (stats / "12.jsonl").write_text('{"event": "remote", "compile_s": 0}\n{"event": "loc')
    human, marker = cache_lines(stats, "tok")
    assert human == (
        "kubematrix.cell: Triton cache: 67% hits of 3 lookups "
        "(1 local, 1 remote, 1 compiled in 2.5 s)"
    )
    got = decode_cache(["noise", human, marker, *encode_results(b"<x/>", "tok", 0)], "tok")
    assert got is not None and (got.local, got.remote, got.compiled, got.compile_s) == (
        1,
        1,
        1,
        2.5,
    )
    assert decode_cache([marker], "other") is None
    assert decode_cache([marker[:-5]], "tok") is None  # cut short: no counters, no crash
    assert cache_lines(tmp_path / "absent", "tok") == []  # nothing compiled through the manager
    assert cache_lines(None, "tok") == []


# Node labels that tell an architecture apart: NVIDIA GPU feature discovery's compute capability;
# AMD's node labeller's PCI device ids (its family label is "AI" for every CDNA part).
PLACEMENT = {
    "sm_90": ("nvidia.com/gpu.compute.major", "9", "nvidia.com/gpu.compute.minor", "0"),
    "sm_100": ("nvidia.com/gpu.compute.major", "10", "nvidia.com/gpu.compute.minor", "0"),
    "gfx942": ("amd.com/gpu.device-id", ["74a0", "74a1", "74a5", "74b5"]),
    "gfx950": ("amd.com/gpu.device-id", ["75a0", "75a3"]),
}


def _placement(pod: dict, arch: str) -> None:
    """``pod`` lands on ``arch``'s nodes only and tells its first test which arch to expect."""
    want = PLACEMENT[arch]
    if arch.startswith("sm_"):
        selector = pod["nodeSelector"]
        assert (selector[want[0]], selector[want[2]]) == (want[1], want[3])
        assert "affinity" not in pod
    else:
        (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        assert term["matchExpressions"] == [{"key": want[0], "operator": "In", "values": want[1]}]
    (container,) = pod["containers"]
    assert {"name": ARCH_ENV, "value": arch} in container["env"]


@pytest.mark.parametrize("mode", ["builtin", "kubectl"])
def test_every_gpu_cell_is_placed_on_its_architecture(mode, monkeypatch):
    if mode == "kubectl" and shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed")
    monkeypatch.setenv(render.KUSTOMIZE_ENV, mode)
    gpu_cells = [c for c in all_cells() if c.spec.is_gpu]
    assert {c.target for c in gpu_cells} == set(PLACEMENT)
    for cell in gpu_cells:  # the launcher's Jobs and the k8s lane's podSpecs alike
        job = render_job(
            vendor=cell.spec.vendor, suite=cell.suite, image="i", commit="c", arch=cell.target
        )
        assert job["metadata"]["labels"]["portattn.dev/arch"] == cell.target
        _placement(job["spec"]["template"]["spec"], cell.target)
    steps = buildkite.generate(lanes="k8s", commit="c")["steps"]
    pods = {
        s["key"]: s["plugins"][0]["kubernetes"]["podSpec"]
        for group in steps
        for s in group.get("steps", [group])
        if "plugins" in s and not s["key"].startswith("image-")
    }
    for cell in gpu_cells:
        _placement(pods[cell.name], cell.target)


def test_the_default_arch_is_the_vendors_first_and_a_foreign_arch_is_refused():
    _placement(render_pod_spec(vendor="cuda", suite="mla", image="i", commit="c"), "sm_90")
    _placement(render_pod_spec(vendor="rocm", suite="mla", image="i", commit="c"), "gfx942")
    with pytest.raises(ValueError, match=r"arch must be one of \('sm_90', 'sm_100'\) for cuda"):
        render_job(vendor="cuda", suite="mla", image="i", commit="c", arch="gfx942")


def test_kueue_admission_is_one_setting(monkeypatch):
    monkeypatch.delenv(render.KUEUE_QUEUE_ENV, raising=False)
    assert render.KUEUE_QUEUE_LABEL not in _cell("cuda")["metadata"]["labels"]
    monkeypatch.setenv(render.KUEUE_QUEUE_ENV, "gpu-ci")
    assert _cell("rocm")["metadata"]["labels"][render.KUEUE_QUEUE_LABEL] == "gpu-ci"
    with pytest.raises(ValueError, match="queue_name must be a Kueue LocalQueue name"):
        _cell("rocm", queue_name="Not A Queue")


def test_a_kueue_queue_that_cannot_be_a_label_value_is_named_by_its_variable(monkeypatch):
    """A label value is at most 63 characters: a longer queue used to reach the Job."""
    monkeypatch.setenv(render.KUEUE_QUEUE_ENV, "q" * 63)
    assert _cell("cuda")["metadata"]["labels"][render.KUEUE_QUEUE_LABEL] == "q" * 63
    for bad in ("q" * 64, "q" * 100, "gpu_ci", "-gpu"):
        monkeypatch.setenv(render.KUEUE_QUEUE_ENV, bad)
        with pytest.raises(ValueError) as err:
            _cell("cuda")
        message = str(err.value)
        assert f"{render.KUEUE_QUEUE_ENV} must be a Kueue LocalQueue name usable as a " in message
        assert "at most 63 characters of a-z, 0-9 and '-'" in message
        assert f"got {bad!r} ({len(bad)} characters)" in message
    # an explicit empty queue is refused, not read as "none"
    with pytest.raises(ValueError, match="queue_name must be a Kueue LocalQueue name"):
        _cell("cuda", queue_name="")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_the_real_kustomize_builds_what_the_subset_refuses(tmp_path, monkeypatch):
    """An admin's own edit with a field the subset lacks (a label transformer here)."""
    shutil.copytree(K8S, tmp_path, dirs_exist_ok=True)
    kfile = tmp_path / "overlays" / "sm_90" / "kustomization.yaml"
    kfile.write_text(kfile.read_text() + "labels:\n  - pairs:\n      team: kernels\n")
    kw = dict(vendor="cuda", suite="mla", image="i", commit="c", k8s_dir=tmp_path)
    monkeypatch.setenv(render.KUSTOMIZE_ENV, "kubectl")
    assert render_job(**kw)["metadata"]["labels"]["team"] == "kernels"
    monkeypatch.setenv(render.KUSTOMIZE_ENV, "builtin")
    with pytest.raises(ValueError, match=r"install kubectl to build it with the real kustomize"):
        render_job(**kw)
    monkeypatch.setenv(render.KUSTOMIZE_ENV, "fast")
    with pytest.raises(ValueError, match="KUBEMATRIX_KUSTOMIZE must be one of"):
        render_job(**kw)


def _env(job: dict) -> dict[str, str]:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"]}


def test_every_job_compiles_through_the_layered_cache_in_front_of_the_cache_redis(monkeypatch):
    monkeypatch.delenv(REDIS_ENV, raising=False)
    env = _env(_cell("cuda"))
    assert env["TRITON_CACHE_MANAGER"] == "kubematrix.compile_cache:LayeredCacheManager"
    assert env["TRITON_REMOTE_CACHE_BACKEND"] == "kubematrix.compile_cache:GuardedRedisBackend"
    # the Service by its namespace: the k8s lane's pods run in agent-stack-k8s's namespace
    assert env["TRITON_REDIS_HOST"] == f"{K8S_REDIS_SERVICE}.portattn-ci.svc"
    assert env["TRITON_REDIS_PORT"] == str(K8S_REDIS_PORT)
    other = _env(_cell("rocm", namespace="gpu-team"))
    assert other["TRITON_REDIS_HOST"] == f"{K8S_REDIS_SERVICE}.gpu-team.svc"
    assert env["TRITON_CACHE_DIR"] == "/home/portattn/.triton/cache"  # the local layer
    assert env[STATS_DIR_ENV].startswith("/results/")
    monkeypatch.setenv(REDIS_ENV, "")  # no shared Redis: the pod's own folder only
    assert "TRITON_REMOTE_CACHE_BACKEND" not in _env(_cell("rocm"))


def test_the_cache_component_is_a_pinned_redis_on_a_claim_behind_the_service_jobs_use():
    docs = {d["kind"]: d for d in load_kustomization(K8S / "cache")}
    assert set(docs) == {"PersistentVolumeClaim", "Deployment", "Service"}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (redis,) = pod["containers"]
    assert re.fullmatch(r"redis:7\.4\.\d+", redis["image"])
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "triton-cache"
    service = docs["Service"]
    assert service["metadata"]["name"] == K8S_REDIS_SERVICE
    assert [p["port"] for p in service["spec"]["ports"]] == [K8S_REDIS_PORT]
    assert all(d["metadata"]["namespace"] == "portattn-ci" for d in docs.values())


@pytest.mark.parametrize("broken", ["missing", "a file", "bad yaml", "no mapping"])
def test_a_template_folder_that_cannot_be_built_is_a_usage_error_naming_its_variable(
    broken, tmp_path, monkeypatch, capsys
):
    """`$KUBEMATRIX_K8S_DIR` pointing nowhere, at a file, or at YAML that does not parse ended
    the pipeline command in a traceback (FileNotFoundError, NotADirectoryError, ParserError)."""
    from kubematrix.__main__ import main

    where = tmp_path / "k8s"
    overlay = where / "overlays" / "sm_90"
    if broken == "a file":
        where.write_text("")
    elif broken != "missing":
        overlay.mkdir(parents=True)
        text = {"bad yaml": "resources: [x\n", "no mapping": "42\n"}[broken]
        (overlay / "kustomization.yaml").write_text(text)
    monkeypatch.setenv("KUBEMATRIX_K8S_DIR", str(where))
    monkeypatch.setenv("KUBEMATRIX_KUSTOMIZE", "builtin")
    assert main(["pipeline", "--lanes", "k8s", "--commit", "abc"]) == 2
    err = capsys.readouterr().err
    assert "render: cannot build the kustomization in" in err
    assert err.rstrip().endswith(f"(KUBEMATRIX_K8S_DIR={where})")
