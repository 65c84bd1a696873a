"""Whether the CPU's instruction set changes what training computes: the shipped pipeline's first stages (source,
convert, teacher, pretrain on ground truth) at one seed, under several settings of the kernels' dispatch, compared
weight by weight.

torch (ATen), oneDNN and MKL each choose their kernels by the instruction set the CPU has, and kernels of another
width add in another order: two x86 CPUs with the same core count can train the same seed to other weights, and
hundreds of epochs later to other top-1 figures (issue 58: 78.15 % on 2 AMD EPYC cores where 2 Intel Xeon cores give
83.33 % for the default pre-training at the same seed). The settings, each an environment the three libraries
read at start-up:

- native: as installed (an AVX-512 CPU runs its AVX-512 kernels);
- avx2: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2, the kernels of a CPU without
  AVX-512;
- baseline: ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_CBWR=COMPATIBLE, a path every x86-64 CPU with
  SSE4.1 can take (MKL's conditional numerical reproducibility in its compatible mode).

Per setting, in a project copy of its own: the records' digest (what convert wrote), each model's val loss and top-1,
the largest difference of any weight from the first setting's, and the `dvc repro`'s seconds.

Run: python bench/cpu_dispatch.py [--teacher-epochs 2] [--pretrain-epochs 1] [--settings native avx2 baseline]
[--workdir DIR] (about 20 minutes on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
from pathlib import Path

import torch

from _common import (
    TINY_DIGITS, ProjectCopy, add_tiny_argument, header_line, markdown_table, merge_params, read_metric, tiny_sizes,
    workspace, write_json,
)

SETTINGS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "baseline": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "COMPATIBLE"},
}
STAGES = ("teacher", "pretrain")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), metavar="NAME",
                        help=f"dispatch settings, the first the reference ({', '.join(SETTINGS)})")
    parser.add_argument("--teacher-epochs", type=int, default=2, metavar="N")
    parser.add_argument("--pretrain-epochs", type=int, default=1, metavar="N")
    parser.add_argument("--workdir", type=Path, metavar="DIR", help="keep the project copies here (default: a temp dir)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the raw numbers to FILE")
    add_tiny_argument(parser, "the digits (a tenth), the teacher alone for one epoch, native and baseline")
    args = parser.parse_args()
    tiny_sizes(parser, args, teacher_epochs=1, settings=["native", "baseline"])
    args.stages = STAGES[:1] if args.tiny else STAGES
    return args


def records_digest(records: Path) -> str:
    """One digest of every shard convert wrote (their names and bytes)."""
    digest = hashlib.sha256()
    for shard in sorted(records.rglob("*.tfrecord")):
        digest.update(shard.name.encode())
        digest.update(shard.read_bytes())
    return digest.hexdigest()[:12]


def weights(project: ProjectCopy, stage: str) -> dict[str, torch.Tensor]:
    return torch.load(project.path / "models" / stage / "model.pt", map_location="cpu", weights_only=True)["model"]


def largest_difference(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max((ours[key].double() - reference[key].double()).abs().max().item() for key in reference)


def main() -> None:
    args = parse_args()
    change = {"teacher": {"epochs": args.teacher_epochs},
              "pretrain": {"epochs": args.pretrain_epochs, "token_label": {"enabled": False}}}
    if args.tiny:
        change = merge_params(copy.deepcopy(TINY_DIGITS), change)
    runs: dict[str, dict] = {}
    with workspace(args.workdir) as work:
        reference: dict[str, dict[str, torch.Tensor]] = {}
        for name in args.settings:
            project = ProjectCopy(work / name, change)
            project.env |= SETTINGS[name]
            repro = project.repro(args.stages[-1])
            run = {"seconds": repro.seconds, "records": records_digest(project.path / "data" / "records")}
            for stage in args.stages:
                metrics = project.path / "metrics" / stage / "metrics.json"
                found = weights(project, stage)
                reference.setdefault(stage, found)
                run[stage] = {"val_loss": read_metric(metrics, "val_loss"), "val_top1": read_metric(metrics, "val_top1"),
                              "largest_weight_difference": largest_difference(found, reference[stage])}
            runs[name] = run
            print(f"{name}: {json.dumps(run)}", flush=True)
    first = args.settings[0]
    rows = [[name, " ".join(f"{key}={value}" for key, value in SETTINGS[name].items()) or "(as installed)",
             run["records"] + (" (same)" if run["records"] == runs[first]["records"] else " (other)"),
             *(f"{run[stage]['val_loss']:.5f} / {run[stage]['val_top1']:.2f} / {run[stage]['largest_weight_difference']:.3g}"
               for stage in args.stages),
             f"{run['seconds']:.0f} ({run['seconds'] / runs[first]['seconds']:.2f}x)"]
            for name, run in runs.items()]
    text = "\n".join([
        header_line(), "",
        f"the shipped params at seed 0, teacher {args.teacher_epochs} epoch(s)"
        f"{'' if args.tiny else f', pretrain {args.pretrain_epochs} on ground truth'}"
        f"{' (--tiny: the digits)' if args.tiny else ''}; each setting in a project copy of its own; weight "
        f"differences against {first}'s", "",
        markdown_table(["setting", "environment", "records", *(f"{stage}: val loss / top-1 % / largest |weight diff|"
                                                              for stage in args.stages), "dvc repro s"], rows),
    ])
    print(text)
    write_json(args, text, {"runs": runs}, "cpu_dispatch")


if __name__ == "__main__":
    sys.exit(main())
