"""Token-label generation throughput (img/s, fp32, CPU): the library's generate() against the teacher's bare
forward on the same images.

Teacher, settings and images: params.yaml's by default (teacher.model: resnet10t, output stride 8, at teacher.img_size
64 px: an 8 x 8 score map; token_labels.top_k and batch_size; loader.workers; the default data, data.source photos:
1080 train records), random weights (torch.manual_seed(0)), eval mode; the records are converted once into a
temporary directory. Each option overrides one of them. Rows:
- generation: coarse2fine.labels.generate.generate() as the token_labels stage runs it (whole view, bicubic,
  top-k, batch size, DataLoader workers), into a fresh output and work directory every call: reading and decoding
  the records, resizing, normalising, the dense head, top-k, writing the memory-mapped store, chunk markers, the
  header. Timed as the whole call;
- generation, loop only: the same calls, as generate() times itself (Generation.seconds, the stage's img/s
  metric): from starting the loader workers to the last batch written, without opening the records, probing
  the score grid, allocating the arrays and publishing the store;
- teacher bare forward: teacher(x) under torch.inference_mode on the same images, pre-loaded as normalised float
  batches of the same size (TrainRecords items, normalised as generate() does): no I/O, no top-k, no store;
- dense head only: dense_head(teacher)(x) on the same pre-loaded batches: the head's cost without the loop.
Ratios are against the bare forward (the goal: generation at least 0.8x of it). One call per row per
repeat, over every train record, after one untimed warm-up call each, repeats interleaved (see _common.py).

Run: python bench/token_labels.py [--repeats N] [--batch-size B] [--model NAME ...] (see --help)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from _common import (
    CPU, PROJECT_ROOT, add_tiny_argument, goal, header_line, interleaved, markdown_table, run_convert, tiny_sizes,
    write_json,
)
from coarse2fine import models
from coarse2fine.config import load_params, parse_model
from coarse2fine.data import records
from coarse2fine.data.transforms import IMAGE_MEAN, IMAGE_STD
from coarse2fine.labels.generate import DenseHead, TrainRecords, View, dense_head, generate

GOAL_VS_FORWARD = 0.8
BARE = "teacher bare forward"
GENERATION = "generation"
GENERATION_LOOP = "generation, loop only"
TINY_SUBSET = 0.1
PARAMS = load_params(PROJECT_ROOT / "params.yaml")  # the defaults of every option


def output_stride(text: str) -> int | None:
    return None if text == "none" else int(text)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    teacher = PARAMS.teacher
    parser.add_argument("--repeats", type=int, default=5, metavar="N", help="timed calls per row (default: 5)")
    parser.add_argument("--batch-size", type=int, default=PARAMS.token_labels.batch_size, metavar="N",
                        help="token_labels.batch_size (default: params.yaml's, %(default)s)")
    parser.add_argument("--top-k", type=int, default=PARAMS.token_labels.top_k, metavar="K",
                        help="token_labels.top_k (default: params.yaml's, %(default)s)")
    parser.add_argument("--workers", type=int, default=PARAMS.loader.workers, metavar="N",
                        help="loader.workers (default: params.yaml's, %(default)s)")
    parser.add_argument("--model", default=teacher.model.name, metavar="NAME",
                        help="the teacher, any timm model (default: params.yaml's, %(default)s)")
    parser.add_argument("--output-stride", type=output_stride, default=teacher.model.output_stride, metavar="N",
                        help="the teacher's output stride: 8, 16, 32 or none (the model's own; VOLO, ViT) "
                             "(default: params.yaml's, %(default)s)")
    parser.add_argument("--img-size", type=int, default=teacher.img_size, metavar="N",
                        help="the teacher's input size (default: params.yaml's, %(default)s)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers (every repeat) as JSON")
    add_tiny_argument(parser, f"a {TINY_SUBSET:g} subset of the data (data.subset), --repeats 1")
    args = parser.parse_args()
    tiny_sizes(parser, args, repeats=1)
    return args


class GenerateCalls:
    """One generate() over every train record per call, into a fresh directory (`fresh`: untimed, before every
    call of every row, removes the last one)."""

    def __init__(self, head: DenseHead, records_dir: Path, view: View, scratch: Path, args: argparse.Namespace):
        self.head, self.records_dir, self.view, self.scratch, self.args = head, records_dir, view, scratch, args
        self.run_dir: Path | None = None
        self.loop_rates: list[float] = []  # images / Generation.seconds of every call (first: the warm-up)

    def fresh(self) -> None:
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir)
        self.run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=self.scratch))

    def __call__(self) -> int:
        result = generate(
            self.head, self.records_dir, out_dir=self.run_dir / "out", work_dir=self.run_dir / "work", view=self.view,
            top_k=self.args.top_k, batch_size=self.args.batch_size, workers=self.args.workers, runtime=CPU,
            autocast_dtype=None, inputs={"bench": "token_labels"}, header={},
        )
        self.loop_rates.append(result.generated / result.seconds)
        return result.generated


def preloaded_batches(records_dir: Path, view: View, batch_size: int) -> list[torch.Tensor]:
    """Every train record as generate() feeds it to the teacher: its view, normalised, in batches of batch_size
    in record order (generate()'s batches: its chunks are whole batches)."""
    dataset = TrainRecords(records_dir, view)
    images = torch.stack([dataset[position][0] for position in range(len(dataset))])
    mean = torch.tensor(IMAGE_MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGE_STD).view(1, 3, 1, 1) * 255
    return list(((images.float() - mean) / std).split(batch_size))


class Forward:
    """`function` on every pre-loaded batch under inference mode, the outputs dropped."""

    def __init__(self, function: DenseHead, batches: list[torch.Tensor]):
        self.function, self.batches = function, batches

    def __call__(self) -> int:
        with torch.inference_mode():
            for batch in self.batches:
                self.function(batch)
        return sum(len(batch) for batch in self.batches)


def report(
    rates: dict[str, list[float]], teacher: torch.nn.Module, grid: int, images: int, args: argparse.Namespace
) -> tuple[str, dict]:
    medians = {name: statistics.median(values) for name, values in rates.items()}
    bare = medians[BARE]
    rows = [
        [name, f"{medians[name]:.0f}", f"{medians[name] / bare:.3f}x", f"{min(values):.0f}-{max(values):.0f}"]
        for name, values in rates.items()
    ]
    ratio = medians[GENERATION] / bare
    goals = [
        goal(f"generation >= {GOAL_VS_FORWARD}x bare forward", ratio >= GOAL_VS_FORWARD, f"{ratio:.3f}x, whole call")
    ]
    stride = "its own output stride" if args.output_stride is None else f"output stride {args.output_stride}"
    text = "\n".join(
        [
            header_line(),
            "",
            f"Token-label generation, fp32 CPU, {torch.get_num_threads()} threads: teacher {args.model} ({stride}, "
            f"{sum(p.numel() for p in teacher.parameters()) / 1e6:.2f} M parameters, random weights), "
            f"{args.img_size} px whole view, {grid} x {grid} score map, top-{args.top_k}, batch {args.batch_size}, "
            f"{args.workers} loader workers; {images} {PARAMS.data.source} train records per call, median of "
            f"{args.repeats} interleaved calls after a warm-up call.",
            "",
            markdown_table(["variant", "img/s (median)", "x bare forward", "img/s range"], rows),
            "",
            "Goals: " + "; ".join(goals) + ".",
        ]
    )
    raw = {"median_img_per_s": medians, "img_per_s": rates}
    return text, raw


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    teacher_cfg = parse_model({"name": args.model, "output_stride": args.output_stride})
    view = View("whole", args.img_size, "bicubic")
    with tempfile.TemporaryDirectory(prefix="coarse2fine-bench-") as scratch:
        records_dir = Path(scratch) / "records"
        data = PARAMS.data.model_copy(update={"subset": TINY_SUBSET} if args.tiny else {})
        run_convert(PARAMS.model_copy(update={"data": data}), records_dir)
        num_classes = len(records.read_classes(records_dir))
        teacher = models.build_model(teacher_cfg, num_classes=num_classes, img_size=args.img_size).eval()
        head = dense_head(teacher)
        batches = preloaded_batches(records_dir, view, args.batch_size)
        generation = GenerateCalls(head, records_dir, view, Path(scratch), args)
        variants = {
            GENERATION: generation,
            BARE: Forward(teacher, batches),
            "dense head only": Forward(head, batches),
        }
        rates = interleaved(variants, args.repeats, before=generation.fresh)
    rates = {GENERATION: rates.pop(GENERATION), GENERATION_LOOP: generation.loop_rates[1:], **rates}  # no warm-up
    with torch.inference_mode():
        grid = head(batches[0][:1]).shape[-1]
    text, raw = report(rates, teacher, grid, sum(len(batch) for batch in batches), args)
    print(text)
    write_json(args, text, raw)


if __name__ == "__main__":
    main()
