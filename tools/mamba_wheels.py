"""Build the Mamba extensions' wheels (causal-conv1d, mamba-ssm) for the GPU images' pools only.

Both packages are source-only CUDA/HIP extensions. Their CUDA ``setup.py`` files hard-code a
``-gencode`` pair for every architecture from sm_75 to sm_121 and ignore ``TORCH_CUDA_ARCH_LIST``
(mamba-ssm even clears it), so a build for one pool compiles about nine architectures: neither
finished in ~4.5 minutes on 16 cores. This script unpacks each sdist, keeps only the gencode pairs
of the architectures asked for (and fails, naming the file, if one of them is not in it), then
builds the wheel exactly as a user would: ``pip wheel --no-build-isolation --no-deps`` with the
packages' ``*_FORCE_BUILD=TRUE`` (never the prebuilt-wheel download). ROCm builds honour
``HIP_ARCHITECTURES`` already and are built unpatched; both setup.py files put it verbatim into
one ``--offload-arch=`` flag, so it is given comma-separated (``gfx942,gfx950``: clang takes a
list there, and reads ``;`` as part of the name), while torch's ``PYTORCH_ROCM_ARCH`` keeps its
``;`` form.

The wheels are built, and installed, without their declared requirements (`RUNTIME_REQUIREMENTS`
says why and what the images install beside them instead)::

    python tools/mamba_wheels.py --runtime-requirements   # one per line, for pip -r

Used by both Dockerfiles' wheel stage, and by hand on a GPU machine::

    python tools/mamba_wheels.py --arch "9.0" --out /opt/wheels \
        causal-conv1d==1.7.0 mamba-ssm==2.3.2.post1
    python tools/mamba_wheels.py --arch "9.0" --sdists ./sdists --out ./wheels   # offline

``--arch`` takes ``TORCH_CUDA_ARCH_LIST``'s form (``"9.0"``, ``"9.0;10.0"``) or AMD names
(``"gfx942"``). Standard library only (it runs in the image before anything else is installed).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

# The package's switch that skips the prebuilt-wheel download (by sdist name prefix).
FORCE_BUILD_ENV = {"causal_conv1d": "CAUSAL_CONV1D_FORCE_BUILD", "mamba_ssm": "MAMBA_FORCE_BUILD"}
#: What the wheels need at run time, beside the base image's torch and Triton: the modules that
#: ``import mamba_ssm``, ``from mamba_ssm.ops.selective_scan_interface import selective_scan_fn``
#: and ``import causal_conv1d`` import outside a ``try/except ImportError`` (mamba-ssm 2.3.2.post1,
#: causal-conv1d 1.7.0; huggingface_hub: ``mamba_ssm.modules.mamba2``). The images install the
#: wheels ``--no-deps`` and these from the index under the backend's constraints, because the
#: wheels' declared requirements cannot be installed as they stand: see `NOT_INSTALLED`.
RUNTIME_REQUIREMENTS = ("einops", "packaging", "transformers", "huggingface-hub")
#: The wheels' declared requirements that the images do not install, and why.
NOT_INSTALLED = {
    "torch": "the base image's, pinned by the constraints",
    "triton": "the base image's (on ROCm pytorch-triton-rocm: PyPI's would be a second Triton)",
    "ninja": "a build tool (the wheels stage has it)",
    "tilelang": "Mamba-3's MIMO kernels only (imported under try/except ImportError; unused)",
    "apache-tvm-ffi": "tilelang's",
    "quack-kernels": "Mamba-3's CuTe DSL step kernel only (NVIDIA; under try/except ImportError)",
}
# One gencode pair as both setup.py files write it: two consecutive appends to ``cc_flag``.
_GENCODE_PAIR = re.compile(
    r'^(?P<indent>[ \t]*)cc_flag\.append\("-gencode"\)[ \t]*\n'
    r'[ \t]*cc_flag\.append\("arch=compute_(?P<cc>\d+),code=sm_(?P=cc)"\)[ \t]*$',
    re.MULTILINE,
)


def parse_archs(text: str) -> tuple[str, list[str]]:
    """``("cuda", ["90", "100"])`` from ``"9.0;10.0"``; ``("hip", ["gfx942"])`` from ``"gfx942"``.

    Raises:
        ValueError: empty, mixed vendors, or an entry of neither form.
    """
    items = [a.strip() for a in re.split(r"[;,\s]+", text) if a.strip()]
    if not items:
        raise ValueError(f"mamba_wheels: --arch must name at least one architecture; got {text!r}")
    cuda = [a for a in items if re.fullmatch(r"\d+\.\d+a?", a)]
    hip = [a for a in items if re.fullmatch(r"gfx[0-9a-f]+", a)]
    if len(cuda) == len(items):
        return "cuda", [a.rstrip("a").replace(".", "") for a in items]
    if len(hip) == len(items):
        return "hip", items
    raise ValueError(
        "mamba_wheels: --arch must be CUDA capabilities like '9.0;10.0' or AMD names like "
        f"'gfx942', not a mix; got {text!r}"
    )


def restrict_gencodes(setup_py: str, keep: list[str], *, name: str = "setup.py") -> str:
    """``setup_py`` with every ``-gencode`` pair outside ``keep`` (``["90"]``) turned into ``pass``.

    Each removed append becomes a ``pass`` line at the same indentation, so an ``if`` whose body
    held only gencodes stays valid Python.

    Raises:
        ValueError: the file has no gencode pairs, or lacks one of ``keep`` (a new release changed
            its build script: check it before building).
    """
    found = [m.group("cc") for m in _GENCODE_PAIR.finditer(setup_py)]
    if not found:
        raise ValueError(f"mamba_wheels: {name} has no cc_flag gencode pairs to restrict")
    missing = [cc for cc in keep if cc not in found]
    if missing:
        raise ValueError(
            f"mamba_wheels: --arch {missing} not among {name}'s gencode architectures {found}"
        )

    def edit(m: re.Match[str]) -> str:
        if m.group("cc") in keep:
            return m.group(0)
        line = f"{m.group('indent')}pass  # portattn: sm_{m.group('cc')} not built"
        return f"{line}\n{line}"

    return _GENCODE_PAIR.sub(edit, setup_py)


def hip_arch_env(archs: list[str]) -> dict[str, str]:
    """The variables a ROCm build reads its targets from, for ``archs`` (``["gfx942", "gfx950"]``).

    ``HIP_ARCHITECTURES``: both setup.py files pass it verbatim as one
    ``--offload-arch={HIP_ARCHITECTURES}`` flag, so comma-separated (``gfx942,gfx950``), the list
    clang takes there (torch quotes the flag whole: ``gfx942;gfx950`` reaches clang as one
    architecture name, which it refuses).
    ``PYTORCH_ROCM_ARCH``: torch's ``cpp_extension`` splits it on ``;``, its documented form.
    """
    return {"HIP_ARCHITECTURES": ",".join(archs), "PYTORCH_ROCM_ARCH": ";".join(archs)}


def _unpack(sdist: Path, into: Path) -> Path:
    """The sdist's one top folder, holding its ``setup.py``.

    Raises:
        ValueError: naming the sdist: not a tarball, not one top folder, or no ``setup.py``.
    """
    try:
        with tarfile.open(sdist) as tar:
            tar.extractall(into, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise ValueError(f"mamba_wheels: {sdist.name} is not a readable tarball ({exc})") from None
    tops = [p for p in into.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise ValueError(f"mamba_wheels: {sdist.name} must hold one top folder; got {len(tops)}")
    if not (tops[0] / "setup.py").is_file():
        raise ValueError(f"mamba_wheels: {sdist.name} holds no {tops[0].name}/setup.py")
    return tops[0]


def _extension_errors(names: list[str]) -> list[str]:
    """The sdist or requirement names (``name-version.tar.gz`` / ``name==version``) that are not
    a Mamba extension of `FORCE_BUILD_ENV`: checked before anything is downloaded or built."""

    def norm(n: str) -> str:
        return re.split(r"==|-\d", n, maxsplit=1)[0].replace("-", "_").lower()

    return [n for n in names if norm(n) not in FORCE_BUILD_ENV]


def _download(requirements: list[str], into: Path) -> list[Path]:
    """The sdists of ``requirements`` (their metadata step imports torch: no build isolation)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    subprocess.run([*cmd, "--no-build-isolation", "-d", str(into), *requirements], check=True)
    return sorted(into.glob("*.tar.gz"))


