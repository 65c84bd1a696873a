"""Exact evaluation over ranks: top-1/top-5 accuracy, loss, per-class accuracy and the confusion matrix.

Every rank counts the samples its val loader yields (each sample exactly once across ranks, see
docs/contracts.md) and the counts are summed over ranks, never per-batch averages averaged again: the numbers
are those of one pass over the whole split, whatever the world size, batch size or last partial batch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from coarse2fine.distributed import Runtime, all_reduce_sum
from coarse2fine.files import atomic_path

TOP_K = 5
# Beyond these class counts the confusion matrix image drops the numbers in the cells, then the tick labels:
# they would overlap into a grey smear.
MAX_CLASSES_WITH_VALUES = 20
MAX_CLASSES_WITH_LABELS = 50


@dataclass(frozen=True)
class EvalResult:
    top1: float  # % of samples whose highest logit is their label
    top5: float  # % with the label among the 5 highest logits (among all of them with fewer classes)
    loss: float  # mean cross-entropy (no label smoothing)
    n: int  # samples evaluated, over all ranks
    confusion: np.ndarray  # int64 [num_classes, num_classes]: row = true class, column = top-1 prediction

    @property
    def per_class_total(self) -> np.ndarray:
        return self.confusion.sum(axis=1)

    @property
    def per_class_correct(self) -> np.ndarray:
        return np.diagonal(self.confusion).copy()

    @property
    def per_class_accuracy(self) -> np.ndarray:
        """% per class; NaN for a class without samples."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return 100.0 * self.per_class_correct / self.per_class_total

    def summary(self) -> dict[str, float | int]:
        """What metrics.json holds."""
        return {"top1": self.top1, "top5": self.top5, "loss": self.loss, "n": self.n}


def evaluate(
    model: nn.Module,
    loader: Iterable[dict[str, torch.Tensor]],
    runtime: Runtime,
    num_classes: int,
    precision: str = "auto",
) -> EvalResult:
    """Evaluate `model(x)` (the inference forward; pass the plain model, not a DDP wrapper) on `loader`.

    A collective: every rank must call it, also a rank whose share of the split is empty. The model is put
    in eval mode for the pass and handed back in the mode it came in.
    """
    device = runtime.device
    autocast_dtype = runtime.autocast_dtype(precision)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device)
            # [summed cross-entropy, top-k hits]; float64 keeps the loss sum exact enough over 10^6 samples.
            totals = torch.zeros(2, dtype=torch.float64, device=device)
            for batch in loader:
                images, labels = batch["image"], batch["label"]
                with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    logits = model(images)
                count_batch(logits.float(), labels, confusion, totals)
            all_reduce_sum(confusion)
            all_reduce_sum(totals)
    finally:
        model.train(was_training)
    confusion_matrix = confusion.view(num_classes, num_classes).cpu().numpy()
    n = int(confusion_matrix.sum())
    if n == 0:
        raise ValueError("evaluate: the loader yielded no samples on any rank")
    loss_sum, topk_hits = totals.tolist()
    return EvalResult(
        top1=100.0 * int(np.trace(confusion_matrix)) / n,
        top5=100.0 * topk_hits / n,
        loss=loss_sum / n,
        n=n,
        confusion=confusion_matrix,
    )


def count_batch(logits: torch.Tensor, labels: torch.Tensor, confusion: torch.Tensor, totals: torch.Tensor) -> None:
    """Add a batch to the running counts on the device (`confusion` flattened, `totals` [loss sum, top-k hits]):
    nothing here reads a value back, so a GPU never waits per batch (torch.bincount would: its length depends on
    the values)."""
    num_classes = logits.shape[1]
    # Top-1 is the first of the top-k, so a top-1 hit is always a top-k hit, even with tied logits.
    predictions = logits.topk(min(TOP_K, num_classes), dim=1).indices
    totals[0] += F.cross_entropy(logits, labels, reduction="sum").double()
    totals[1] += (predictions == labels[:, None]).any(dim=1).sum()
    confusion.index_add_(0, labels * num_classes + predictions[:, 0], torch.ones_like(labels))


def write_per_class_json(path: str | Path, result: EvalResult, classes: Sequence[str]) -> None:
    """`[{"class": "3", "accuracy": 97.2, "correct": 35, "total": 36}, ...]` in label order (a DVC plot source).

    accuracy is in % and null for a class without samples.
    """
    rows = [
        {
            "class": name,
            "accuracy": None if math.isnan(accuracy) else accuracy,
            "correct": int(correct),
            "total": int(total),
        }
        for name, accuracy, correct, total in zip(
            classes, result.per_class_accuracy.tolist(), result.per_class_correct, result.per_class_total, strict=True
        )
    ]
    with atomic_path(path) as temporary:
        temporary.write_text(json.dumps(rows, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_confusion_matrix_png(path: str | Path, result: EvalResult, classes: Sequence[str]) -> None:
    """Counts (rows: true class, columns: predicted), class names on the axes while they stay legible."""
    num_classes = len(classes)
    side = min(max(6.0, 0.45 * num_classes + 2.0), 16.0)  # inches: grows with the class count, then caps
    # Imported here: matplotlib costs 0.4 s, which every training process would pay otherwise. Drawn with
    # matplotlib alone: scikit-learn's ConfusionMatrixDisplay draws the same and cost each evaluation 1 s to import.
    from matplotlib.figure import Figure

    # A bare Figure, not pyplot: no global figure registry to leak into, and it renders with Agg, no display.
    figure = Figure(figsize=(side, side), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    image = axes.imshow(result.confusion, interpolation="nearest", cmap="Blues")
    figure.colorbar(image, ax=axes)
    if num_classes <= MAX_CLASSES_WITH_VALUES:
        middle = result.confusion.max() / 2  # dark cells get white counts
        for (true, predicted), count in np.ndenumerate(result.confusion):
            colour = "white" if count > middle else "black"
            axes.text(predicted, true, f"{count:d}", ha="center", va="center", color=colour)
    ticks = range(num_classes) if num_classes <= MAX_CLASSES_WITH_LABELS else []
    axes.set_xticks(ticks, [classes[i] for i in ticks], rotation="vertical")
    axes.set_yticks(ticks, [classes[i] for i in ticks])
    axes.set(xlabel="Predicted label", ylabel="True label", title=f"top-1 {result.top1:.2f} %, n = {result.n}")
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png")
