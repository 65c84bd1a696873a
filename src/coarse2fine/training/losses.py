"""Training objectives, each a callable `objective(output, batch) -> loss` for the Trainer, with
`objective.prepare(batch)` applied to the batch before the forward.

- `GroundTruthObjective`: label-smoothed cross-entropy on the logits inference uses; with Mixup/CutMix (timm's
  `Mixup`, which mixes the images in `prepare` and makes the smoothed soft targets), soft cross-entropy.
- `TokenLabelObjective`: token labeling (Jiang et al.): soft cross-entropy of the class logits against the
  teacher's distribution over the crop (mixed by MixToken's lam when the model mixed tokens) plus, weighted,
  the mean soft cross-entropy of every token's logits against the teacher's distribution at that token.
  The token targets need no mixing: the model swaps the mixed tokens' logits back (timm's forward_train).
  With `ground_truth_mix` the class target is first mixed with the (smoothed) ground truth: w x teacher +
  (1 - w) x ground truth, w = `teacher_weight.agrees` where the teacher's crop top-1 is the label, else
  `.disagrees`; with `ground_truth_tokens` every token target too, by its own top-1.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy

from coarse2fine import config
from coarse2fine.labels.targets import entropy, smooth, token_targets
from coarse2fine.forward import TrainOutput


# Mean over every leading dimension (samples, and tokens for [B, N, C]) of -sum(target * log_softmax(logits)).
soft_cross_entropy = SoftTargetCrossEntropy()


# What TokenLabelObjective reports of its targets each epoch (Trainer metrics, in MLflow and metrics/<stage>):
# flat targets (entropy near log C) or targets that disagree with the labels show there without a second run.
TARGET_METRICS = ("target_entropy", "token_target_entropy", "target_top1", "token_target_top1")


def mix_token_lam(box: tuple[int, int, int, int], token_grid: int) -> float:
    """The share of each sample's own tokens: 1 - box area / tokens (1.0 for an empty box, no mixing)."""
    row1, col1, row2, col2 = box
    return 1.0 - (row2 - row1) * (col2 - col1) / token_grid**2


