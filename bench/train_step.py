"""Training-step throughput (img/s, fp32, CPU): the project's Trainer against a bare hand-written PyTorch loop.

Same tiny VOLO (params.yaml model defaults), same batch (pretrain defaults: 64 x 3 x 32 x 32), same AdamW and
label-smoothed cross-entropy on the same logits (model(x) = class logits + 0.5 x best token logits), on random
tensors loaded before timing, so only the training step is compared, never data loading. Rows:
- bare loop: forward_train + head, loss, backward, torch.optim.AdamW step, zero_grad;
- Trainer step: coarse2fine.train.Trainer.backward + optimizer_step (timm optimizer, per-update LR schedule,
  grad scaler pass-through, autocast context);
- Trainer epoch: Trainer._train_epoch over an in-memory loader yielding the same batches (adds the epoch loop:
  progress bar, per-step loss.item(), loss sums), still without data loading.
Each call runs --steps steps; every row is warmed up once, then the repeats run interleaved (see _common.py).
Besides wall-clock img/s, img per CPU-second of the process (all its threads) is reported: on a shared machine the
wall clock also counts time other jobs held the cores, the CPU time counts only the work done.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from _common import CPU, goal, header_line, interleaved, markdown_table, write_json
from coarse2fine import models
from coarse2fine.config import Params, parse_params
from coarse2fine.train import Trainer, seed_everything

NUM_CLASSES = 10
GOAL_VS_BARE = 0.95


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, metavar="N", help="training steps per timed call (default: 20)")
    parser.add_argument("--repeats", type=int, default=7, metavar="N", help="timed calls per row (default: 7)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), metavar="N",
                        help=f"torch intra-op threads (default: {torch.get_num_threads()}, this machine's default)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers (every repeat) as JSON")
    return parser.parse_args()


def random_batches(params: Params, count: int) -> list[dict[str, torch.Tensor]]:
    cfg = params.pretrain
    generator = torch.Generator().manual_seed(params.seed)
    return [
        {
            "image": torch.randn(cfg.batch_size, 3, cfg.img_size, cfg.img_size, generator=generator),
            "label": torch.randint(NUM_CLASSES, (cfg.batch_size,), generator=generator),
        }
        for _ in range(count)
    ]


def new_model(params: Params) -> torch.nn.Module:
    seed_everything(params.seed, CPU)
    return models.build_model(params.model, num_classes=NUM_CLASSES, img_size=params.pretrain.img_size)


class CpuTimed:
    """A variant call that also records its items per CPU-second of this process (first call: the warm-up)."""

    def __init__(self, run: Callable[[], int]):
        self.run = run
        self.rates: list[float] = []

    def __call__(self) -> int:
        started = time.process_time()
        items = self.run()
        self.rates.append(items / (time.process_time() - started))
        return items


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
    """The Trainer's Loader protocol over pre-loaded batches."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]):
        self.batches = batches

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def new_trainer(params: Params, batches: list[dict[str, torch.Tensor]], scratch: Path) -> Trainer:
    loader = InMemoryLoader(batches)
    return Trainer(
        stage="bench", params=params, cfg=params.pretrain, model=new_model(params), classes=[str(i) for i in range(NUM_CLASSES)],
        train_loader=loader, val_loader=loader, runtime=CPU, param_sections=("pretrain",), data_digest="random",
        checkpoint_dir=scratch, model_file=scratch / "model.pt", metrics_dir=scratch,
    )


class TrainerSteps:
    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def __call__(self) -> int:
        self.trainer.train_forward.train()
        for batch in self.trainer.train_loader:
            self.trainer.backward(batch, micro_steps=1, sync=True)
            self.trainer.optimizer_step()
        return len(self.trainer.train_loader) * self.trainer.cfg.batch_size


class TrainerEpoch:
    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def __call__(self) -> int:
        self.trainer._train_epoch(epoch=0)
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
    goals = [
        goal(f"Trainer step >= {GOAL_VS_BARE}x bare loop", ratio >= GOAL_VS_BARE, f"{ratio:.3f}x wall clock"),
        goal("same per CPU-second", cpu_ratio >= GOAL_VS_BARE, f"{cpu_ratio:.3f}x"),
    ]
    model, cfg = params.model, params.pretrain
    text = "\n".join(
        [
            header_line(),
            "",
            f"Train steps, fp32 CPU, {args.threads} threads: VOLO layers {list(model.layers)}, dims {list(model.embed_dims)}, "
            f"patch {model.patch_size}, {cfg.img_size} px, batch {cfg.batch_size}, AdamW, label smoothing "
            f"{cfg.label_smoothing}; {args.steps} steps per call on pre-loaded random tensors, median of "
            f"{args.repeats} interleaved calls after a warm-up call.",
            "",
            markdown_table(
                ["variant", "img/s (median)", "x bare loop", "img/s range", "img/CPU-s (median)", "x bare loop (CPU)"],
                rows,
            ),
            "",
            "Goals: " + "; ".join(goals) + ".",
            "Not measured yet: token labeling and MixToken rows (the Trainer has neither; a later issue adds them).",
        ]
    )
    raw = {"median_img_per_s": medians, "img_per_s": rates, "img_per_cpu_s": cpu_rates, "goals": goals}
    return text, raw


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    params = parse_params({})  # the schema defaults = params.yaml's model and pretrain sections
    batches = random_batches(params, args.steps)
    with tempfile.TemporaryDirectory(prefix="coarse2fine-bench-") as scratch:
        variants = {
            "bare loop": CpuTimed(BareLoop(params, batches)),
            "Trainer step": CpuTimed(TrainerSteps(new_trainer(params, batches, Path(scratch)))),
            "Trainer epoch": CpuTimed(TrainerEpoch(new_trainer(params, batches, Path(scratch)))),
        }
        rates = interleaved(variants, args.repeats)
    cpu_rates = {name: variant.rates[1:] for name, variant in variants.items()}  # without the warm-up call
    text, raw = report(rates, cpu_rates, params, args)
    print(text)
    write_json(args, text, raw)


if __name__ == "__main__":
    main()