def build(sdists: list[Path], out: Path, vendor: str, archs: list[str]) -> list[tuple[str, float]]:
    """Build one wheel per sdist into ``out``; returns (sdist name, seconds) per build."""
    out.mkdir(parents=True, exist_ok=True)
    times = []
    for sdist in sdists:
        prefix = next((p for p in FORCE_BUILD_ENV if sdist.name.startswith(p)), None)
        if prefix is None:
            raise ValueError(
                f"mamba_wheels: sdist must be one of {sorted(FORCE_BUILD_ENV)}; got {sdist.name}"
            )
        with tempfile.TemporaryDirectory() as tmp:
            src = _unpack(sdist, Path(tmp))
            setup = src / "setup.py"
            if vendor == "cuda":
                setup.write_text(restrict_gencodes(setup.read_text(), archs, name=sdist.name))
            env = {**os.environ, FORCE_BUILD_ENV[prefix]: "TRUE"}
            if vendor == "hip":  # --arch decides, not an inherited value the log would not name
                env.update(hip_arch_env(archs))
            start = time.monotonic()
            print(f"mamba_wheels: building {sdist.name} for {vendor} {archs}", flush=True)
            pip = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps"]
            subprocess.run([*pip, "-w", str(out), str(src)], env=env, check=True)
            seconds = time.monotonic() - start
            print(f"mamba_wheels: built {sdist.name} in {seconds:.0f} s", flush=True)
            times.append((sdist.name, seconds))
    return times


