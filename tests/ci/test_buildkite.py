"""The generated Buildkite pipeline: schema-valid, one definition for both GPU lanes, selection."""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from kubematrix import buildkite, images
from kubematrix.__main__ import main
from kubematrix.matrix import all_cells, get_cell

pytestmark = pytest.mark.ci

ROOT = Path(__file__).resolve().parents[2]
# Buildkite's published pipeline schema (github.com/buildkite/pipeline-schema, MIT: the LICENSE
# file beside it), carried in the repository so that every checkout validates against it.
SCHEMA = ROOT / "tests" / "ci" / "data" / "buildkite-pipeline.schema.json"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
INFRA_SIGNALS = {"agent_stop", "stack_error"}


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads(SCHEMA.read_text())


def command_steps(pipeline: dict) -> list[dict]:
    steps = []
    for step in pipeline["steps"]:
        steps.extend(step.get("steps", [step]))
    return [s for s in steps if "command" in s]


def cell_steps(pipeline: dict) -> list[dict]:
    """The command steps that run a cell or the summary (not the image steps)."""
    return [s for s in command_steps(pipeline) if not s["key"].startswith("image-")]


def by_key(pipeline: dict) -> dict[str, dict]:
    out = {}
    for step in pipeline["steps"]:
        for s in step.get("steps", [step]):
            out[s["key"]] = s
    return out


def buildkite_command(plugin: dict, container: dict) -> str:
    """The BUILDKITE_COMMAND agent-stack-k8s makes of a podSpec container (its config package's
    `CommandParams.Command`): "buildkite" joins ``command`` by newlines and appends the shell-
    quoted ``args`` to the last line; "vector" shell-quotes every word; "legacy" (the default of
    controllers without interposers) joins every word by spaces. A step without
    ``commandParams`` gets the controller's default, which a cluster may set to any of them."""
    command, args = container.get("command", []), container.get("args", [])
    interposer = plugin.get("commandParams", {}).get("interposer")
    assert interposer in ("buildkite", "vector", "legacy"), interposer
    if interposer == "buildkite":
        return "\n".join(command) + (" " + shlex.join(args) if args else "")
    if interposer == "vector":
        return shlex.join([*command, *args])
    return " ".join([*command, *args])


PIPELINES = {
    "queues": dict(lanes="queues"),
    "k8s": dict(lanes="k8s", commit=COMMIT),
    "queues-selected": dict(lanes="queues", changed_files=["src/portattn/kernels/mla_decode.py"]),
    "k8s-nothing-selected": dict(lanes="k8s", commit=COMMIT, changed_files=["README.md"]),
}


@pytest.mark.parametrize("name", PIPELINES)
def test_generated_pipeline_passes_buildkite_schema(schema, name):
    pipeline = yaml.safe_load(buildkite.to_yaml(buildkite.generate(**PIPELINES[name])))
    jsonschema.validate(pipeline, schema)


def test_bootstrap_pipeline_passes_buildkite_schema_and_only_runs_the_generator(schema):
    bootstrap = yaml.safe_load((ROOT / ".buildkite" / "pipeline.yml").read_text())
    jsonschema.validate(bootstrap, schema)
    (step,) = bootstrap["steps"]
    script = ROOT / step["command"]
    assert os.access(script, os.X_OK)
    text = script.read_text()
    assert "nox -s pipeline --" in text and "buildkite-agent pipeline upload" in text


