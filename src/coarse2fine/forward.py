"""The training forward of a model (`TrainForward`: what DDP, FSDP and the pipeline stages wrap) and its
compilation. timm does the work; this module fixes the two places where using its VOLO naively goes wrong
(`TrainForward`, `compiled_train_forward`)."""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from timm.models.volo import VOLO
from torch import nn
from torch.distributed.fsdp import FSDPModule


class TrainOutput(NamedTuple):
    cls_logits: torch.Tensor  # [B, C]: head(class token) of a VOLO; the logits of any other model
    aux_logits: torch.Tensor | None = None  # VOLO: [B, N, C], one prediction per token (token labeling's targets)
    # MixToken's box on the token grid, (row1, col1, row2, col2): inside it sample i held sample B-1-i's
    # tokens (aux_logits are already swapped back). (0, 0, 0, 0) when nothing was mixed.
    mix_box: tuple[int, int, int, int] = (0, 0, 0, 0)

    def merged(self) -> torch.Tensor:
        """[B, C]: exactly what `model(x)` returns at inference (VOLO: class logits + 0.5 x best token logits)."""
        if self.aux_logits is None:
            return self.cls_logits
        return self.cls_logits + 0.5 * self.aux_logits.amax(dim=1)


class TrainForward(nn.Module):
    """The training forward of a model, as a module so DDP can wrap it: `model(x)`, except for a VOLO.

    timm's `forward_train` returns the class token's pre-logits (the caller must apply `head_drop` and
    `head`) plus the per-token logits. Calling `ddp.module.forward_train(x)` would bypass DDP's forward,
    and gradients would never be averaged across ranks; wrapping this module in DDP keeps them in sync.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> TrainOutput:
        if not isinstance(self.model, VOLO):
            return TrainOutput(self.model(images))
        cls_features, aux_logits, box = self.model.forward_train(images)
        cls_logits = self.model.head(self.model.head_drop(cls_features))
        return TrainOutput(cls_logits, aux_logits, tuple(int(edge) for edge in box))


def compiled_train_forward(model: nn.Module) -> nn.Module:
    """`TrainForward(model)` through torch.compile, for `train.compile`; it shares `model`'s parameters, and
    validation, the EMA and the saved model keep the eager `model`.

    A VOLO is compiled block group by block group (the stem, each entry of `network`, each class-attention block), with
    MixToken between them left eager: its box comes from `.item()` and slices the token grid, so a whole-model
    compile broke the graph there and recompiled for every new box shape, 16-24 s each on the CPU, up to dynamo's
    recompile limit, after which the rest of the network ran eagerly (seen on an H100 and on the CPU, 2026-11-26).
    The compiled groups see the same shapes at every step and compile once each, as torchtitan compiles per block.
    They run in a view of the model (its own table of children). A VOLO sharded by FSDP2 cannot be viewed (its
    class and its `forward_train` belong to FSDP's state of that very module): it is compiled whole, as any
    other model, MixToken's recompiles included.
    """
    if not isinstance(model, VOLO) or isinstance(model, FSDPModule):
        return torch.compile(TrainForward(model))
    view = copy.copy(model)  # the same parameters and buffers, with a children table of its own
    view._modules = dict(model._modules)
    view.patch_embed = torch.compile(model.patch_embed)
    view.network = nn.ModuleList(torch.compile(group) for group in model.network)
    if model.post_network is not None:
        view.post_network = nn.ModuleList(torch.compile(block) for block in model.post_network)
    return TrainForward(view)
