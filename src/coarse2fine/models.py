"""The model factory: any timm architecture, or the project's tiny VOLO, built from `config.Model`, randomly
initialised for one input size (never a download). The training forward is in forward.py; weights files, the
model file and resampling between sizes in checkpoints.py."""

from __future__ import annotations

from typing import Any

import timm
from timm.models.volo import VOLO
from torch import nn

from coarse2fine.config import CustomVolo, Model
from coarse2fine.errors import UserError, first_line


def build_model(model_cfg: Model, num_classes: int, img_size: int, *, mix_token: bool = False) -> nn.Module:
    """A randomly initialised model for `img_size` x `img_size` inputs (never downloads weights).

    `mix_token` (VOLO only) turns on MixToken in the training forward; the weights and `model(x)` are the same.
    """
    if isinstance(model_cfg, CustomVolo):
        return VOLO(
            layers=list(model_cfg.layers),
            embed_dims=list(model_cfg.embed_dims),
            num_heads=list(model_cfg.num_heads),
            mlp_ratio=model_cfg.mlp_ratio,
            patch_size=model_cfg.patch_size,
            img_size=img_size,
            num_classes=num_classes,
            drop_path_rate=model_cfg.drop_path,
            use_mix_token=mix_token,
        )
    options: dict[str, Any] = {}
    if model_cfg.has_token_outputs:
        options["use_mix_token"] = mix_token
    pretrained_cfg = timm.models.get_pretrained_cfg(model_cfg.name)
    if pretrained_cfg is not None and pretrained_cfg.fixed_input_size:  # ViT, VOLO...: the pos-embed's size
        options["img_size"] = img_size
    if model_cfg.dropout > 0:  # timm >= 0.9's names for what timm 0.4's ViT called drop_rate
        options |= {"pos_drop_rate": model_cfg.dropout, "proj_drop_rate": model_cfg.dropout}
    if model_cfg.output_stride is not None:
        options["output_stride"] = model_cfg.output_stride
    if model_cfg.drop_path > 0:  # not every architecture takes it
        options["drop_path_rate"] = model_cfg.drop_path
    try:
        return timm.create_model(model_cfg.name, pretrained=False, num_classes=num_classes, **options)
    except TypeError as error:  # an option the architecture does not take
        raise UserError(f"{model_cfg.name}: cannot be built with {options} ({first_line(error)})") from None
