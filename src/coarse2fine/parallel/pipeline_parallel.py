"""Pipeline parallelism's split of a model (params `parallel.pipeline`): which of timm's ViT or VOLO parts each
pipeline stage holds, the model pruned to one pipeline stage's parts in place, and that stage's forward. Here (and
in torch.distributed.pipelining) a "stage" is a pipeline stage, one rank's share of the model; everywhere else in
the project, a stage is a DVC stage of the pipeline in dvc.yaml.

The blocks (the parameterised members of the model's containers, coarse2fine.parallel.model_blocks.named_blocks: ViT's
blocks; VOLO's outlookers, downsample, transformers and class blocks) are dealt out in consecutive, equal runs
(the first stages take one more when they do not divide); the stem goes with the first stage, the final norm and
heads with the last, VOLO's position embedding with the stage of the first block after which timm adds it and
its class token with the first class block's. A pruned part is replaced by nn.Identity (a parameter by None), so
a stage keeps the model's names: its state dict is the whole model's restricted to its keys, and the stages' DCP
shards make one checkpoint.
"""

from __future__ import annotations

from typing import Iterator

import torch
from timm.models.vision_transformer import VisionTransformer
from timm.models.volo import VOLO
from torch import nn

from coarse2fine.parallel import model_blocks
from coarse2fine.errors import UserError

VIT_STEM = ("patch_embed", "cls_token", "reg_token", "pos_embed", "norm_pre")
VOLO_STEM = ("patch_embed",)
VOLO_POS_EMBED_BEFORE = "network.2"  # timm's VOLO.forward_tokens adds pos_embed before network[2]


def assign(model: nn.Module, stages: int) -> dict[str, int]:
    """The stage of each parameterised part of `model`, by name (a block, or a top-level module or parameter)."""
    if not isinstance(model, (VisionTransformer, VOLO)):
        raise UserError(
            f"parallel.pipeline: {stages} splits timm's ViT and VOLO; not {type(model).__name__} (parallel applies "
            f"to every training stage: import the teacher, teacher.mode: import, or train it with pipeline: 1)"
        )
    blocks = [name for name, _ in model_blocks.named_blocks(model)]
    if len(blocks) < stages:
        raise UserError(f"parallel.pipeline: {stages} stages, but {type(model).__name__} has {len(blocks)} blocks")
    parts = {name: index * stages // len(blocks) for index, name in enumerate(blocks)}
    stem = VIT_STEM if isinstance(model, VisionTransformer) else VOLO_STEM
    if isinstance(model, VOLO):
        if model.post_network is None or model.global_pool != "token" or model.aux_head is None:
            raise UserError("parallel.pipeline: splits a VOLO with class blocks, token pooling and an aux head only")
        parts["pos_embed"] = next(stage for name, stage in parts.items() if _within(name, VOLO_POS_EMBED_BEFORE))
        parts["cls_token"] = parts["post_network.0"]
    for name, _ in _top_level_parts(model):
        parts.setdefault(name, 0 if name in stem else stages - 1)
    return parts


def owner(key: str, parts: dict[str, int]) -> int:
    """The stage holding state-dict key `key`."""
    return next(stage for name, stage in parts.items() if _within(key, name))


def keep_stage(model: nn.Module, stage: int, parts: dict[str, int]) -> None:
    """Prune `model` in place to stage `stage`'s parts."""
    for name, holder in parts.items():
        if holder == stage:
            continue
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if isinstance(getattr(parent, attribute), nn.Parameter):
            setattr(parent, attribute, None)
        else:
            parent.register_module(attribute, nn.Identity())


class StageForward(nn.Module):
    """One stage's share of the training forward (forward.TrainForward's): the stem on the first stage, its blocks,
    the heads on the last, which returns (class logits, token logits) for a VOLO and the logits otherwise."""

    def __init__(self, model: nn.Module, stage: int, parts: dict[str, int]):
        super().__init__()
        self.model, self.stages = model, max(parts.values()) + 1
        self.is_first, self.is_last = stage == 0, stage == self.stages - 1
        # VOLO: whether this stage takes the tokens off their grid (no later stage runs a network block) and adds
        # the class token (it holds it).
        network = [holder for name, holder in parts.items() if name.startswith("network.")]
        self.ends_grid = isinstance(model, VOLO) and stage >= max(network)
        self.adds_class_token = parts.get("cls_token") == stage

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        output = self._volo(self.model, x) if isinstance(self.model, VOLO) else self._vit(self.model, x)
        # what goes to the next stage is sent as it is laid out in memory: gloo and nccl send contiguous tensors
        return output if self.is_last else output.contiguous()

    def _vit(self, model: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
        x = model.blocks(x)  # this stage's blocks; the others are nn.Identity
        return model.forward_head(model.norm(x)) if self.is_last else x

    def _volo(self, model: VOLO, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.is_first:
            x = model.patch_embed(x).permute(0, 2, 3, 1)  # B,C,H,W -> B,H,W,C as forward_train
        if x.ndim == 4:  # on the token grid: network blocks (timm's forward_tokens)
            for index, block in enumerate(model.network):
                if index == 2 and model.pos_embed is not None:
                    x = model.pos_drop(x + model.pos_embed)
                x = block(x)
            if self.ends_grid:
                x = x.reshape(x.shape[0], -1, x.shape[-1])
        if self.adds_class_token:  # timm's forward_cls
            x = torch.cat([model.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        for block in model.post_network:
            x = block(x)
        if not self.is_last:
            return x
        x = model.norm(x)
        return model.head(model.head_drop(x[:, 0])), model.aux_head(x[:, 1:])


def _within(key: str, name: str) -> bool:
    return key == name or key.startswith(f"{name}.")


def _top_level_parts(model: nn.Module) -> Iterator[tuple[str, object]]:
    """The model's own parameters and its parameterised children that are not block containers."""
    for name, parameter in model.named_parameters(recurse=False):
        yield name, parameter
    for name, child in model.named_children():
        if not isinstance(child, (nn.Sequential, nn.ModuleList)) and any(True for _ in child.parameters()):
            yield name, child