class _PrintRuntimeRequirements(argparse.Action):
    """``--runtime-requirements``: like ``--version``, prints and exits before the other options
    (``--arch``, ``--out``) are required."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print("\n".join(RUNTIME_REQUIREMENTS))
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--runtime-requirements",
        action=_PrintRuntimeRequirements,
        help="print what the wheels need at run time (one per line, for pip -r) and exit",
    )
    ap.add_argument("--arch", required=True, help="'9.0', '9.0;10.0' or 'gfx942'")
    ap.add_argument("--out", required=True, type=Path, help="where the wheels go")
    ap.add_argument("--sdists", type=Path, help="a folder of sdists (offline); else download")
    ap.add_argument("requirements", nargs="*", help="pinned requirements to download")
    args = ap.parse_args(argv)
    try:
        vendor, archs = parse_archs(args.arch)
    except ValueError as e:
        ap.error(str(e))
    if (args.sdists is None) == (not args.requirements):
        ap.error("give either --sdists DIR or requirements to download, not both or neither")
    if args.sdists is not None and not sorted(args.sdists.glob("*.tar.gz")):
        ap.error(f"--sdists {args.sdists} holds no *.tar.gz")
    loose = [r for r in args.requirements if not _PINNED.fullmatch(r)]
    if loose:
        ap.error(f"requirements must be pinned as name==version; got {loose}")
    given = [p.name for p in sorted(args.sdists.glob("*.tar.gz"))] if args.sdists else []
    others = _extension_errors(given + args.requirements)
    if others:  # before any build: a late refusal left a partial set of wheels
        ap.error(f"sdists and requirements must be of {sorted(FORCE_BUILD_ENV)}; got {others}")
    try:  # before any download or build: a folder that cannot be made loses every wheel
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        ap.error(f"--out {args.out}: cannot make it ({exc})")
    try:
        _run(args, vendor, archs)
    except subprocess.CalledProcessError as exc:
        what = " ".join(str(a) for a in exc.cmd[:4])
        print(f"mamba_wheels: `{what} ...` failed with exit status {exc.returncode} (its output is "
              "above)", file=sys.stderr)  # fmt: skip
        return 1
    except ValueError as exc:  # an sdist that is not a Mamba extension, a setup.py changed
        print(str(exc), file=sys.stderr)
        return 1
    return 0


# A pinned requirement: ``name==version`` (what the Dockerfiles pass).
_PINNED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9][A-Za-z0-9._+!-]*")


def _run(args: argparse.Namespace, vendor: str, archs: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if args.sdists is not None:
            sdists = sorted(args.sdists.glob("*.tar.gz"))
        else:
            sdists = _download(args.requirements, Path(tmp))
        # causal-conv1d first: mamba-ssm's Python code imports it where it is installed.
        sdists.sort(key=lambda p: not p.name.startswith("causal_conv1d"))
        build(sdists, args.out, vendor, archs)


if __name__ == "__main__":
    sys.exit(main())
