"""The token-label store: for every train record, the teacher's top-k class log-probabilities on its score grid.

A directory holding
    header.json   {"records": N, "top_k": k, "grid": s, "num_classes": C, ...}: written last, the marker of a
                  complete store; the generator adds the teacher (name, input size, view), the records' manifest
                  digest and the fingerprint of what made it
    log_probs.npy float16 [N, k, s, s]: the teacher's top-k log-probabilities per grid cell (log_softmax over every
                  class, so what the top k leave is known: labels.targets spreads it over the other classes), best
                  first
    classes.npy   int16 (int32 beyond 32767 classes) [N, k, s, s]: their class indices
Row i belongs to the train record with index i (records.py numbers a split's records 0..N-1), so a batch's
labels are one fancy-indexed read of two memory-mapped arrays, not 1.28 M small files. Class indices are
integers: the reference stored them in float16, exact only up to 2048 classes. The grid covers the whole
image (not a centre crop), so a crop window normalised by the image maps straight onto it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from coarse2fine import files
from coarse2fine.errors import UserError

HEADER_FILE, LOG_PROBS_FILE, CLASSES_FILE = "header.json", "log_probs.npy", "classes.npy"
STUDENT_DEPS_DIR = "enabled"  # in a store: what dvc.yaml's students depend on (write_student_deps)


def class_dtype(num_classes: int) -> np.dtype:
    return np.dtype(np.int16 if num_classes <= np.iinfo(np.int16).max + 1 else np.int32)


def allocate_arrays(directory: str | Path, records: int, top_k: int, grid: int, num_classes: int) -> StoreArrays:
    """Create the two arrays at full size (zeros), their disk blocks reserved (`files.preallocate`: a full disk is one
    line now, not a SIGBUS when rows are written through the mapping), to be filled by row ranges."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shape = (records, top_k, grid, grid)
    for name, dtype in ((LOG_PROBS_FILE, np.float16), (CLASSES_FILE, class_dtype(num_classes))):
        path = directory / name
        try:  # numpy sizes the file by writing its last byte: a file-size limit fails there, a full disk below
            np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape).flush()
            files.preallocate(path)
        except OSError as error:
            full = files.no_space_behind(error)
            if full is None:
                raise
            path.unlink(missing_ok=True)
            raise files.out_of_space(path, full, "it is removed") from None
    return open_arrays(directory)


class StoreArrays(NamedTuple):
    """A store's arrays, memory-mapped; or rows of them in memory (labels.generate's chunk of rows)."""

    log_probs: np.ndarray  # float16 [N, k, s, s]
    classes: np.ndarray  # int16 / int32 [N, k, s, s]

    def write(self, rows: np.ndarray, log_probs: np.ndarray, classes: np.ndarray) -> None:
        self.log_probs[rows] = log_probs
        self.classes[rows] = classes

    def flush(self) -> None:
        self.log_probs.flush()
        self.classes.flush()


def open_arrays(directory: str | Path, mode: str = "r+") -> StoreArrays:
    directory = Path(directory)
    return StoreArrays(*(np.load(directory / name, mmap_mode=mode) for name in (LOG_PROBS_FILE, CLASSES_FILE)))


def write_header(directory: str | Path, arrays: StoreArrays, num_classes: int, **extra: Any) -> None:
    """The header, atomically: what makes the directory a store."""
    records, top_k, grid, _ = arrays.log_probs.shape
    header = {"records": records, "top_k": top_k, "grid": grid, "num_classes": num_classes, **extra}
    with files.atomic_path(Path(directory) / HEADER_FILE) as temporary:
        Path(temporary).write_text(json.dumps(header, indent=2) + "\n")


def header_digest(directory: str | Path) -> str:
    """Identifies a store by its header, which names what made it (hashing GBs of arrays would cost minutes)."""
    try:
        return hashlib.sha256((Path(directory) / HEADER_FILE).read_bytes()).hexdigest()
    except OSError as error:
        raise UserError(f"{directory}: not a readable token-label store ({error})") from None


def write_student_deps(directory: str | Path, *, store_written: bool) -> None:
    """What dvc.yaml's students depend on, inside the store: `<store>/enabled/${<student>.token_label.enabled}`,
    which DVC renders as enabled/true or enabled/false. `true` holds the store's identity (its header's sha256), so
    it changes with the labels; `false` is empty, so a student that does not read the labels is never rerun for
    them. Without a store (no student reads token labels) only `false` is written."""
    deps = Path(directory) / STUDENT_DEPS_DIR
    deps.mkdir(parents=True, exist_ok=True)
    (deps / "false").write_bytes(b"")
    if store_written:
        (deps / "true").write_text(header_digest(directory) + "\n", encoding="utf-8")


def write_store(
    directory: str | Path, log_probs: np.ndarray, classes: np.ndarray, num_classes: int, **extra: Any
) -> None:
    """Write a whole store from in-memory arrays. `log_probs`/`classes`: [N, k, s, s]."""
    if log_probs.shape != classes.shape or log_probs.ndim != 4 or log_probs.shape[2] != log_probs.shape[3]:
        raise ValueError(f"log_probs {log_probs.shape} and classes {classes.shape} must both be [N, k, s, s]")
    records, top_k, grid, _ = log_probs.shape
    arrays = allocate_arrays(directory, records, top_k, grid, num_classes)
    arrays.write(np.arange(records), log_probs, classes)
    arrays.flush()
    write_header(directory, arrays, num_classes, **extra)


class TokenLabelStore:
    """Read side: `store.lookup(record_indices)` -> (log-probabilities float16, classes int16), both [B, k, s, s]."""

    def __init__(self, directory: str | Path, *, records: int, num_classes: int, records_digest: str | None = None):
        directory = Path(directory)
        if not (directory / HEADER_FILE).is_file():
            raise UserError(f"{directory}: no token labels ({HEADER_FILE} missing); run the token_labels stage first")
        try:
            header = json.loads((directory / HEADER_FILE).read_text())
            self.top_k, self.grid = header["top_k"], header["grid"]
            self.log_probs = np.load(directory / LOG_PROBS_FILE, mmap_mode="r")
            self.classes = np.load(directory / CLASSES_FILE, mmap_mode="r")
        except (OSError, ValueError, KeyError, TypeError) as error:  # missing, truncated or garbled
            raise UserError(
                f"{directory}: not a readable token-label store ({type(error).__name__}: {error}); rerun the "
                f"token_labels stage (`dvc repro` does, as the store's hash changed)"
            ) from None
        self.header = header
        expected = (records, self.top_k, self.grid, self.grid)
        if header["records"] != records or self.log_probs.shape != expected or self.classes.shape != expected:
            raise UserError(
                f"{directory}: token labels for {header['records']} records of shape {self.log_probs.shape}, "
                f"but the train split has {records} records: regenerate them for these records"
            )
        if records_digest is not None and header.get("records_digest") != records_digest:
            raise UserError(f"{directory}: token labels made from other records: rerun the token_labels stage")
        if header["num_classes"] != num_classes:
            raise UserError(
                f"{directory}: token labels over {header['num_classes']} classes, the data has {num_classes}"
            )
        self.num_classes = num_classes

    def lookup(self, record_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of `record_indices`, a host tensor (the loader looks up before its batch goes to the device),
        as stored: float16 and int16 (int32 past 32768 classes), half the bytes of float32/int64 to copy to the
        device, where `targets.token_targets` widens them."""
        rows = record_indices.numpy()
        return torch.from_numpy(self.log_probs[rows]), torch.from_numpy(self.classes[rows])