def test_cli_prints_a_pipeline_that_passes_the_schema(schema):
    out = subprocess.run(
        [sys.executable, "-m", "kubematrix", "pipeline"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    jsonschema.validate(yaml.safe_load(out), schema)


def test_pod_specs_pass_the_kubernetes_schema():
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (the ci extra) is not installed"
    )
    from tests.ci.test_k8s_render import K8S_VERSIONS  # 1.29 to the newest it ships

    pipeline = buildkite.generate(lanes="k8s", commit=COMMIT)
    gpu_steps = [s for s in cell_steps(pipeline) if "plugins" in s]
    assert {s["key"] for s in gpu_steps} == {c.name for c in all_cells() if c.spec.is_gpu}
    builders = [s for s in command_steps(pipeline) if s["key"].startswith("image-")]
    assert {s["key"] for s in builders} == {"image-cuda", "image-rocm"}
    # The cells' pods on every supported version; the in-cluster image builder's from 1.30,
    # whose AppArmor profile field it sets (1.29 has no such field: docs/adopting.md says so).
    for step in builders:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": step["key"]},
            "spec": step["plugins"][0]["kubernetes"]["podSpec"],
        }
        for version in K8S_VERSIONS:
            if version.startswith("1.29"):
                with pytest.raises(kubernetes_validate.ValidationError, match="appArmorProfile"):
                    kubernetes_validate.validate(pod, version, strict=True)
            else:
                kubernetes_validate.validate(pod, version, strict=True)
    for step in gpu_steps:
        (plugin,) = step["plugins"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": step["key"].replace("_", "-")},
            "spec": plugin["kubernetes"]["podSpec"],
        }
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(pod, version, strict=True)
        (container,) = pod["spec"]["containers"]
        assert buildkite_command(plugin["kubernetes"], container) == step["command"]
        assert step["command"].startswith("nox --no-venv --no-install -s ")  # the image's env
        resource = get_cell(step["key"]).spec.gpu_resource
        assert container["resources"]["limits"][resource] == "1"
        assert container["image"].endswith(COMMIT)


def _normalised(step: dict, backend: str, target: str) -> dict:
    """A lane's step with the lane's own names taken out."""
    s = copy.deepcopy(step)
    s["retry"]["automatic"] = [r for r in s["retry"]["automatic"] if r != buildkite.ROCM_HANG_RETRY]
    text = (
        json.dumps(s).replace(f"{backend}-{target}", "LANE").replace(f"{backend} {target}", "LANE")
    )
    text = text.replace(f"gpu-{backend}", "QUEUE").replace(f'"{backend}"', '"VENDOR"')
    text = text.replace(f"image-{backend}", "IMAGE").replace(f'"{target}"', '"ARCH"')
    text = text.replace(f"portattn-ci:{backend}-", "portattn-ci:VENDOR-")
    text = text.replace("amd.com/gpu", "GPU").replace("nvidia.com/gpu", "GPU")
    return json.loads(text)


@pytest.mark.parametrize("lanes", buildkite.LANES)
def test_cuda_and_rocm_lanes_come_from_one_definition(lanes):
    pipeline = buildkite.generate(lanes=lanes, commit=COMMIT)
    steps = by_key(pipeline)
    for suite in ("paged", "mla", "specdec"):
        cuda = _normalised(steps[f"{suite}-cuda-sm_90"], "cuda", "sm_90")
        rocm = _normalised(steps[f"{suite}-rocm-gfx942"], "rocm", "gfx942")
        # The pods and docker runs differ where the vendors do (devices, overlays).
        plugins = [s.pop("plugins")[-1] for s in (cuda, rocm)]
        if lanes == "k8s":
            pods = [p["kubernetes"]["podSpec"] for p in plugins]
            assert pods[0]["containers"][0]["command"] == pods[1]["containers"][0]["command"]
        else:
            runs = [p[buildkite.DOCKER_PLUGIN] for p in plugins]
            assert runs[0]["gpus"] == "all" and runs[1]["devices"] == ["/dev/kfd", "/dev/dri"]
            # The caches differ only in the cell and the image they are keyed by.
            a, b = (
                dict(steps[f"{suite}-{lane}"]["plugins"][0][buildkite.CACHE_PLUGIN])
                for lane in ("cuda-sm_90", "rocm-gfx942")
            )
            for opts in (a, b):
                del opts["path"], opts["key-extra"], opts["manifest"]
            assert a == b
        assert cuda == rocm