class GroundTruthObjective:
    def __init__(self, label_smoothing: float, num_classes: int | None = None, mixup: config.Mixup | None = None):
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.mixup = None
        if mixup is not None and mixup.enabled:
            self.mixup = Mixup(
                mixup_alpha=mixup.mixup_alpha, cutmix_alpha=mixup.cutmix_alpha, prob=mixup.prob,
                switch_prob=mixup.switch_prob, mode=mixup.mode, label_smoothing=label_smoothing,
                num_classes=num_classes,
            )

    @classmethod
    def from_params(cls, cfg: config.Train, num_classes: int) -> GroundTruthObjective:
        return cls(cfg.label_smoothing, num_classes, cfg.mixup)

    def prepare(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.mixup is None:
            return batch
        images, targets = self.mixup(batch["image"], batch["label"])
        return {**batch, "image": images, "target": targets}

    def target_metrics(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        return {}  # one-hot (smoothed or mixed) targets: nothing a user needs to watch

    def state_dict(self) -> dict[str, Any]:
        return {}  # no running sums (Mixup's draws come from the global RNGs, which checkpoints hold)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __call__(self, output: TrainOutput, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # The logits inference uses (class + 0.5 x best token), which also gives the aux head a gradient, as
        # DDP requires of every parameter.
        if "target" in batch:  # mixed by `prepare`
            return soft_cross_entropy(output.merged(), batch["target"])
        return self.criterion(output.merged(), batch["label"])


class TokenLabelObjective:
    """Token labeling from the rows of the token-label store the loader put in the batch (`token_log_probs`,
    `token_classes`: `build_loader(..., token_labels=store)`), on the batch's window, flip and affine.
    sail-sg/volo's weights by default: cls_weight 1.0, dense_weight 0.5."""

    def __init__(
        self,
        num_classes: int,
        *,
        label_smoothing: float,
        cls_weight: float = 1.0,
        dense_weight: float = 0.5,
        ground_truth_mix: bool = False,
        teacher_weight: config.TeacherWeight = config.TeacherWeight(),
        ground_truth_tokens: bool = False,
    ):
        self.num_classes = num_classes
        self.label_smoothing, self.cls_weight, self.dense_weight = label_smoothing, cls_weight, dense_weight
        self.ground_truth_mix, self.teacher_weight = ground_truth_mix, teacher_weight
        self.ground_truth_tokens = ground_truth_mix and ground_truth_tokens
        self.target_sums: torch.Tensor | None = None  # TARGET_METRICS' sums, then the sample count

    @classmethod
    def from_params(cls, num_classes: int, cfg: config.Pretrain) -> TokenLabelObjective:
        token_label = cfg.token_label
        return cls(
            num_classes, label_smoothing=token_label.label_smoothing, cls_weight=token_label.cls_weight,
            dense_weight=token_label.dense_weight, ground_truth_mix=token_label.ground_truth_mix,
            teacher_weight=token_label.teacher_weight, ground_truth_tokens=token_label.ground_truth_tokens,
        )

    def prepare(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return batch  # MixToken mixes inside the model

    def __call__(self, output: TrainOutput, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        device = output.cls_logits.device
        token_grid = math.isqrt(output.aux_logits.shape[1])
        with torch.autocast(device.type, enabled=False):  # targets in fp32 whatever the model runs in
            targets = token_targets(
                batch["token_log_probs"], batch["token_classes"], batch["window"], batch["flip"], batch["affine"],
                num_classes=self.num_classes, token_grid=token_grid, smoothing=self.label_smoothing,
                moved=batch["moved"],
            )
        cls_target, token_target = targets
        if self.ground_truth_mix:
            cls_target = mix_ground_truth(cls_target, batch["label"], self.label_smoothing, self.teacher_weight)
        if self.ground_truth_tokens:  # each token by its own top-1: [B, N, C] against the label of [B, 1]
            token_target = mix_ground_truth(
                token_target, batch["label"].unsqueeze(1), self.label_smoothing, self.teacher_weight
            )
        lam = mix_token_lam(output.mix_box, token_grid)
        if lam < 1.0:  # sample i's crop holds sample B-1-i's tokens inside the box
            cls_target = lam * cls_target + (1.0 - lam) * cls_target.flip(0)
        self._add_target_sums(cls_target, token_target, batch["label"])
        return self.cls_weight * soft_cross_entropy(output.cls_logits, cls_target) + (
            self.dense_weight * soft_cross_entropy(output.aux_logits, token_target)
        )

    def _add_target_sums(self, cls_target: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        """Sums on the device (no synchronisation in the step) of what the student is taught, as trained: the class
        target after ground-truth mixing and MixToken, the token targets, both with their smoothing."""
        with torch.no_grad():
            sums = torch.stack([
                entropy(cls_target).sum(),
                entropy(tokens).mean(dim=1).sum(),
                (cls_target.argmax(dim=-1) == labels).sum(),
                (tokens.argmax(dim=-1) == labels.unsqueeze(1)).float().mean(dim=1).sum(),
                cls_target.new_tensor(float(len(labels))),
            ]).float()
        self.target_sums = sums if self.target_sums is None else self.target_sums + sums

    def state_dict(self) -> dict[str, Any]:
        """The sums since the last target_metrics (a checkpoint inside an epoch holds them: its metrics stay whole)."""
        return {"target_sums": None if self.target_sums is None else self.target_sums.cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`state` from state_dict, its tensors already on the device (or {}: none since the epoch began)."""
        self.target_sums = state.get("target_sums")

    def target_metrics(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """The epoch's mean entropy (nats) and top-1 (% agreeing with the label) of the class and token targets. A
        collective: every rank sums, also one that computed no loss (a pipeline's earlier stages), with zeros."""
        sums = torch.zeros(len(TARGET_METRICS) + 1) if self.target_sums is None else self.target_sums
        sums, self.target_sums = all_reduce_sum(sums), None
        if sums[-1] == 0:  # no sample anywhere
            return {}
        means = (sums[:-1] / sums[-1]).tolist()
        return {name: value * (100.0 if name.endswith("top1") else 1.0) for name, value in zip(TARGET_METRICS, means)}


def mix_ground_truth(
    teacher: torch.Tensor, labels: torch.Tensor, smoothing: float, weight: config.TeacherWeight
) -> torch.Tensor:
    """w x teacher + (1 - w) x smoothed one-hot labels, per distribution: w = weight.agrees where the teacher's top-1
    is the label, weight.disagrees where it is not (sail-sg/volo's fine-tuning target with 0.5 / 0.9). `teacher`
    [..., C], `labels` broadcastable to its leading dimensions ([B] for [B, C], [B, 1] for [B, N, C])."""
    truth = smooth(torch.nn.functional.one_hot(labels, teacher.shape[-1]).to(teacher.dtype), smoothing)
    ratio = torch.where(teacher.argmax(-1) == labels, weight.agrees, weight.disagrees).unsqueeze(-1).to(teacher.dtype)
    return ratio * teacher + (1 - ratio) * truth
