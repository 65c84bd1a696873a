"""What a stage's result depends on besides its params: its code and the libraries that run it.

`code_files(script)` follows a stage script's imports within this package (statically, with `ast`, so an
import inside a function counts too) and returns every file that can run: the script, each imported module
and the `__init__.py` of every package on the way. The same list is

- what dvc.yaml must list as the stage's code deps (`stage_code_deps`; `make deps` writes them, and
  tests/test_provenance.py fails on a missing or stale one), so editing any of them reruns the stage, and
- hashed into a training checkpoint's fingerprint (`fingerprint`), so a rerun under changed code starts
  afresh instead of resuming (or returning) weights the old code trained.

The files are read from the tree the process imports this package from: the launcher (`coarse2fine.launch`)
points every worker at the tree its stage runs in, so the digest is of the code that actually runs.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
from collections.abc import Iterable
from pathlib import Path

import coarse2fine

PACKAGE = coarse2fine.__name__
PACKAGE_DIR = Path(coarse2fine.__file__).resolve().parent
LAUNCHER = "coarse2fine.launch"  # a stage command that goes through it runs the launcher's code too
# The third-party code a trained result depends on most: a different version may train differently.
RESULT_LIBRARIES = ("torch", "torchvision", "timm", "numpy", "pillow", "nvidia-dali-cuda130")


def code_files(script: str | Path) -> list[Path]:
    """`script` and every file of this package it imports, transitively; sorted, script first."""
    script = Path(script).resolve()
    seen: set[Path] = set()
    pending = [script]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        pending.extend(_imported_files(path))
    return [script, *sorted(seen - {script})]


def stage_code_deps(command: str, root: Path) -> list[str]:
    """dvc.yaml's code deps of a stage running `command` in the project at `root`: its script's `code_files`, plus
    the launcher's when the command goes through it; paths relative to `root`, the script first."""
    script = next(word for word in command.split() if word.startswith("stages/"))
    files = code_files(root / script)
    if LAUNCHER in command:
        files += code_files(root / "src/coarse2fine/launch.py")
    relative = [path.relative_to(root).as_posix() for path in files]
    return [relative[0], *sorted(set(relative[1:]) - {relative[0]})]


def code_digest(files: Iterable[Path]) -> str:
    """sha256 over the files' names (relative to the package's parent) and contents."""
    digest = hashlib.sha256()
    for path in files:
        name = path.relative_to(PACKAGE_DIR.parent) if path.is_relative_to(PACKAGE_DIR.parent) else Path(path.name)
        content = path.read_bytes()
        digest.update(f"{name.as_posix()}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()


def library_versions() -> dict[str, str]:
    """Installed versions of RESULT_LIBRARIES ("absent" for one that is not installed, e.g. DALI)."""
    versions = {}
    for name in RESULT_LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def fingerprint(script: str | Path) -> dict[str, str]:
    """The code digest of `script` and the library versions, as flat strings for a checkpoint's inputs."""
    return {"code": code_digest(code_files(script)), **{f"version.{k}": v for k, v in library_versions().items()}}


def _imported_files(path: Path) -> set[Path]:
    """The files of this package that `path`'s import statements load (modules and their packages' __init__)."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    package = _module_name(path)
    files: set[Path] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            # `from pkg import name`: name may be a submodule or an attribute of pkg; keep whichever exists.
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            files |= _files_of(name)
    return files


def _module_name(path: Path) -> str | None:
    """`coarse2fine.data` for .../coarse2fine/data/loaders.py; None for a file outside the package."""
    if not path.is_relative_to(PACKAGE_DIR):
        return None
    return ".".join((PACKAGE, *path.relative_to(PACKAGE_DIR).parent.parts))


def _absolute(node: ast.ImportFrom, package: str | None) -> str:
    if not node.level:
        return node.module or ""
    parts = (package or "").split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _files_of(module: str) -> set[Path]:
    """The existing files that importing `module` executes: every package `__init__.py` on the way and the
    module itself; empty for a module outside this package."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return set()
    files = set()
    directory = PACKAGE_DIR.parent
    for depth, part in enumerate(parts):
        directory = directory / part
        if (directory / "__init__.py").is_file():
            files.add(directory / "__init__.py")
        elif depth == len(parts) - 1 and directory.with_suffix(".py").is_file():
            files.add(directory.with_suffix(".py"))
        else:
            break
    return files
