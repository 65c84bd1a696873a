"""Training-step throughput of a published VOLO on one GPU (img/s, timed with the device synchronised): the
project's own Trainer step, as the pretrain stage runs it on a GPU (bf16 autocast, fused AdamW, the model's
drop-path), on random batches already on the device, so only the step is timed, never data loading. Rows:
- ground truth: label-smoothed cross-entropy on the inference logits;
- token labels + MixToken: the recipe's step: the batch's rows of a token-label store (random top-5 teacher maps
  on NFNet-F6's 18 x 18 grid, looked up and copied as the loader does), roi_align targets, MixToken;
- both again, compiled (`--compile`): the training forward through torch.compile (`train.compile: true`); the
  compiled ground truth is what timm's compiled bare loop (bench/timm_gpu_step.py) is held against, so the
  Trainer's own cost under compile shows apart from what token labels and MixToken cost.

On a GPU node: `python bench/gpu_step.py` (volo_d1_224 at 224 px, 128 images a step: the VOLO-D1 recipe's
per-GPU batch). Without a GPU it stops with one line; `--device cpu` runs the same steps on the CPU (the CPU dry
run of coarse2fine.gpu_check: figures that measure nothing). Each call runs --steps steps; every row is warmed up
once (compilation, cuDNN autotuning), then the repeats run interleaved (_common.interleaved).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from _common import (
    TrainerSteps, add_tiny_argument, bench_trainer, header_line, interleaved, markdown_table, random_store, tiny_sizes,
    write_json,
)
from coarse2fine import models
from coarse2fine.config import parse_params
from coarse2fine.data.transforms import IDENTITY_AFFINE
from coarse2fine.distributed import Runtime, use_gpu_defaults
from coarse2fine.labels.store import TokenLabelStore

NUM_CLASSES = 1000
# The reference's NFNet-F6 token labels: the top 5 classes on an 18 x 18 grid (TokenLabeling's README).
TOP_K, TEACHER_GRID = 5, 18


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="volo_d1_224", help="a timm VOLO (default: volo_d1_224)")
    parser.add_argument("--img-size", type=int, default=224, metavar="PX", help="default: 224")
    parser.add_argument("--batch", type=int, default=128, metavar="N", help="images a step (default: 128)")
    parser.add_argument("--steps", type=int, default=20, metavar="N", help="steps per timed call (default: 20)")
    parser.add_argument("--repeats", type=int, default=5, metavar="N", help="timed calls per row (default: 5)")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"], help="default: bf16")
    parser.add_argument("--compile", action="store_true", help="add the torch.compile rows (minutes to compile)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="default: cuda; cpu runs the same steps there, to test the bench without a GPU")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers as JSON")
    add_tiny_argument(parser, "--batch 8, --steps 2, --repeats 1")
    args = parser.parse_args()
    tiny_sizes(parser, args, batch=8, steps=2, repeats=1)
    return args


def device_batches(
    batch: dict[str, torch.Tensor], host_index: torch.Tensor, store: TokenLabelStore | None, steps: int, runtime: Runtime
) -> Iterator[dict[str, torch.Tensor]]:
    """One device-resident batch `steps` times, its store rows (by `host_index`, its record indices on the host) looked
    up and copied from pinned memory each step, as the loader does (`loaders.with_target_inputs`)."""
    for _ in range(steps):
        if store is None:
            yield batch
            continue
        log_probs, classes = store.lookup(host_index)
        if runtime.is_cuda:  # pinned, so the copy overlaps the step (CPU runs: no pinning without CUDA)
            log_probs, classes = log_probs.pin_memory(), classes.pin_memory()
        yield {
            **batch, "token_log_probs": log_probs.to(runtime.device, non_blocking=True),
            "token_classes": classes.to(runtime.device, non_blocking=True),
        }


def random_batch(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    size = torch.rand(args.batch, 2, generator=generator) * 0.7 + 0.3
    top_left = torch.rand(args.batch, 2, generator=generator) * (1 - size)
    batch = {
        "image": torch.randn(args.batch, 3, args.img_size, args.img_size, generator=generator),
        "label": torch.randint(NUM_CLASSES, (args.batch,), generator=generator),
        "index": torch.arange(args.batch),
        "window": torch.cat([top_left, size], dim=1),
        "flip": torch.rand(args.batch, generator=generator) < 0.5,
        "affine": IDENTITY_AFFINE.expand(args.batch, 2, 3),
        "moved": torch.zeros(0, dtype=torch.int64),
    }
    return {key: value.to(device) for key, value in batch.items()}


def new_trainer(args: argparse.Namespace, runtime: Runtime, scratch: Path, *, token_labels: bool, compile_: bool):
    params = parse_params({
        "model": {"name": args.model, "drop_path": 0.1},
        "pretrain": {
            "img_size": args.img_size, "batch_size": args.batch, "precision": args.precision, "compile": compile_,
            # VOLO-D1's peak LR at its global batch 1024 (the LR does not change the speed).
            "optimizer": {"lr_base": 1.6e-3, "lr_scaling": "none"},
            "token_label": {"enabled": token_labels, "mix_token": token_labels},
        },
    }, "gpu_step")
    torch.manual_seed(0)
    model = models.build_model(params.model, NUM_CLASSES, args.img_size, mix_token=token_labels)
    return bench_trainer(
        params, model, runtime, scratch, num_classes=NUM_CLASSES, train_loader=[None], val_loader=[],
        token_labels=token_labels,
    )


def main() -> None:
    args = parse_args()
    if args.device == "cpu":
        runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
        device_name = "CPU"
    elif torch.cuda.is_available():
        runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))
        torch.cuda.set_device(runtime.device)
        use_gpu_defaults()
        device_name = torch.cuda.get_device_name(runtime.device)
    else:
        sys.exit(f"bench/gpu_step.py: no usable CUDA GPU (torch {torch.__version__}, CUDA {torch.version.cuda})")
    batch = random_batch(args, runtime.device)
    host_index = batch["index"].cpu()
    rows = [("ground truth", False, False), ("token labels + MixToken", True, False)]
    if args.compile:
        rows += [("ground truth, compiled", False, True), ("token labels + MixToken, compiled", True, True)]
    with tempfile.TemporaryDirectory(prefix="coarse2fine-bench-") as scratch:
        store = random_store(
            Path(scratch) / "labels", args.batch, num_classes=NUM_CLASSES, top_k=TOP_K, grid=TEACHER_GRID, seed=1
        )
        variants = {
            name: TrainerSteps(
                new_trainer(args, runtime, Path(scratch) / name, token_labels=labels, compile_=compile_),
                functools.partial(device_batches, batch, host_index, store if labels else None, args.steps, runtime),
            )
            for name, labels, compile_ in rows
        }
        rates = interleaved(variants, args.repeats)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    base = medians["ground truth"]
    table = markdown_table(
        ["step", "img/s (median)", "x ground truth", "img/s range"],
        [[name, f"{medians[name]:.0f}", f"{medians[name] / base:.3f}x", f"{min(values):.0f}-{max(values):.0f}"]
         for name, values in rates.items()],
    )
    text = "\n".join([
        header_line(), "",
        f"{device_name}: {args.model} at {args.img_size} px, batch {args.batch}, {args.precision}, "
        f"{'fused ' if runtime.fused_optimizer else ''}AdamW, drop-path 0.1; {args.steps} steps per call, median of "
        f"{args.repeats} interleaved calls after a warm-up call. Token labels: top-{TOP_K} maps on a {TEACHER_GRID} x "
        f"{TEACHER_GRID} grid over {NUM_CLASSES} classes.",
        "", table,
    ])
    print(text)
    write_json(args, text, {"median_img_per_s": medians, "img_per_s": rates})


if __name__ == "__main__":
    main()