def test_a_k8s_lane_pod_counts_its_compiles_where_the_step_uploads_them():
    """The step's env put the cache counters in results/matrix/<cell>.cache (its artifact
    paths), the podSpec's template env in the launcher's /results/cache: whichever the agent let
    win, the counters could go where no upload takes them. Both now say the step's folder."""
    from kubematrix.cachestats import STATS_DIR_ENV

    steps = by_key(buildkite.generate(lanes="k8s", commit=COMMIT))
    for name in ("mla-cuda-sm_90", "paged-rocm-gfx942"):
        step = steps[name]
        pod = step["plugins"][0]["kubernetes"]["podSpec"]
        (cell,) = [c for c in pod["containers"] if c["name"] == buildkite.CELL_CONTAINER]
        pod_env = {e["name"]: e.get("value") for e in cell["env"]}
        want = f"{buildkite.RESULTS_DIR}/{name}.cache"
        assert pod_env[STATS_DIR_ENV] == step["env"][STATS_DIR_ENV] == want
        assert any(p.startswith(want) for p in step["artifact_paths"]), step["artifact_paths"]


def test_a_k8s_lane_job_carries_the_launchers_labels_and_kueue_queue(monkeypatch):
    """agent-stack-k8s labels the Job from the plugin's ``metadata``: the same labels and
    annotations as the launcher's Job of that cell, the Kueue queue among them when set."""
    from kubematrix import render

    monkeypatch.delenv(render.KUEUE_QUEUE_ENV, raising=False)
    plain = by_key(buildkite.generate(lanes="k8s", commit=COMMIT))
    monkeypatch.setenv(render.KUEUE_QUEUE_ENV, "gpu-ci")
    queued = by_key(buildkite.generate(lanes="k8s", commit=COMMIT))
    for name in ("mla-cuda-sm_90", "paged-rocm-gfx942"):
        cell = get_cell(name)
        launcher = render.render_job(vendor=cell.spec.vendor, suite=cell.suite, image="i",
                                     commit=COMMIT, cell=name, arch=cell.target)  # fmt: skip
        meta = queued[name]["plugins"][0]["kubernetes"]["metadata"]
        assert meta == {
            "labels": launcher["metadata"]["labels"],
            "annotations": launcher["metadata"]["annotations"],
        }
        assert meta["labels"][render.KUEUE_QUEUE_LABEL] == "gpu-ci"
        assert meta["annotations"]["portattn.dev/cell"] == name
        unqueued = plain[name]["plugins"][0]["kubernetes"]["metadata"]["labels"]
        assert render.KUEUE_QUEUE_LABEL not in unqueued


def test_steps_only_call_nox_with_timeouts_junit_and_infrastructure_retries():
    pipeline = buildkite.generate(lanes="queues")
    for step in cell_steps(pipeline):
        in_image = get_cell(step["key"]).spec.is_gpu if step["key"] != buildkite.SUMMARY_KEY else 0
        nox = "nox --no-venv --no-install -s " if in_image else "nox -s "
        assert step["command"].startswith(nox), step["command"]
        assert step["timeout_in_minutes"] >= 1
        rules = step["retry"]["automatic"]
        for rule in rules:
            assert set(rule) in ({"exit_status", "limit"}, {"signal_reason", "limit"})
            assert rule.get("exit_status") in (None, -1, 134)
            assert rule.get("signal_reason") in (None, *INFRA_SIGNALS)
        # Exit 134 (a ROCm GPU hang) is retried on ROCm lanes only.
        on_rocm = step["key"].split("-")[1:2] == ["rocm"]
        assert (buildkite.ROCM_HANG_RETRY in rules) == on_rocm
        if step["key"] == buildkite.SUMMARY_KEY:
            assert step["command"] == "nox -s report -- --buildkite"
            continue
        cell = get_cell(step["key"])
        # The cell's Triton compiles go through the layered cache; its counters go up too.
        counters = f"results/matrix/{cell.name}.cache"
        assert step["env"]["KUBEMATRIX_CACHE_STATS"] == counters
        assert step["env"]["TRITON_CACHE_MANAGER"].startswith("kubematrix.compile_cache:")
        if cell.suite == "compile":
            assert step["artifact_paths"] == ["results/matrix/compile/*", f"{counters}/*.jsonl"]
        else:
            junit = f"results/matrix/{cell.name}.xml"
            assert step["command"].endswith(f"--junitxml={junit}")
            assert step["artifact_paths"] == [junit, f"{counters}/*.jsonl"]


