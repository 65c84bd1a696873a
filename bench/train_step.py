"""Training-step throughput (img/s, fp32, CPU): the project's Trainer against a bare hand-written PyTorch loop.

Same tiny VOLO (params.yaml model defaults), same batch (pretrain defaults: 64 x 3 x 48 x 48), same AdamW and
label-smoothed cross-entropy on the same logits (model(x) = class logits + 0.5 x best token logits), on random
tensors loaded before timing, so only the training step is compared, never data loading. Rows:
- bare loop: forward_train + head, loss, backward, torch.optim.AdamW step, zero_grad;
- Trainer step: coarse2fine.training.train.Trainer.backward + optimizer_step (timm optimizer, per-update LR schedule,
  grad scaler pass-through, autocast context);
- Trainer epoch: Trainer.train_epoch over an in-memory loader yielding the same batches (adds the epoch loop:
  progress bar, per-step loss.item(), loss sums), still without data loading;
- Trainer step + token labels: the same steps with losses.TokenLabelObjective: per batch, the top-k teacher
  maps looked up in a memory-mapped TokenLabelStore by record index, dense targets by roi_align on the batch's
  random crop windows and flips, soft cross-entropy on the class token and on every token;
- + MixToken: the same, with the model built with MixToken (timm's forward_train mixes and unmixes tokens).
The token-label rows' cost is read against the Trainer step row (the recipe's goal: at most 15 %).
Each call runs --steps steps; every row is warmed up once, then the repeats run interleaved (see _common.py).
Besides wall-clock img/s, img per CPU-second of the process (all its threads) is reported: on a shared machine the
wall clock also counts time other jobs held the cores, the CPU time counts only the work done.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Iterator

import torch
import yaml

from _common import (
    CPU, PROJECT_ROOT, CpuTimed, TrainerSteps, add_threads_argument, add_tiny_argument, bench_trainer, goal,
    header_line, interleaved, markdown_table, random_store, tiny_sizes, write_json,
)
from coarse2fine import models
from coarse2fine.config import Params, parse_params
from coarse2fine.data.loaders import with_target_inputs
from coarse2fine.data.transforms import IDENTITY_AFFINE
from coarse2fine.labels.store import TokenLabelStore
from coarse2fine.training.train import Trainer, seed_everything

NUM_CLASSES = 10
GOAL_VS_BARE = 0.95
GOAL_TOKEN_LABEL_COST = 0.15
# The teacher's maps in the bench store: top-5 classes on a 4 x 4 grid (the default teacher's, at 32 px).
TOP_K, TEACHER_GRID = 5, 4
TINY_BATCH = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, metavar="N", help="training steps per timed call (default: 20)")
    parser.add_argument("--repeats", type=int, default=7, metavar="N", help="timed calls per row (default: 7)")
    add_threads_argument(parser)
    parser.add_argument("--patch-size", type=int, metavar="N",
                        help="model.patch_size (default: params.yaml's 4, i.e. 4 x 4 tokens at 32 px; 8 gives 2 x 2)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers (every repeat) as JSON")
    parser.add_argument("--profile", action="store_true",
                        help="then print torch.profiler's operators over one bare-loop call, by self CPU time")
    add_tiny_argument(parser, f"--steps 1, --repeats 1, pretrain.batch_size {TINY_BATCH}")
    args = parser.parse_args()
    tiny_sizes(parser, args, steps=1, repeats=1)
    return args


def random_batches(params: Params, count: int) -> list[dict[str, torch.Tensor]]:
    """Batches as the loaders give them on a CPU: images, labels, record indices (batch i holds records i*B..),
    random crop windows inside the image and random flips."""
    cfg = params.pretrain
    generator = torch.Generator().manual_seed(params.seed)
    batches = []
    for step in range(count):
        size = torch.rand(cfg.batch_size, 2, generator=generator) * 0.7 + 0.3
        top_left = torch.rand(cfg.batch_size, 2, generator=generator) * (1 - size)
        batches.append(
            {
                "image": torch.randn(cfg.batch_size, 3, cfg.img_size, cfg.img_size, generator=generator),
                "label": torch.randint(NUM_CLASSES, (cfg.batch_size,), generator=generator),
                "index": torch.arange(step * cfg.batch_size, (step + 1) * cfg.batch_size),
                "window": torch.cat([top_left, size], dim=1),
                "flip": torch.rand(cfg.batch_size, generator=generator) < 0.5,
                "affine": IDENTITY_AFFINE.expand(cfg.batch_size, 2, 3),
            }
        )
    return batches


def new_model(params: Params, mix_token: bool = False) -> torch.nn.Module:
    seed_everything(params.seed, CPU)
    return models.build_model(
        params.model, num_classes=NUM_CLASSES, img_size=params.pretrain.img_size, mix_token=mix_token
    )


TOKEN_LABEL_ROW = "Trainer step + token labels + MixToken"


def token_grid(params: Params) -> int:
    return params.pretrain.img_size // params.model.patch_size // 2  # VOLO pools the stem's grid by 2


class BareLoop:
    """What one would write by hand: no wrapper, no scheduler, no scaler, no autocast context."""

    def __init__(self, params: Params, batches: list[dict[str, torch.Tensor]]):
        cfg = params.pretrain
        self.model = new_model(params).train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=1e-3, betas=cfg.optimizer.betas, weight_decay=cfg.optimizer.weight_decay
        )
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        self.batches = batches

    def __call__(self) -> int:
        for batch in self.batches:
            cls_features, aux_logits, _ = self.model.forward_train(batch["image"])
            logits = self.model.head(cls_features) + 0.5 * aux_logits.amax(dim=1)
            loss = self.criterion(logits, batch["label"])
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return sum(len(batch["label"]) for batch in self.batches)


class InMemoryLoader:
    """The Trainer's Loader protocol over pre-loaded batches; with `token_labels`, each batch gets its store rows
    as the real loader adds them (the lookup is timed with the step)."""

    def __init__(self, batches: list[dict[str, torch.Tensor]], token_labels: TokenLabelStore | None = None):
        self.batches = batches
        self.token_labels = token_labels

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        pass  # the bench times whole epochs

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.token_labels is None:
            return iter(self.batches)
        return (with_target_inputs(batch, self.token_labels) for batch in self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def new_trainer(
    params: Params,
    batches: list[dict[str, torch.Tensor]],
    scratch: Path,
    *,
    token_labels: TokenLabelStore | None = None,
    mix_token: bool = False,
) -> Trainer:
    loader = InMemoryLoader(batches, token_labels)
    return bench_trainer(
        params, new_model(params, mix_token), CPU, scratch, num_classes=NUM_CLASSES, train_loader=loader,
        val_loader=loader, token_labels=token_labels is not None,
    )


def trainer_steps(trainer: Trainer) -> TrainerSteps:
    """The Trainer's updates over its in-memory loader (the store rows looked up per batch, as the loader does)."""
    return TrainerSteps(trainer, lambda: trainer.train_loader)


