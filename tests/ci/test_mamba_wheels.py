"""tools/mamba_wheels.py: gencode restriction, arch parsing, and a real pip build of an sdist.

The sdists themselves are CUDA builds (minutes on 16 cores, a GPU image); here the same code path
runs on a stand-in sdist whose setup.py has the packages' gencode blocks and records the flags it
was built with, so the test sees what nvcc would have been given.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.ci

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mamba_wheels", ROOT / "tools" / "mamba_wheels.py")
assert _spec and _spec.loader
mw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mw)

# The shape of both packages' CUDA branch: unconditional pairs, then pairs under version checks.
SETUP_GENCODES = """\
cc_flag = []
if True:
    cc_flag.append("-gencode")
    cc_flag.append("arch=compute_75,code=sm_75")
    cc_flag.append("-gencode")
    cc_flag.append("arch=compute_80,code=sm_80")
    if VERSION >= 11.8:
        cc_flag.append("-gencode")
        cc_flag.append("arch=compute_90,code=sm_90")
    if VERSION >= 12.8:
        cc_flag.append("-gencode")
        cc_flag.append("arch=compute_100,code=sm_100")
        cc_flag.append("-gencode")
        cc_flag.append("arch=compute_120,code=sm_120")
"""


def _flags(text: str) -> list[str]:
    scope: dict = {"VERSION": 13.0}
    exec(compile(text, "setup.py", "exec"), scope)
    return scope["cc_flag"]


@pytest.mark.parametrize(
    ("keep", "want"),
    [
        (["90"], ["arch=compute_90,code=sm_90"]),
        (["90", "100"], ["arch=compute_90,code=sm_90", "arch=compute_100,code=sm_100"]),
        (["120"], ["arch=compute_120,code=sm_120"]),
    ],
)
def test_restrict_keeps_only_the_asked_gencodes_and_stays_valid(keep, want):
    flags = _flags(mw.restrict_gencodes(SETUP_GENCODES, keep))
    assert flags[1::2] == want and set(flags[0::2]) == {"-gencode"}


def test_restrict_refuses_an_arch_the_file_does_not_build():
    with pytest.raises(ValueError, match=r"--arch \['89'\] not among x.tar.gz's gencode archi"):
        mw.restrict_gencodes(SETUP_GENCODES, ["90", "89"], name="x.tar.gz")
    with pytest.raises(ValueError, match="has no cc_flag gencode pairs"):
        mw.restrict_gencodes("cc_flag = ['-O3']\n", ["90"])


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("9.0", ("cuda", ["90"])),
        ("9.0;10.0", ("cuda", ["90", "100"])),
        ("9.0a", ("cuda", ["90"])),
        ("gfx942", ("hip", ["gfx942"])),
        ("gfx942;gfx950", ("hip", ["gfx942", "gfx950"])),
    ],
)
def test_arch_lists_are_read_as_cuda_capabilities_or_gfx_names(text, want):
    assert mw.parse_archs(text) == want


@pytest.mark.parametrize("text", ["", "9.0;gfx942", "sm_90", "hopper"])
def test_an_arch_list_that_is_not_cuda_capabilities_or_gfx_names_is_refused(text):
    with pytest.raises(ValueError, match="mamba_wheels: --arch must"):
        mw.parse_archs(text)


def _tar(folder: Path, name: str, files: dict[str, str]) -> Path:
    """``folder/name`` as a gzipped tarball of ``files`` (relative paths -> text)."""
    src = folder / "src" / name
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    sdist = folder / name
    with tarfile.open(sdist, "w:gz") as tar:
        for child in sorted(src.iterdir()):
            tar.add(child, arcname=child.name)
    return sdist


def _stand_in_sdist(folder: Path) -> Path:
    """causal_conv1d-0.0.1.tar.gz: a pure-Python package whose setup.py records cc_flag and
    whether the FORCE_BUILD switch was set, as the real one reads it."""
    record = (
        "import json, os\nfrom setuptools import setup\nVERSION = 13.0\n"
        + SETUP_GENCODES
        + "json.dump({'cc_flag': cc_flag, 'force': os.getenv('CAUSAL_CONV1D_FORCE_BUILD')},"
        " open('causal_conv1d/built.json', 'w'))\n"
        "setup(name='causal_conv1d', version='0.0.1', packages=['causal_conv1d'],"
        " package_data={'causal_conv1d': ['built.json']})\n"
    )
    top = "causal_conv1d-0.0.1"
    return _tar(folder, f"{top}.tar.gz",
                {f"{top}/causal_conv1d/__init__.py": "", f"{top}/setup.py": record})  # fmt: skip


def test_builds_a_wheel_from_the_patched_sdist(tmp_path):
    sdists, out = tmp_path / "sdists", tmp_path / "wheels"
    sdists.mkdir()
    _stand_in_sdist(sdists)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "mamba_wheels.py"), "--arch", "9.0"]
        + ["--sdists", str(sdists), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "built causal_conv1d-0.0.1.tar.gz in" in proc.stdout
    (wheel,) = out.glob("causal_conv1d-0.0.1-*.whl")
    with zipfile.ZipFile(wheel) as z:
        built = json.loads(z.read("causal_conv1d/built.json"))
    assert built == {"cc_flag": ["-gencode", "arch=compute_90,code=sm_90"], "force": "TRUE"}


def test_usage_errors_exit_2_naming_the_problem(tmp_path):
    run = [sys.executable, str(ROOT / "tools" / "mamba_wheels.py")]
    both = subprocess.run([*run, "--arch", "9.0", "--out", str(tmp_path)], capture_output=True)
    assert both.returncode == 2 and b"give either --sdists DIR or requirements" in both.stderr
    empty = subprocess.run(
        [*run, "--arch", "9.0", "--out", str(tmp_path), "--sdists", str(tmp_path)],
        capture_output=True,
    )
    assert empty.returncode == 2 and b"holds no *.tar.gz" in empty.stderr
    bad = subprocess.run(
        [*run, "--arch", "sm_90", "--out", str(tmp_path), "x==1"], capture_output=True
    )
    assert bad.returncode == 2 and b"--arch must be CUDA capabilities" in bad.stderr


def test_loose_requirements_and_an_unmakeable_out_are_usage_errors(tmp_path):
    run = [sys.executable, str(ROOT / "tools" / "mamba_wheels.py"), "--arch", "9.0"]
    loose = subprocess.run([*run, "--out", str(tmp_path), "mamba-ssm>=2"], capture_output=True)
    assert loose.returncode == 2
    assert b"requirements must be pinned as name==version; got ['mamba-ssm>=2']" in loose.stderr
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "wheels"
    blocked = subprocess.run(
        [*run, "--out", str(out), "mamba-ssm==2.3.2.post1"], capture_output=True
    )
    assert blocked.returncode == 2 and f"--out {out}: cannot make it".encode() in blocked.stderr


def test_a_failed_build_exits_1_naming_the_step_without_a_traceback(tmp_path):
    """An sdist without the asked architecture, and a setup.py that fails: one line each."""
    sdists = tmp_path / "sdists"
    sdists.mkdir()
    _stand_in_sdist(sdists)
    run = [sys.executable, str(ROOT / "tools" / "mamba_wheels.py"), "--sdists", str(sdists)]
    missing = subprocess.run(
        [*run, "--arch", "7.0", "--out", str(tmp_path / "w")], capture_output=True, text=True
    )
    assert missing.returncode == 1 and "Traceback" not in missing.stderr, missing.stderr
    assert "--arch ['70'] not among causal_conv1d-0.0.1.tar.gz's gencode" in missing.stderr
    src = tmp_path / "broken" / "causal_conv1d-0.0.2"
    src.mkdir(parents=True)
    (src / "setup.py").write_text(SETUP_GENCODES + "raise SystemExit('setup.py fails')\n")
    with tarfile.open(sdists / "causal_conv1d-0.0.2.tar.gz", "w:gz") as tar:
        tar.add(src, arcname=src.name)
    failed = subprocess.run(
        [*run, "--arch", "9.0", "--out", str(tmp_path / "w")], capture_output=True, text=True
    )
    assert failed.returncode == 1 and "Traceback" not in failed.stderr.split("mamba_wheels:")[-1]
    assert "pip wheel ...` failed with exit status" in failed.stderr, failed.stderr


def test_a_sdist_or_requirement_that_is_no_mamba_extension_stops_before_any_build(tmp_path):
    """It was refused only after the builds before it, leaving a partial set of wheels."""
    sdists, out = tmp_path / "sdists", tmp_path / "wheels"
    sdists.mkdir()
    _stand_in_sdist(sdists)
    (sdists / "foo-1.0.tar.gz").write_bytes(b"")
    run = [sys.executable, str(ROOT / "tools" / "mamba_wheels.py"), "--arch", "9.0"]
    proc = subprocess.run([*run, "--sdists", str(sdists), "--out", str(out)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "got ['foo-1.0.tar.gz']" in proc.stderr, proc.stderr
    assert not list(out.glob("*.whl"))
    req = subprocess.run([*run, "--out", str(out), "numpy==2.0", "mamba-ssm==2.3.2"],
                         capture_output=True, text=True)  # fmt: skip
    assert req.returncode == 2 and "got ['numpy==2.0']" in req.stderr, req.stderr


def test_a_malformed_sdist_is_named_in_one_line(tmp_path):
    cases = {
        "causal_conv1d-1.0.tar.gz": "is not a readable tarball",
        "causal_conv1d-2.0.tar.gz": "holds no causal_conv1d-2.0/setup.py",
        "causal_conv1d-3.0.tar.gz": "must hold one top folder; got 2",
    }
    run = [sys.executable, str(ROOT / "tools" / "mamba_wheels.py"), "--arch", "9.0"]
    for name, message in cases.items():
        sdists = tmp_path / name / "sdists"
        sdists.mkdir(parents=True)
        if "1.0" in name:
            (sdists / name).write_bytes(b"not a tarball")
        elif "2.0" in name:
            _tar(sdists, name, {"causal_conv1d-2.0/README": "x"})
        else:
            _tar(sdists, name, {"a/setup.py": "", "b/setup.py": ""})
        proc = subprocess.run([*run, "--sdists", str(sdists), "--out", str(tmp_path / "w")],
                              capture_output=True, text=True)  # fmt: skip
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert f"mamba_wheels: {name} {message}" in proc.stderr, proc.stderr


def test_arch_decides_the_hip_targets_over_an_inherited_variable(tmp_path):
    """An inherited HIP_ARCHITECTURES won over --arch (the log named --arch's targets)."""
    sdists, out = tmp_path / "sdists", tmp_path / "wheels"
    sdists.mkdir()
    setup = (
        "import os\nfrom setuptools import setup\n"
        "open('causal_conv1d/hip.txt', 'w').write(os.environ['HIP_ARCHITECTURES'])\n"
        "setup(name='causal_conv1d', version='0.0.3', packages=['causal_conv1d'],"
        " package_data={'causal_conv1d': ['hip.txt']})\n"
    )
    top = "causal_conv1d-0.0.3"
    _tar(
        sdists, f"{top}.tar.gz", {f"{top}/setup.py": setup, f"{top}/causal_conv1d/__init__.py": ""}
    )
    env = {**os.environ, "HIP_ARCHITECTURES": "gfx90a"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "mamba_wheels.py"), "--arch", "gfx942",
         "--sdists", str(sdists), "--out", str(out)], capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob("causal_conv1d-0.0.3-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert z.read("causal_conv1d/hip.txt").decode() == "gfx942"


def test_a_hip_build_gets_an_offload_arch_flag_clang_takes_and_torch_its_own_list(tmp_path):
    """Both setup.py files put HIP_ARCHITECTURES verbatim into one --offload-arch flag: given
    ``gfx942;gfx950`` it was ``--offload-arch=gfx942;gfx950``, which clang refuses."""
    sdists, out = tmp_path / "sdists", tmp_path / "wheels"
    sdists.mkdir()
    setup = (
        "import json, os\nfrom setuptools import setup\n"
        # as both sdists' setup.py build their HIP nvcc flags (causal-conv1d 1.7.0, mamba-ssm
        # 2.3.2.post1), verbatim
        "nvcc = ['-O3', '-std=c++17',\n"
        "        f\"--offload-arch={os.getenv('HIP_ARCHITECTURES', 'native')}\"]\n"
        "json.dump({'nvcc': nvcc, 'torch': os.getenv('PYTORCH_ROCM_ARCH')},"
        " open('causal_conv1d/hip.json', 'w'))\n"
        "setup(name='causal_conv1d', version='0.0.4', packages=['causal_conv1d'],"
        " package_data={'causal_conv1d': ['hip.json']})\n"
    )  # fmt: skip
    top = "causal_conv1d-0.0.4"
    _tar(
        sdists, f"{top}.tar.gz", {f"{top}/setup.py": setup, f"{top}/causal_conv1d/__init__.py": ""}
    )
    # Dockerfile.rocm's ENV: both variables as GPU_ARCHS, ';'-separated (here another list).
    env = {**os.environ, "HIP_ARCHITECTURES": "gfx90a;gfx908", "PYTORCH_ROCM_ARCH": "gfx90a"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "mamba_wheels.py"), "--arch", "gfx942;gfx950",
         "--sdists", str(sdists), "--out", str(out)], capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob(f"{top}-*.whl")
    with zipfile.ZipFile(wheel) as z:
        built = json.loads(z.read("causal_conv1d/hip.json"))
    flags = [f for f in built["nvcc"] if f.startswith("--offload-arch")]
    # one flag, a comma-separated list of targets: what clang's --offload-arch= takes
    assert flags == ["--offload-arch=gfx942,gfx950"]
    # torch's cpp_extension splits PYTORCH_ROCM_ARCH on ';' (one --offload-arch per target)
    assert built["torch"].split(";") == ["gfx942", "gfx950"]