def test_soft_fail_only_for_experimental_cells():
    steps = cell_steps(buildkite.generate())
    soft = {s["key"] for s in steps if s.get("soft_fail")}
    experimental = {c.name for c in all_cells() if c.experimental}
    assert soft == experimental and "hybrid-rocm-gfx942" in experimental
    assert "paged-cuda-sm_90" not in soft and "paged-rocm-gfx942" not in soft


def test_gpu_cells_run_on_their_vendors_queue_or_the_k8s_queue_and_cpu_cells_on_plain_agents():
    queues = by_key(buildkite.generate(lanes="queues"))
    assert queues["mla-cuda-sm_90"]["agents"] == {"queue": "gpu-cuda"}
    assert queues["mla-rocm-gfx942"]["agents"] == {"queue": "gpu-rocm"}
    # On agent queues a GPU cell runs in its commit's image through the docker plugin.
    (cache, plugin) = queues["mla-rocm-gfx942"]["plugins"]
    assert buildkite.CACHE_PLUGIN in cache
    assert plugin[buildkite.DOCKER_PLUGIN]["image"].startswith("ghcr.io/portattn/portattn-ci:rocm-")
    assert queues["image-rocm"]["agents"] == {"queue": buildkite.DEFAULT_IMAGE_QUEUE}
    assert "plugins" not in queues["mla-cpu-interpreter"]
    k8s = by_key(buildkite.generate(lanes="k8s", commit=COMMIT))
    assert k8s["mla-rocm-gfx942"]["agents"] == {"queue": "kubernetes"}
    assert k8s["mla-cpu-interpreter"]["agents"] == {"queue": "cpu"}  # CPU cells: plain agents
    with pytest.raises(
        ValueError, match=r"generate: lanes must be one of \('queues', 'k8s'\); got 'ssh'"
    ):
        buildkite.generate(lanes="ssh")


def test_agent_queue_gpu_cells_keep_their_triton_cache_keyed_by_triton_and_the_image(
    monkeypatch,
):
    monkeypatch.delenv(buildkite.CACHE_BACKEND_ENV, raising=False)
    steps = by_key(buildkite.generate(lanes="queues"))
    for cell in (c for c in all_cells() if c.spec.is_gpu):
        vendor = cell.spec.vendor
        cache, docker = steps[cell.name]["plugins"]  # restore before the docker run, save after
        opts = cache[buildkite.CACHE_PLUGIN]
        triton = images.pinned_version(vendor, "triton", ROOT)
        key = images.content_key(vendor, ROOT)
        assert opts["key-extra"] == f"{cell.name}-triton-{triton}-{vendor}-{key}"
        assert (opts["restore"], opts["save"], opts["backend"]) == ("file", "file", "fs")
        assert opts["force"] is True and opts["soft-fail"] is True  # fresh, and never fatal
        # The manifest is what the content key hashes: it exists in every checkout.
        assert set(images.get_image(vendor).inputs) < set(opts["manifest"])
        assert all((ROOT / f).is_file() for f in opts["manifest"])
        # Triton inside the container compiles into the folder the plugin saves.
        run = docker[buildkite.DOCKER_PLUGIN]
        assert run["workdir"] == buildkite.DOCKER_WORKDIR
        assert f"TRITON_CACHE_DIR={run['workdir']}/{opts['path']}" in run["environment"]
        assert opts["path"] == f".triton-cache/{cell.name}"
    # One folder (and key) per cell: cells running at once never save over each other.
    paths = [
        s["plugins"][0][buildkite.CACHE_PLUGIN]["path"]
        for s in steps.values()
        if s.get("plugins") and buildkite.CACHE_PLUGIN in s["plugins"][0]
    ]
    assert len(paths) == len(set(paths)) == sum(1 for c in all_cells() if c.spec.is_gpu)
    # The k8s lane keeps its cache in the cluster's Redis; CPU cells use no plugin.
    k8s = by_key(buildkite.generate(lanes="k8s", commit=COMMIT))
    assert [list(p) for p in k8s["mla-cuda-sm_90"]["plugins"]] == [["kubernetes"]]
    assert "plugins" not in steps["compile-cpu-interpreter"]


