"""The token-label store: for every train record, the teacher's top-k class logits on its score grid.

A directory holding
    header.json   {"records": N, "top_k": k, "grid": s, "num_classes": C}
    logits.npy    float16 [N, k, s, s]: the teacher's top-k logits per grid cell, best first
    classes.npy   int16 (int32 beyond 32767 classes) [N, k, s, s]: their class indices
Row i belongs to the train record with index i (records.py numbers a split's records 0..N-1), so a batch's
labels are one fancy-indexed read of two memory-mapped arrays, not 1.28 M small files. Class indices are
integers: the reference stored them in float16, exact only up to 2048 classes. The grid covers the whole
image (not a centre crop), so a crop window normalised by the image maps straight onto it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from coarse2fine.errors import UserError
from coarse2fine.files import atomic_path

HEADER_FILE, LOGITS_FILE, CLASSES_FILE = "header.json", "logits.npy", "classes.npy"


def class_dtype(num_classes: int) -> np.dtype:
    return np.dtype(np.int16 if num_classes <= np.iinfo(np.int16).max + 1 else np.int32)


def write_store(directory: str | Path, logits: np.ndarray, classes: np.ndarray, num_classes: int) -> None:
    """Write a whole store (each file atomically). `logits`/`classes`: [N, k, s, s]."""
    if logits.shape != classes.shape or logits.ndim != 4 or logits.shape[2] != logits.shape[3]:
        raise ValueError(f"logits {logits.shape} and classes {classes.shape} must both be [N, k, s, s]")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    records, top_k, grid, _ = logits.shape
    arrays = {LOGITS_FILE: logits.astype(np.float16), CLASSES_FILE: classes.astype(class_dtype(num_classes))}
    for name, array in arrays.items():
        with atomic_path(directory / name) as temporary, open(temporary, "wb") as file:
            np.save(file, array)
    header = {"records": records, "top_k": top_k, "grid": grid, "num_classes": num_classes}
    with atomic_path(directory / HEADER_FILE) as temporary:
        Path(temporary).write_text(json.dumps(header, indent=2) + "\n")


class TokenLabelStore:
    """Read side: `store.lookup(record_indices)` -> (logits float32, classes int64), both [B, k, s, s]."""

    def __init__(self, directory: str | Path, *, records: int, num_classes: int):
        directory = Path(directory)
        try:
            header = json.loads((directory / HEADER_FILE).read_text())
            self.logits = np.load(directory / LOGITS_FILE, mmap_mode="r")
            self.classes = np.load(directory / CLASSES_FILE, mmap_mode="r")
        except (OSError, ValueError) as error:
            raise UserError(f"{directory}: not a readable token-label store ({error})") from None
        self.top_k, self.grid = header["top_k"], header["grid"]
        expected = (records, self.top_k, self.grid, self.grid)
        if header["records"] != records or self.logits.shape != expected or self.classes.shape != expected:
            raise UserError(
                f"{directory}: token labels for {header['records']} records of shape {self.logits.shape}, "
                f"but the train split has {records} records: regenerate them for these records"
            )
        if header["num_classes"] != num_classes:
            raise UserError(
                f"{directory}: token labels over {header['num_classes']} classes, the data has {num_classes}"
            )
        self.num_classes = num_classes

    def lookup(self, record_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = record_indices.cpu().numpy()
        logits = torch.from_numpy(self.logits[rows].astype(np.float32))
        classes = torch.from_numpy(self.classes[rows].astype(np.int64))
        return logits, classes
