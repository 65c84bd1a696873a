"""The coarse-to-fine comparison: the evaluations of the pre-trained and the fine-tuned model side by side.

Plain Python (no torch): the `compare` stage runs it on the evaluate stage's metrics files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping


# What each evaluation contributes to the comparison: its resolution and accuracies (at every extra size too).
COMPARED_PREFIXES = ("img_size", "top1", "top5")


def compare(evaluations: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """`{"pretrain": {...}, "finetune": {...}, "finetune_gain_top1": ...}` from each model's metrics.json."""
    table: dict[str, Any] = {
        name: {key: value for key, value in metrics.items() if key.startswith(COMPARED_PREFIXES)}
        for name, metrics in evaluations.items()
    }
    names = list(evaluations)
    if len(names) == 2:
        coarse, fine = names
        table[f"{fine}_gain_top1"] = round(evaluations[fine]["top1"] - evaluations[coarse]["top1"], 4)
    return table


def markdown_table(evaluations: Mapping[str, Mapping[str, Any]]) -> str:
    """The README's table: one row per model, at its own resolution and each extra one."""
    rows = ["| model | resolution | val top-1 % | val top-5 % |", "| --- | --- | --- | --- |"]
    for name, metrics in evaluations.items():
        rows.append(f"| {name} | {metrics['img_size']} (its own) | {metrics['top1']:.2f} | {metrics['top5']:.2f} |")
        for key in sorted((key for key in metrics if key.startswith("top1_at_")), key=lambda k: int(k.split("_")[-1])):
            size = key.removeprefix("top1_at_")
            rows.append(f"| {name} | {size} | {metrics[key]:.2f} | {metrics[f'top5_at_{size}']:.2f} |")
    return "\n".join(rows)


def read_evaluations(files: Mapping[str, Path]) -> dict[str, dict[str, Any]]:
    return {name: json.loads(Path(path).read_text(encoding="utf-8")) for name, path in files.items()}