def test_the_cache_backend_is_one_setting_and_none_turns_the_plugin_off(monkeypatch):
    monkeypatch.setenv(buildkite.CACHE_BACKEND_ENV, "s3")
    (cache, _) = by_key(buildkite.generate(lanes="queues"))["paged-cuda-sm_90"]["plugins"]
    assert cache[buildkite.CACHE_PLUGIN]["backend"] == "s3"
    monkeypatch.setenv(buildkite.CACHE_BACKEND_ENV, "none")
    (docker,) = by_key(buildkite.generate(lanes="queues"))["paged-cuda-sm_90"]["plugins"]
    assert buildkite.DOCKER_PLUGIN in docker
    monkeypatch.setenv(buildkite.CACHE_BACKEND_ENV, "")  # empty is the default, as elsewhere
    (cache, _) = by_key(buildkite.generate(lanes="queues"))["paged-cuda-sm_90"]["plugins"]
    assert cache[buildkite.CACHE_PLUGIN]["backend"] == buildkite.DEFAULT_CACHE_BACKEND == "fs"
    monkeypatch.setenv(buildkite.CACHE_BACKEND_ENV, "s3 --bucket x")
    with pytest.raises(ValueError, match="KUBEMATRIX_CACHE_BACKEND must be fs, s3, gcs, azure"):
        buildkite.generate(lanes="queues")


def test_a_cpu_cell_has_no_image_cache():
    with pytest.raises(ValueError, match="cache_plugin: cell must be a GPU cell; got 'mla-cpu"):
        buildkite.cache_plugin(get_cell("mla-cpu-interpreter"))


def test_the_triton_pin_is_read_from_the_constraints_and_its_absence_named(tmp_path):
    assert images.pinned_version("cuda", "triton", ROOT) == "3.6.0"
    (tmp_path / "constraints").mkdir()
    (tmp_path / "constraints" / "rocm.txt").write_text("# pins\ntorch==2.10.0\ntriton>=3.6\n")
    with pytest.raises(ValueError, match=r"constraints/rocm.txt must pin triton with '=='"):
        images.pinned_version("rocm", "triton", tmp_path)


# -- selection by changed files ----------------------------------------------------------------


def test_selection_keeps_unselected_cells_one_click_away():
    pipeline = buildkite.generate(changed_files=["src/portattn/kernels/mla_decode.py"])
    steps = by_key(pipeline)
    selected = {"mla", "specdec", "compile"}  # specdec covers MLA as the target model
    for cell in all_cells():
        step = steps[cell.name]
        image = [f"image-{cell.spec.vendor}"] if cell.spec.is_gpu else []
        if cell.suite in selected:
            assert step["depends_on"] == image and f"run-{cell.name}" not in steps
        else:
            gate = steps[f"run-{cell.name}"]
            assert step["depends_on"] == [*image, gate["key"]]
            assert gate["depends_on"] == [] and gate["blocked_state"] == "passed"
            assert gate["block"] == f"Run {cell.label}"
    summary = steps[buildkite.SUMMARY_KEY]
    assert {d["step"] for d in summary["depends_on"]} == {
        c.name for c in all_cells() if c.suite in selected
    }
    assert all(d["allow_failure"] for d in summary["depends_on"])
    not_selected = summary["env"][buildkite.NOT_SELECTED_ENV].split(",")
    assert set(not_selected) == {c.name for c in all_cells() if c.suite not in selected}


