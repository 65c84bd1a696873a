"""A GPU node's wheelhouse: every pinned wheel the project needs besides torch and torchvision (a GPU node brings
its own build of those, with their CUDA libraries), for a target Python and platform, plus a wheel of the project,
in one folder. On the node, offline: `pip install --no-index --no-deps DIR/*.whl` (docs/gpu.md).

What is needed comes from the installed project's metadata (`make setup`'s .venv, run with its python): the
requirements of coarse2fine[test], followed through each package's own with their markers evaluated for the target
Python, but not through torch and torchvision; every version is requirements.lock's (setuptools' and wheel's,
which pip freeze leaves out of it, the installed ones). A package published as a source distribution only
(tfrecord, antlr4-python3-runtime) is built into a wheel here, as is the project: pure Python, so the wheel fits
every target; one that is not pure Python stops the script.

Usage: `make wheelhouse PYTHON_VERSION=3.12` or `python scripts/gpu_wheels.py --python-version 3.12 --dest DIR`.
DIR is replaced as a whole, so that `DIR/*.whl` never mixes two runs' versions.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PROJECT, PROJECT_EXTRAS = "coarse2fine", ("test",)  # pytest: the node's smoke tests
NODE_OWN = {"torch", "torchvision"}  # with their dependencies, unless something else needs one too
PIP_FREEZE_OMITS = {"pip", "setuptools", "wheel"}  # not in requirements.lock: the installed version is the pin


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python-version", default="3.12", metavar="X.Y", help="the node's Python (default: 3.12)")
    parser.add_argument("--glibc", default="2.28", metavar="2.Y",
                        help="the oldest glibc of the nodes (default: 2.28: RHEL 8, Ubuntu 20.04 and newer)")
    parser.add_argument("--arch", default="x86_64", help="the nodes' CPU (default: x86_64; aarch64 for a GH200)")
    parser.add_argument("--dest", type=Path, default=Path("wheelhouse"), metavar="DIR", help="default: wheelhouse")
    return parser.parse_args()


def manylinux_platforms(glibc: str, arch: str) -> list[str]:
    """Every manylinux tag a node with this glibc runs (pip 23 takes only the tags it is given, not older ones)."""
    newest = int(glibc.split(".")[1])
    legacy = ["manylinux2014", "manylinux2010", "manylinux1"]  # the aliases of glibc 2.17, 2.12 and 2.5
    return [f"{tag}_{arch}" for tag in [f"manylinux_2_{minor}" for minor in range(newest, 4, -1)] + legacy]


def pinned_versions() -> dict[str, str]:
    pins = {name: metadata.version(name) for name in PIP_FREEZE_OMITS}
    for line in (PROJECT_ROOT / "requirements.lock").read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def needed(python_version: str) -> set[str]:
    """The project's requirement closure on the target Python (canonical names), torch's own side left out."""
    environment = {**default_environment(), "python_version": python_version,
                   "python_full_version": f"{python_version}.0"}
    found: set[str] = set()
    todo = [(PROJECT, PROJECT_EXTRAS)]
    seen: set[tuple[str, tuple[str, ...]]] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        for requirement in map(Requirement, metadata.requires(name) or []):
            wanted = requirement.marker is None or any(
                requirement.marker.evaluate({**environment, "extra": extra}) for extra in ("", *extras)
            )
            dependency = canonicalize_name(requirement.name)
            if wanted and dependency not in NODE_OWN:
                found.add(dependency)
                todo.append((dependency, tuple(sorted(requirement.extras))))
    return found


def wheel_of_source(source: Path, python_version: str) -> None:
    """A wheel beside the source distribution `source` (which is removed), or an exit if it is not pure Python."""
    before = set(source.parent.glob("*.whl"))
    pip("wheel", "--no-deps", "-w", str(source.parent), str(source))
    [wheel] = set(source.parent.glob("*.whl")) - before
    if not wheel.name.endswith("-none-any.whl"):
        sys.exit(f"gpu_wheels.py: {source.name} has no wheel for Python {python_version} and builds to {wheel.name}, "
                 "which is not pure Python: build it on the node's Python instead")
    source.unlink()


def project_wheel(dest: Path) -> None:
    """The project's wheel, built from a copy of what it packages (setuptools writes build/ beside the source)."""
    with tempfile.TemporaryDirectory(prefix="coarse2fine-wheel-") as scratch:
        source = Path(scratch)
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(PROJECT_ROOT / name, source / name)
        shutil.copytree(PROJECT_ROOT / "src", source / "src",
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        pip("wheel", "--no-deps", "-w", str(dest), str(source))


def pip(*arguments: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--quiet", *arguments], check=True)


def main() -> None:
    args = parse_args()
    pins = pinned_versions()
    names = needed(args.python_version)
    unpinned = sorted(names - pins.keys())
    if unpinned:
        sys.exit(f"gpu_wheels.py: needed on Python {args.python_version} but not in requirements.lock: "
                 f"{', '.join(unpinned)}")
    partial = args.dest.with_name(f"{args.dest.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    platforms = [option for tag in manylinux_platforms(args.glibc, args.arch) for option in ("--platform", tag)]
    pip("download", "--no-deps", "--prefer-binary", "--python-version", args.python_version, "--implementation", "cp",
        *platforms, "-d", str(partial), *(f"{name}=={pins[name]}" for name in sorted(names)))
    for source in sorted(set(partial.iterdir()) - set(partial.glob("*.whl"))):
        wheel_of_source(source, args.python_version)
    project_wheel(partial)
    shutil.rmtree(args.dest, ignore_errors=True)
    partial.rename(args.dest)
    wheels = sorted(args.dest.glob("*.whl"))
    size = sum(wheel.stat().st_size for wheel in wheels)
    print(f"{args.dest}: {len(wheels)} wheels, {size / 2**20:.0f} MiB, for Python {args.python_version} "
          f"(glibc {args.glibc}, {args.arch}); torch and torchvision are the node's own")


if __name__ == "__main__":
    main()