class TrainerEpoch:
    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def __call__(self) -> int:
        self.trainer.train_epoch(epoch=0)
        return len(self.trainer.train_loader) * self.trainer.cfg.batch_size


def report(
    rates: dict[str, list[float]], cpu_rates: dict[str, list[float]], params: Params, args: argparse.Namespace
) -> tuple[str, dict]:
    medians = {name: statistics.median(values) for name, values in rates.items()}
    cpu_medians = {name: statistics.median(values) for name, values in cpu_rates.items()}
    bare, cpu_bare = medians["bare loop"], cpu_medians["bare loop"]
    rows = [
        [
            name, f"{medians[name]:.0f}", f"{medians[name] / bare:.3f}x", f"{min(values):.0f}-{max(values):.0f}",
            f"{cpu_medians[name]:.0f}", f"{cpu_medians[name] / cpu_bare:.3f}x",
        ]
        for name, values in rates.items()
    ]
    ratio, cpu_ratio = medians["Trainer step"] / bare, cpu_medians["Trainer step"] / cpu_bare
    token_label_cost = 1 - medians[TOKEN_LABEL_ROW] / medians["Trainer step"]
    goals = [
        goal(f"Trainer step >= {GOAL_VS_BARE}x bare loop", ratio >= GOAL_VS_BARE, f"{ratio:.3f}x wall clock"),
        goal("same per CPU-second", cpu_ratio >= GOAL_VS_BARE, f"{cpu_ratio:.3f}x"),
        goal(
            f"token labels + MixToken cost <= {GOAL_TOKEN_LABEL_COST:.0%} of the Trainer step",
            token_label_cost <= GOAL_TOKEN_LABEL_COST,
            f"{token_label_cost:.1%}",
        ),
    ]
    model, cfg = params.model, params.pretrain
    text = "\n".join(
        [
            header_line(),
            "",
            f"Train steps, fp32 CPU, {args.threads} threads: VOLO layers {list(model.layers)}, dims {list(model.embed_dims)}, "
            f"patch {model.patch_size}, {cfg.img_size} px, batch {cfg.batch_size}, AdamW, label smoothing "
            f"{cfg.label_smoothing}; {args.steps} steps per call on pre-loaded random tensors, median of "
            f"{args.repeats} interleaved calls after a warm-up call. Token labels: top-{TOP_K} teacher maps on a "
            f"{TEACHER_GRID} x {TEACHER_GRID} grid, the model's "
            f"{token_grid(params)} x {token_grid(params)} tokens.",
            "",
            markdown_table(
                ["variant", "img/s (median)", "x bare loop", "img/s range", "img/CPU-s (median)", "x bare loop (CPU)"],
                rows,
            ),
            "",
            "Goals: " + "; ".join(goals) + ".",
        ]
    )
    raw = {"median_img_per_s": medians, "img_per_s": rates, "img_per_cpu_s": cpu_rates}
    return text, raw


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    # params.yaml's model and pretrain sections (the default student), with --patch-size if given.
    raw = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())
    if args.patch_size:
        raw["model"]["patch_size"] = args.patch_size
    if args.tiny:
        raw["pretrain"]["batch_size"] = TINY_BATCH
    params = parse_params(raw)
    batches = random_batches(params, args.steps)
    with tempfile.TemporaryDirectory(prefix="coarse2fine-bench-") as scratch:
        store = random_store(
            Path(scratch) / "token_labels", args.steps * params.pretrain.batch_size, num_classes=NUM_CLASSES,
            top_k=TOP_K, grid=TEACHER_GRID, seed=params.seed,
        )
        variants = {
            "bare loop": CpuTimed(BareLoop(params, batches)),
            "Trainer step": CpuTimed(trainer_steps(new_trainer(params, batches, Path(scratch)))),
            "Trainer epoch": CpuTimed(TrainerEpoch(new_trainer(params, batches, Path(scratch)))),
            "Trainer step + token labels": CpuTimed(
                trainer_steps(new_trainer(params, batches, Path(scratch), token_labels=store))
            ),
            TOKEN_LABEL_ROW: CpuTimed(
                trainer_steps(new_trainer(params, batches, Path(scratch), token_labels=store, mix_token=True))
            ),
        }
        rates = interleaved(variants, args.repeats)
    cpu_rates = {name: variant.rates[1:] for name, variant in variants.items()}  # without the warm-up call
    text, raw = report(rates, cpu_rates, params, args)
    print(text)
    write_json(args, text, raw)
    if args.profile:
        print(f"\nWhere the bare loop's time goes (torch.profiler, one call of {args.steps} steps after a warm-up one):")
        print(operator_profile(BareLoop(params, batches)))


def operator_profile(call: BareLoop, rows: int = 12) -> str:
    """torch.profiler's operator table over one call, by self CPU time (the threads' time inside each operator)."""
    from torch.profiler import ProfilerActivity, profile

    call()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        call()
    return profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


if __name__ == "__main__":
    main()