# An MLA tile policy concerns the policy and compile cells, MLA, and speculative decoding (whose
# target model is MLA) on every backend.
MLA_POLICY_CELLS = {"policy-cpu-interpreter", "compile-cpu-interpreter"} | {
    c.name for c in all_cells() if c.suite in ("mla", "specdec")
}


@pytest.mark.parametrize(
    "changed, expected",
    [
        (["Dockerfile.rocm"], {c.name for c in all_cells() if c.backend == "rocm"}),
        # what an image is built from, and the pins each backend's sessions install under
        (["constraints/cuda.txt"], {c.name for c in all_cells() if c.backend == "cuda"}),
        (["constraints/rocm.txt"], {c.name for c in all_cells() if c.backend == "rocm"}),
        (["constraints/cpu.txt"], {c.name for c in all_cells() if c.backend == "cpu-interpreter"}),
        (
            ["tools/mamba_wheels.py"],
            {c.name for c in all_cells() if c.backend != "cpu-interpreter"},
        ),
        (["tools/check_image.py"], {c.name for c in all_cells() if c.backend != "cpu-interpreter"}),
        ([".dockerignore"], {c.name for c in all_cells() if c.backend != "cpu-interpreter"}),
        (["src/portattn/policy/mla.py"], MLA_POLICY_CELLS),
        (["noxfile.py"], {c.name for c in all_cells()}),
        (["src/kubematrix/buildkite.py"], {c.name for c in all_cells()}),
        (["README.md", "docs/validation.md"], set()),
    ],
)
def test_which_cells_a_change_selects(changed, expected):
    assert {c.name for c in all_cells() if buildkite.is_selected(c, changed)} == expected


def test_pipeline_command_puts_cells_a_change_does_not_touch_behind_a_block_step(capsys):
    assert main(["pipeline", "--format", "json", "--changed-files", "Dockerfile.cuda"]) == 0
    steps = by_key(json.loads(capsys.readouterr().out))
    assert steps["mla-cuda-sm_90"]["depends_on"] == ["image-cuda"]
    assert steps["mla-rocm-gfx942"]["depends_on"] == ["image-rocm", "run-mla-rocm-gfx942"]


def test_changed_files_are_matched_as_checkout_paths(capsys):
    """``./x``, ``a/../x`` and an absolute path inside the checkout select what ``x`` selects
    (they matched no glob, so every cell was blocked); no path at all is said on stderr."""

    def blocked(*paths: str) -> tuple[set[str], str]:
        assert main(["pipeline", "--format", "json", "--changed-files", *paths]) == 0
        out = capsys.readouterr()
        steps = by_key(json.loads(out.out))
        return {k for k, s in steps.items() if "block" in s}, out.err

    plain, err = blocked("Dockerfile.cuda")
    assert plain and not err
    for path in ("./Dockerfile.cuda", "k8s/../Dockerfile.cuda", str(ROOT / "Dockerfile.cuda")):
        assert blocked(path) == (plain, "")
    none, err = blocked()
    assert none > plain and "--changed-files names no file" in err


def _repo(path: Path):
    """A git repository at ``path`` with one commit (a noxfile) on ``main``, and its git."""

    def git(*argv: str) -> str:
        out = subprocess.run(["git", "-C", str(path), *argv], check=True, capture_output=True,
                             text=True)  # fmt: skip
        return out.stdout.strip()

    git("init", "-q", "-b", "main")
    git("config", "user.email", "ci@example.invalid")
    git("config", "user.name", "ci")
    (path / "noxfile.py").write_text("")
    git("add", "noxfile.py")
    git("commit", "-q", "-m", "base")
    return git


