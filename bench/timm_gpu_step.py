"""A timm VOLO's training step on one GPU in a plain loop, eager and through torch.compile: the figure to hold the
project's Trainer step (bench/gpu_step.py) against. It imports torch and timm alone, so it runs on a GPU machine
where the project cannot be installed (no DALI, MLflow or DVC there).

The step is bench/gpu_step.py's ground-truth row without the Trainer: random 224 px images and labels already on
the device, bf16 autocast, label-smoothed cross-entropy (0.1) on the class logits, fused AdamW, drop path 0.1, TF32
matmuls. Each row is warmed up (compilation), then its --repeats runs of --steps steps are timed, synchronised.
`--device cpu --eager-only` runs the same loop on the CPU (the CPU dry run of coarse2fine.gpu_check: figures that
measure nothing; compiling takes minutes there).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import shlex
import statistics
import sys
import time

import timm
import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="volo_d1_224", help="a timm model (default: volo_d1_224)")
    parser.add_argument("--batch-size", type=int, default=128, metavar="N", help="default: 128 (the D1 recipe's)")
    parser.add_argument("--steps", type=int, default=30, metavar="N", help="steps per timed run (default: 30)")
    parser.add_argument("--repeats", type=int, default=3, metavar="N", help="timed runs per row (default: 3)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="default: cuda; cpu runs the same loop there, to test the bench without a GPU")
    parser.add_argument("--eager-only", action="store_true", help="leave out the torch.compile row")
    parser.add_argument("--json", type=pathlib.Path, metavar="PATH",
                        help="also write the report and the raw numbers as JSON")
    return parser.parse_args()


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def images_per_second(args: argparse.Namespace, compiled: bool) -> list[float]:
    model = timm.create_model(args.model, num_classes=1000, drop_path_rate=0.1).to(args.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.6e-3, weight_decay=0.05, fused=True)
    forward = torch.compile(model) if compiled else model
    images = torch.randn(args.batch_size, 3, 224, 224, device=args.device)
    labels = torch.randint(0, 1000, (args.batch_size,), device=args.device)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)

    def step() -> None:
        with torch.autocast(args.device, dtype=torch.bfloat16):
            output = forward(images)
            loss = criterion(output[0] if isinstance(output, tuple) else output, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(max(args.steps // 2, 1)):
        step()
    rates = []
    for _ in range(args.repeats):
        synchronize(args.device)
        started = time.perf_counter()
        for _ in range(args.steps):
            step()
        synchronize(args.device)
        rates.append(args.steps * args.batch_size / (time.perf_counter() - started))
    return rates


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"bench/timm_gpu_step.py: no usable CUDA GPU (torch {torch.__version__}): run it on a GPU node")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    rates = {"eager": images_per_second(args, compiled=False)}
    if not args.eager_only:
        rates["torch.compile"] = images_per_second(args, compiled=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    # Not bench/_common's header and table: that module imports the project, which this machine may lack.
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    memory = f"; peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if args.device == "cuda" else ""
    text = "\n".join([
        f"{device_name}, {date}; command: `{shlex.join(['python', *sys.argv])}`", "",
        f"timm {timm.__version__} `{args.model}`, torch {torch.__version__}, batch {args.batch_size}, median of "
        f"{args.repeats} x {args.steps} steps{memory}.", "",
        "| step | img/s (median) | x eager |", "| --- | --- | --- |",
        *(f"| {name} | {median:.0f} | {median / medians['eager']:.2f}x |" for name, median in medians.items()),
    ])
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)  # a missing folder would lose the raw numbers
        with args.json.open("w", encoding="utf-8") as file:
            json.dump({"report": text, "median_img_per_s": medians, "img_per_s": rates}, file, indent=2)


if __name__ == "__main__":
    main()
