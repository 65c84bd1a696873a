"""Atomic file writes (every output is written under a temporary name and renamed into place), file digests, and the
lock that keeps two processes from writing one stage's outputs at once."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator

from coarse2fine.errors import UserError

# A full disk, a full quota, or the process's file-size limit (RLIMIT_FSIZE, as batch schedulers set it): a
# writer can only stop cleanly, and say so.
NO_SPACE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary name beside `path`; it becomes `path` only if the block succeeds.

    Readers (and a rerun after a crash) never see a half-written file: the rename is atomic on POSIX, the
    data is fsynced first so a power loss cannot leave a renamed but empty file, and the directory after, so
    the rename itself survives one. Out of space (NO_SPACE_ERRORS): a UserError naming `path`, the temporary
    file removed, `path` as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # temporaries_of finds those a kill left
    try:
        yield temporary
        with open(temporary, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except Exception as error:
        full = no_space_behind(error)
        if full is None:
            raise
        raise out_of_space(path, full, "nothing half-written is kept") from None
    finally:
        temporary.unlink(missing_ok=True)


def project_path(path: str | Path) -> Path:
    """A path from params (data.root, a weights file, token_labels.import_dir): an absolute one as given, a relative
    one against the DVC project's root. DVC runs every stage command with DVC_ROOT set to the project's root, and a
    queued or temporary experiment's (`dvc exp run --queue/--temp`, which run in a copy under .dvc/tmp/exps/) with
    the root of the project it was queued from, so `data.root: data/imagenet` (a folder that git ignores, which no
    experiment's copy holds) is found from both. Outside DVC: the working directory."""
    path = Path(path)
    return path if path.is_absolute() else Path(os.environ.get("DVC_ROOT", ".")) / path


def walked_by(path: Path) -> list[str]:
    """Which of git and DVC walk `path` (a data root) at every command because it lies inside the project (DVC_ROOT,
    else the working directory) and neither .gitignore nor .dvcignore leaves it out: git's status and DVC's search
    for dvc.yaml files read every entry of it, hours over ImageNet's 1.33 M files on NFS. [] outside a project."""
    project = Path(os.environ.get("DVC_ROOT", ".")).resolve()
    path = path.resolve()
    if not (project / ".dvc").is_dir() or not path.is_relative_to(project) or path == project:
        return []
    walking = []
    with contextlib.suppress(FileNotFoundError):  # no git: nothing of git's to say
        ignored = subprocess.run(["git", "-C", str(project), "check-ignore", "-q", str(path)], capture_output=True)
        if ignored.returncode == 1:  # 0: ignored, 128: not a git repository
            walking.append("git")
    from dvc.repo import Repo  # here: only a data root inside a project needs DVC's own ignore rules

    with Repo(str(project)) as repo:
        if not repo.dvcignore.is_ignored(repo.fs, str(path)):
            walking.append("DVC")
    return walking


def temporaries_of(path: Path) -> list[Path]:
    """The temporary files atomic_path left beside `path` where its process was killed inside the block (SIGKILL
    runs no cleanup): as large as the file itself."""
    return sorted(path.parent.glob(f".{path.name}.tmp-*"))


def no_space_behind(error: BaseException) -> OSError | None:
    """The out-of-space OSError (NO_SPACE_ERRORS) `error` is, or was raised while handling: torch.save writing to a
    file object turns the OSError of a failed write into a RuntimeError ("unexpected pos") raised from within it."""
    while error is not None:
        if isinstance(error, OSError):
            return error if error.errno in NO_SPACE_ERRORS else None
        error = error.__cause__ or error.__context__
    return None


def preallocate(path: str | Path) -> None:
    """Reserve the disk blocks of `path` at its current size (a sparse file, such as a memory-mapped array just
    created): a full disk is then an OSError here (NO_SPACE_ERRORS), where writing through the mapping later would
    kill the process with SIGBUS."""
    with open(path, "r+b") as file:
        os.posix_fallocate(file.fileno(), 0, os.fstat(file.fileno()).st_size)


def out_of_space(path: str | Path, error: OSError | str, cleanup: str) -> UserError:
    """The one-line error for a full disk while writing `path` (`error`: the OSError, or what was seen instead);
    `cleanup`: what became of the file."""
    what = os.strerror(error.errno).lower() if isinstance(error, OSError) else error
    return UserError(
        f"{path}: {what} while writing it ({cleanup}): free space, or raise the file-size limit, and rerun"
    )


def write_json(path: str | Path, value: Any) -> None:
    """Atomically; stable formatting (no timestamps), so equal content gives equal bytes."""
    with atomic_path(path) as temporary:
        temporary.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


@contextlib.contextmanager
def sole_writer(output: str | Path, stage: str) -> Iterator[None]:
    """Hold an exclusive lock on `output` (a stage's output path) for the block; if another process holds it, a
    UserError naming that process: two runs of one stage would write the same files and the same checkpoint.

    A `flock` on a file in this machine's temp dir named by the output's absolute path: released by the kernel
    however the holder ends (a SIGKILL included), so a killed run never blocks its rerun. DVC's own lock already
    keeps two `dvc repro` apart; this one catches a stage script started by hand beside them.
    """
    resolved = str(Path(output).resolve())
    locks = Path(tempfile.gettempdir()) / "coarse2fine-locks"
    locks.mkdir(exist_ok=True)
    lock_path = locks / f"{hashlib.sha256(resolved.encode()).hexdigest()[:32]}.lock"
    with open(lock_path, "a+", encoding="utf-8") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            raise UserError(
                f"{output}: {holder} is writing it already; {stage} did not start (nothing was touched): wait for "
                f"that run to end, or stop it, and rerun"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{stage} (pid {os.getpid()})")
        lock.flush()
        yield
