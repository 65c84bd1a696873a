"""Reports: the coarse-to-fine comparison (the evaluations of the pre-trained and the fine-tuned model side by
side) and a training run's curves as one image.

Plain Python (no torch): the `compare` stage runs it on the evaluate stage's metrics files.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from matplotlib.figure import Figure


# What each evaluation contributes to the comparison: its resolution and accuracies (at every extra size too).
COMPARED_PREFIXES = ("img_size", "top1", "top5")


# What each training stage contributes: its last epoch's val top-1 and its best epoch's (timm's and the reference's
# "*** Best metric"), whichever the model file holds (`<stage>.keep`) being what the evaluation measured.
TRAINING_KEYS = {"last_val_top1": "val_top1", "best_val_top1": "best_val_top1", "best_epoch": "best_epoch"}


def compare(
    evaluations: Mapping[str, Mapping[str, Any]],
    trainings: Mapping[str, Mapping[str, Any]] | None = None,
    kept: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """`{"pretrain": {...}, "finetune": {...}, "finetune_gain_top1": ...}` from each model's evaluation metrics.json,
    with, where given, its training stage's last and best val top-1 (`trainings`: the stage's metrics.json) and which
    of the two epochs its model file holds (`kept`: `<stage>.keep`)."""
    table: dict[str, Any] = {}
    for name, metrics in evaluations.items():
        entry = {key: value for key, value in metrics.items() if key.startswith(COMPARED_PREFIXES)}
        training = (trainings or {}).get(name, {})
        entry |= {ours: training[theirs] for ours, theirs in TRAINING_KEYS.items() if theirs in training}
        if kept and name in kept:
            entry["keep"] = kept[name]
        table[name] = entry
    names = list(evaluations)
    if len(names) == 2:
        coarse, fine = names
        table[f"{fine}_gain_top1"] = round(evaluations[fine]["top1"] - evaluations[coarse]["top1"], 4)
    return table


def markdown_table(evaluations: Mapping[str, Mapping[str, Any]]) -> str:
    """The results table (docs/guide.md): one row per model, at its own resolution and each extra one."""
    rows = ["| model | resolution | val top-1 % | val top-5 % |", "| --- | --- | --- | --- |"]
    for name, metrics in evaluations.items():
        rows.append(f"| {name} | {metrics['img_size']} (its own) | {metrics['top1']:.2f} | {metrics['top5']:.2f} |")
        for key in sorted((key for key in metrics if key.startswith("top1_at_")), key=lambda k: int(k.split("_")[-1])):
            size = key.removeprefix("top1_at_")
            rows.append(f"| {name} | {size} | {metrics[key]:.2f} | {metrics[f'top5_at_{size}']:.2f} |")
    return "\n".join(rows)


def read_evaluations(files: Mapping[str, Path]) -> dict[str, dict[str, Any]]:
    return {name: json.loads(Path(path).read_text(encoding="utf-8")) for name, path in files.items()}



# The panels of a training run's curves: which metric histories each one plots (by name, as the trainer logs them).
CURVE_PANELS = {"loss": ("train_loss", "val_loss"), "accuracy (%)": ("val_top1", "val_top5"), "learning rate": ("lr",)}


def curves_figure(history_dir: Path, title: str) -> Figure | None:
    """Loss, accuracy and learning rate per epoch from DVCLive's history files (`<history_dir>/<name>.tsv`, columns
    step and <name>); None when there is none of them."""
    from matplotlib.figure import Figure  # about 1 s, paid only by the runs that draw

    histories = {}
    for path in sorted(Path(history_dir).glob("*.tsv")):
        with open(path, encoding="utf-8", newline="") as file:
            rows = list(csv.DictReader(file, delimiter="\t"))
        histories[path.stem] = ([int(row["step"]) + 1 for row in rows], [float(row[path.stem]) for row in rows])
    panels = {label: [name for name in names if name in histories] for label, names in CURVE_PANELS.items()}
    panels = {label: names for label, names in panels.items() if names}
    if not panels:
        return None
    figure = Figure(figsize=(4 * len(panels), 3.2), layout="constrained")
    figure.suptitle(title)
    for axes, (label, names) in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels.items()):
        for name in names:
            axes.plot(*histories[name], label=name, marker="." if len(histories[name][0]) < 30 else None)
        axes.set(xlabel="epoch", title=label)
        axes.grid(alpha=0.3)
        axes.legend()
    return figure
