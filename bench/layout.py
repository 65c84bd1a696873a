"""Channels-last images against contiguous (NCHW) ones on the CPU: what the GPU path's layout of the images
(coarse2fine.distributed.Runtime.image_memory_format, NCHW on a CPU: its docstring says why) would be worth here.

params.yaml's teacher (teacher.model at teacher.img_size, output stride included) and student (model.* at
pretrain.img_size), built as the stages build them (random weights, CPU, fp32), each fed the same random batch of
pretrain.batch_size images in both layouts:
- training step: forward, label-smoothed cross-entropy, backward, torch.optim.AdamW step, zero_grad (the
  student's logits as VOLO's plain forward gives them);
- teacher forward: the teacher in eval mode under torch.inference_mode, as token-label generation runs it.
The parameters stay as built in both layouts (the project leaves them contiguous: FSDP2 shards contiguous
parameters only), so only the images differ. --steps steps per call, every row warmed up once, then --repeats
calls interleaved (see _common.py); img/s and img per CPU-second of the process.

Run: python bench/layout.py [--repeats N] [--steps N] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Callable

import torch

from _common import (
    PROJECT_ROOT, CpuTimed, add_threads_argument, add_tiny_argument, header_line, interleaved, markdown_table,
    tiny_sizes, write_json,
)
from coarse2fine import models
from coarse2fine.config import Model, Params, load_params

NUM_CLASSES = 10
LAYOUTS = {"NCHW": torch.contiguous_format, "channels-last": torch.channels_last}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, metavar="N", help="steps (forwards) per call (default: 4)")
    parser.add_argument("--repeats", type=int, default=6, metavar="N", help="timed calls per row (default: 6)")
    add_threads_argument(parser)
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers (every repeat) as JSON")
    add_tiny_argument(parser, "--steps 1, --repeats 1, batch 4 at 32 px")
    args = parser.parse_args()
    tiny_sizes(parser, args, steps=1, repeats=1)
    return args


class TrainSteps:
    def __init__(self, model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, steps: int,
                 label_smoothing: float):
        self.model, self.images, self.labels, self.steps = model.train(), images, labels, steps
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=label_smoothing)

    def __call__(self) -> int:
        for _ in range(self.steps):
            self.criterion(self.model(self.images), self.labels).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return self.steps * len(self.images)


class Forwards:
    def __init__(self, model: torch.nn.Module, images: torch.Tensor, steps: int):
        self.model, self.images, self.steps = model.eval(), images, steps

    def __call__(self) -> int:
        with torch.inference_mode():
            for _ in range(self.steps):
                self.model(self.images)
        return self.steps * len(self.images)


def seeded_model(model_cfg: Model, size: int, seed: int) -> torch.nn.Module:
    """The model as its stage builds it, with the weights `seed` gives (the same in every call)."""
    torch.manual_seed(seed)
    return models.build_model(model_cfg, NUM_CLASSES, size)


def variants(params: Params, args: argparse.Namespace) -> dict[str, CpuTimed]:
    """One call per (model, work, layout), each on its own model built from the same seed: the same weights."""
    batch_size = 4 if args.tiny else params.pretrain.batch_size
    roles = {
        "teacher": (params.teacher.model, 32 if args.tiny else params.teacher.img_size),
        "student": (params.model, 32 if args.tiny else params.pretrain.img_size),
    }
    generator = torch.Generator().manual_seed(params.seed)
    calls: dict[str, Callable[[], int]] = {}
    for role, (model_cfg, size) in roles.items():
        name = f"{role} ({model_cfg.name}, {size} px)"
        images = torch.randn(batch_size, 3, size, size, generator=generator)
        labels = torch.randint(NUM_CLASSES, (batch_size,), generator=generator)
        for layout, memory_format in LAYOUTS.items():
            calls[f"{name} training step, {layout}"] = TrainSteps(
                seeded_model(model_cfg, size, params.seed), images.contiguous(memory_format=memory_format), labels,
                args.steps, params.pretrain.label_smoothing,
            )
        if role == "teacher":
            for layout, memory_format in LAYOUTS.items():
                calls[f"{name} forward (generation), {layout}"] = Forwards(
                    seeded_model(model_cfg, size, params.seed), images.contiguous(memory_format=memory_format),
                    args.steps,
                )
    return {name: CpuTimed(call) for name, call in calls.items()}


def report(rates: dict[str, list[float]], cpu: dict[str, CpuTimed], args: argparse.Namespace) -> tuple[str, dict]:
    medians = {name: statistics.median(values) for name, values in rates.items()}
    cpu_medians = {name: statistics.median(timed.rates[1:]) for name, timed in cpu.items()}
    rows = []
    for name in rates:
        work, layout = name.rsplit(", ", 1)
        reference = f"{work}, NCHW"
        rows.append([
            work, layout, f"{medians[name]:.1f}", f"{medians[name] / medians[reference]:.3f}x",
            f"{min(rates[name]):.1f}-{max(rates[name]):.1f}", f"{cpu_medians[name] / cpu_medians[reference]:.3f}x",
        ])
    tiny = "Tiny run (--tiny: a smoke test of the bench, its figures measure nothing). " if args.tiny else ""
    text = "\n".join([
        header_line(),
        "",
        f"{tiny}fp32 CPU, {args.threads} threads, random weights and images; {args.steps} steps per call, median of "
        f"{args.repeats} interleaved calls after a warm-up call. The parameters are contiguous in both layouts.",
        "",
        markdown_table(["model and work", "images", "img/s (median)", "x NCHW", "img/s range", "x NCHW per CPU-s"],
                       rows),
    ])
    return text, {"median_img_per_s": medians, "img_per_s": rates, "img_per_cpu_s": cpu_medians}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    params = load_params(PROJECT_ROOT / "params.yaml")
    timed = variants(params, args)
    rates = interleaved(timed, args.repeats)
    text, raw = report(rates, timed, args)
    print(text)
    write_json(args, text, raw)


if __name__ == "__main__":
    main()
