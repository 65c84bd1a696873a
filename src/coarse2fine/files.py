"""Atomic file writes (every output is written under a temporary name and renamed into place), file digests."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
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
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
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
    except OSError as error:
        if error.errno not in NO_SPACE_ERRORS:
            raise
        raise UserError(
            f"{path}: {os.strerror(error.errno).lower()} while writing it (nothing half-written is kept): free space, "
            f"or raise the file-size limit, and rerun"
        ) from None
    finally:
        temporary.unlink(missing_ok=True)


def write_json(path: str | Path, value: Any) -> None:
    """Atomically; stable formatting (no timestamps), so equal content gives equal bytes."""
    with atomic_path(path) as temporary:
        temporary.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()