def test_changed_files_since_the_merge_base(tmp_path):
    git = _repo(tmp_path)
    git("checkout", "-q", "-b", "change")
    (tmp_path / "Dockerfile.rocm").write_text("FROM scratch\n")
    git("add", "Dockerfile.rocm")
    git("commit", "-q", "-m", "rocm image")
    git("checkout", "-q", "main")
    (tmp_path / "noxfile.py").write_text("# main moved on\n")
    git("commit", "-q", "-am", "later on main")
    git("checkout", "-q", "change")
    # Only the branch's own change counts, not what main did since it forked.
    assert buildkite.changed_files_since("main", cwd=str(tmp_path)) == ["Dockerfile.rocm"]


def test_pipeline_generation_never_loads_the_kubernetes_client():
    # The generator runs on a plain CPU agent: it renders podSpecs from the templates and names
    # images, and needs neither the launcher nor the `kubernetes` package (the `ci` extra).
    code = (
        "import sys\n"
        "from kubematrix.__main__ import main\n"
        "assert main(['pipeline', '--lanes', 'k8s', '--output', sys.argv[1]]) == 0\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'kubernetes'"
        " or m in ('kubematrix.k8s', 'kubematrix.launcher'))\n"
        "assert not loaded, loaded\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "BUILDKITE_COMMIT": COMMIT}
    out = subprocess.run(
        [sys.executable, "-c", code, os.devnull], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--changed-since", "no-such-ref"],
         "kubematrix pipeline: --changed-since no-such-ref: `git diff --name-only "
         "no-such-ref...HEAD` failed: fatal: "),
        (["--lanes", "k8s", "--commit", "a b"],
         "kubematrix pipeline: commit must make the image tag <vendor>-<commit> a Docker tag"),
        (["--commit", "x" * 130],
         "kubematrix pipeline: commit must make the image tag <vendor>-<commit> a Docker tag"),
        (["--changed-since=--output=x"],
         "kubematrix pipeline: --changed-since must be a git revision, not an option; got "
         "'--output=x'"),
        (["--changed-files", "/elsewhere/noxfile.py"],
         "kubematrix pipeline: --changed-files /elsewhere/noxfile.py: must be a path inside "
         "the checkout"),
        (["--changed-files", "../noxfile.py"],
         "kubematrix pipeline: --changed-files ../noxfile.py: must be a path inside"),
        (["--root", "/nonexistent", "--changed-since", "main"],
         "kubematrix pipeline: --root /nonexistent: no such folder"),
    ],
)  # fmt: skip
def test_pipeline_usage_errors_name_the_option(argv, message, capsys):
    """An unknown base ref or a commit that cannot tag an image: exit 2 and one line, no
    traceback and no pipeline."""
    assert main(["pipeline", *argv]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(message), out.err


@pytest.mark.parametrize("option", ["--changed-since", "--output", "-o", "--root", "--commit"])
def test_pipeline_refuses_an_empty_value_by_name(option, tmp_path, capsys):
    """`--changed-since ""` used to give the full pipeline, `-o ""` to write to stdout."""
    with pytest.raises(SystemExit) as exit_:
        main(["pipeline", option, ""])
    assert exit_.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and "must not be empty" in out.err and f"{option}" in out.err


def test_pipeline_outside_a_checkout_names_the_root_and_reads_one_given_by_root(tmp_path, schema):
    """`kubematrix pipeline` in any folder: the error names that folder, the missing inputs and
    `--root`; with `--root <checkout>` it prints a pipeline that Buildkite accepts."""
    cmd = [sys.executable, "-m", "kubematrix", "pipeline"]
    env = {**os.environ, "BUILDKITE_COMMIT": COMMIT}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert f"image inputs missing under {tmp_path}: Dockerfile.cuda, " in proc.stderr
    assert "point --root at one" in proc.stderr
    for lanes in buildkite.LANES:
        out = subprocess.run(
            [*cmd, "--root", str(ROOT), "--lanes", lanes],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        pipeline = yaml.safe_load(out)
        jsonschema.validate(pipeline, schema)
        keys = {s["key"]: s for s in command_steps(pipeline)}
        want = images.content_key("cuda", ROOT)
        assert keys["image-cuda"]["env"]["KUBEMATRIX_IMAGE_KEY"] == want


def test_pipeline_output_makes_its_folder_or_says_why_not(tmp_path, capsys):
    target = tmp_path / "new" / "deeper" / "pipeline.yml"
    assert main(["pipeline", "--output", str(target)]) == 0
    assert yaml.safe_load(target.read_text())["steps"]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["pipeline", "--output", str(blocker / "pipeline.yml")]) == 2
    assert f"kubematrix pipeline: --output {blocker / 'pipeline.yml'}: cannot write it:" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("env", "value", "lanes", "rule"),
    [
        ("KUBEMATRIX_REGISTRY_SECRET", "Bad_Secret", "k8s", "a Kubernetes object name"),
        ("KUBEMATRIX_BUILDKIT_IMAGE", "moby/buildkit latest", "k8s", "an image reference"),
        # no space, yet no reference Kubernetes can pull (it reached the podSpec)
        ("KUBEMATRIX_BUILDKIT_IMAGE", "Moby/BuildKit:Latest", "k8s", "an image reference"),
        ("KUBEMATRIX_IMAGE_QUEUE", "my queue", "queues", "a name without spaces"),
    ],
)
def test_pipeline_settings_are_named_when_they_cannot_work(
    env, value, lanes, rule, monkeypatch, capsys
):
    """Not a pipeline whose image pod Kubernetes refuses (or an agent queue nobody serves)."""
    monkeypatch.setenv(env, value)
    assert main(["pipeline", "--lanes", lanes]) == 2
    assert f"kubematrix pipeline: {env} must be {rule}" in capsys.readouterr().err


