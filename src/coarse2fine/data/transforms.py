"""What both loader backends do to an image and to its geometry, defined once so that they cannot drift apart:
timm's normalisation constants, RandAugment's op set and magnitudes, random erasing, the eval transform, and the
maths of crop windows and affine maps (docs/contracts.md, "Loaders")."""

from __future__ import annotations

import math
from typing import Any

import torch
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.data.random_erasing import RandomErasing

from coarse2fine.config import Augment

IMAGE_MEAN = IMAGENET_DEFAULT_MEAN
IMAGE_STD = IMAGENET_DEFAULT_STD
# timm's RandAugment set (its _RAND_TRANSFORMS), which DALI's auto_aug provides too. Left out: Posterize: timm
# 1.0.31 asks Pillow for 0 bits at high magnitudes (m10, or m9 plus mstd noise), which Pillow 13 rejects with a
# ValueError that kills the DataLoader worker.
RAND_AUGMENT_COLOUR_OPS = (
    "auto_contrast",
    "equalize",
    "invert",
    "solarize",
    "solarize_add",
    "color",
    "contrast",
    "brightness",
    "sharpness",
)
RAND_AUGMENT_GEOMETRIC_OPS = ("rotate", "shear_x", "shear_y", "translate_x", "translate_y")
RAND_AUGMENT_OPS = RAND_AUGMENT_COLOUR_OPS + RAND_AUGMENT_GEOMETRIC_OPS
# timm's strongest geometric ops (level 10; level m is m / 10 of these): degrees, shear factor, and translation as
# a share of the image's width/height (its translate_pct default).
MAX_ROTATE_DEGREES = 30.0
MAX_SHEAR = 0.3
MAX_TRANSLATE = 0.45
IDENTITY_AFFINE = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])

_NORMALISE_MEAN = torch.tensor(IMAGE_MEAN).view(3, 1, 1)
_NORMALISE_STD = torch.tensor(IMAGE_STD).view(3, 1, 1)


def normalise_pixels(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [3, H, W] (any strides) -> float32 [3, H, W] contiguous, normalised: bit for bit what v2's
    ToDtype(float32, scale=True) -> Normalize give, but in place on one contiguous buffer (that chain allocates
    twice and keeps a channels-last stride, which collate then has to gather): 0.85 instead of 1.6 ms a 224 px
    sample, collate included."""
    scaled = pixels.to(torch.float32, memory_format=torch.contiguous_format).mul_(1 / 255)
    return scaled.sub_(_NORMALISE_MEAN).div_(_NORMALISE_STD)


def random_erasing(augment: Augment) -> RandomErasing | None:
    """timm's RandomErasing in pixel mode (a box of per-pixel N(0, 1) noise, normalised units) for a normalised
    CPU image; None when augment.reprob is 0. The torch backend and the DALI backend's host finish use it."""
    return RandomErasing(augment.reprob, mode="pixel", device="cpu") if augment.reprob > 0 else None


def eval_transform(img_size: int, crop_pct: float, interpolation: str) -> dict[str, Any]:
    """The val loaders' preprocessing as plain data, stored with a model so that `coarse2fine.predict` (or anyone
    loading it from MLflow) feeds it images exactly as it was validated: resize the shorter side to
    floor(img_size / crop_pct) with `interpolation`, centre-crop img_size, scale to [0, 1], normalise."""
    return {
        "img_size": img_size, "crop_pct": crop_pct, "interpolation": interpolation,
        "mean": list(IMAGE_MEAN), "std": list(IMAGE_STD),
    }


def resized_short_side(img_size: int, crop_pct: float) -> int:
    """Evaluation resizes the shorter side to this, then centre-crops img_size (timm's crop_pct rule)."""
    return math.floor(img_size / crop_pct)


def center_crop_box(image_hw: torch.Tensor, img_size: int, crop_pct: float) -> torch.Tensor:
    """[B, 4] (top, left, height, width) in original pixels of "resize shorter side to floor(S / crop_pct),
    centre crop S" (larger than the image when crop_pct > 1: the crop is padded)."""
    image_hw = image_hw.to(torch.float64)
    side = img_size * image_hw.min(dim=1, keepdim=True).values / resized_short_side(img_size, crop_pct)
    top_left = (image_hw - side) / 2
    return torch.cat([top_left, side, side], dim=1)


def normalised_window(crop_box: torch.Tensor, image_hw: torch.Tensor) -> torch.Tensor:
    """[B, 4] float32 (top/H, left/W, height/H, width/W) from pixel boxes (top, left, height, width)."""
    image_hw = image_hw.to(torch.float64)
    crop_box = crop_box.to(torch.float64)
    return torch.cat([crop_box[:, :2] / image_hw, crop_box[:, 2:] / image_hw], dim=1).to(torch.float32)


def normalised_affine(pixel_map: torch.Tensor, size_hw: torch.Tensor) -> torch.Tensor:
    """[B, 2, 3] maps output -> input in continuous pixel coordinates (x, y; pixel centres at +0.5) of images of
    `size_hw` [B, 2] (height, width) -> the same maps in coordinates normalised to [0, 1], float32."""
    height, width = size_hw.to(torch.float64).unbind(dim=1)
    scale = torch.stack([width, height], dim=1)[:, :, None]  # [B, 2, 1]
    pixel_map = pixel_map.to(torch.float64)
    linear = pixel_map[:, :, :2] * scale.transpose(1, 2) / scale
    shift = pixel_map[:, :, 2:] / scale
    return torch.cat([linear, shift], dim=2).to(torch.float32)


def homogeneous(affine: torch.Tensor) -> torch.Tensor:
    """[..., 2, 3] -> [..., 3, 3] with the row (0, 0, 1)."""
    last_row = torch.zeros_like(affine[..., :1, :])
    last_row[..., 2] = 1
    return torch.cat([affine, last_row], dim=-2)


def moved_rows(affine: torch.Tensor) -> torch.Tensor:
    """The rows of a batch whose RandAugment drew a geometric op (an `affine` [B, 2, 3] other than the identity),
    as indices. The loader finds them on the host, so the step knows their count without waiting for the GPU."""
    return is_moved(affine).nonzero().flatten()


def is_moved(affine: torch.Tensor) -> torch.Tensor:
    """[B] bool: whether each row's `affine` [B, 2, 3] is not the identity."""
    return (affine != affine.new_tensor([[1, 0, 0], [0, 1, 0]])).flatten(1).any(dim=1)