def test_a_k8s_lane_step_runs_its_nox_command_under_the_agent(tmp_path):
    """The agent runs BUILDKITE_COMMAND with its shell (`/bin/sh -ec` in a command container).
    The pods once held ``["/bin/sh", "-c"]`` + ``[script]``, which the buildkite interposer
    made into the lines ``/bin/sh`` and ``-c '...'``: the second failed with "-c: not found"
    and nox never ran. A recording ``nox`` on PATH shows the step's own words arrive."""
    record = tmp_path / "argv"
    fake = tmp_path / "bin" / "nox"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    pipeline = buildkite.generate(lanes="k8s", commit=COMMIT)
    gpu_steps = [s for s in cell_steps(pipeline) if "plugins" in s]
    assert gpu_steps
    for step in gpu_steps:
        plugin = step["plugins"][0]["kubernetes"]
        (container,) = plugin["podSpec"]["containers"]
        script = buildkite_command(plugin, container)
        record.unlink(missing_ok=True)
        proc = subprocess.run(["/bin/sh", "-ec", script], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert record.read_text().splitlines() == shlex.split(step["command"])[1:]


def test_a_symbolic_buildkite_commit_is_resolved_in_the_checkout(tmp_path, monkeypatch):
    """A build created for ``HEAD`` (or a branch) has that name in BUILDKITE_COMMIT: its image
    tags were ``<vendor>-HEAD`` for every such build. The checkout's HEAD is the commit."""
    head = _repo(tmp_path)("rev-parse", "HEAD")
    for given in ("HEAD", "main", ""):
        monkeypatch.setenv("BUILDKITE_COMMIT", given)
        assert buildkite._default_commit(str(tmp_path)) == head
    monkeypatch.setenv("BUILDKITE_COMMIT", COMMIT)
    assert buildkite._default_commit(str(tmp_path)) == COMMIT  # a hash is taken as given
    monkeypatch.setenv("BUILDKITE_COMMIT", "HEAD")
    with pytest.raises(ValueError, match=r"BUILDKITE_COMMIT is 'HEAD', not a commit hash, and"):
        buildkite._default_commit(str(tmp_path / "nowhere"))
