"""Per-batch token-labeling targets, computed on the batch's device from the teacher's top-k score maps.

For each sample: scatter its top-k logits into a dense [C, s, s] map (other classes 0), cut out the crop
window the loader took (roi_align, bilinear, sub-cell exact) at the model's token grid S x S and at 1 x 1 for
the whole crop, mirror the token map if the image was flipped, softmax over classes, label smoothing.
A sample whose RandAugment drew a geometric op (its `affine` is not the identity) has its window cut out
`SUPERSAMPLING` times finer, mirrored, warped by that affine (grid_sample; what moved in from outside the crop
takes the label at the crop's nearest edge) and averaged down to S x S and to 1 x 1: the targets follow the
pixels.
The reference passed the window to roi_align as (top, left, bottom, right), i.e. with x and y swapped for
any non-square crop; here boxes are built as roi_align expects them, (x1, y1, x2, y2).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torchvision.ops import roi_align

# Each token's target averages SUPERSAMPLING x SUPERSAMPLING points of the warped map: 2 is what roi_align's
# adaptive sampling takes for a crop of twice as many map cells as tokens, and costs 4x the token targets' memory
# (ImageNet, 1000 classes, 14 x 14 tokens: 3 MB a moved sample).
SUPERSAMPLING = 2


class TokenTargets(NamedTuple):
    cls: torch.Tensor     # [B, C]: the teacher's distribution over the whole crop
    tokens: torch.Tensor  # [B, S*S, C]: one distribution per token, row-major like the model's aux tokens


def dense_maps(logits: torch.Tensor, classes: torch.Tensor, num_classes: int) -> torch.Tensor:
    """[B, k, s, s] top-k logits and class indices -> [B, C, s, s] maps, 0 for the classes not in the top k."""
    batch, _, grid, _ = logits.shape
    maps = logits.new_zeros(batch, num_classes, grid, grid)
    return maps.scatter_(1, classes, logits)


def window_boxes(window: torch.Tensor, grid: int) -> torch.Tensor:
    """[B, 4] windows (top/H, left/W, height/H, width/W) -> roi_align's [B, 5] (batch index, x1, y1, x2, y2)
    in the map's cell units."""
    top, left, height, width = (window.to(torch.float32) * grid).unbind(dim=1)
    batch_index = torch.arange(len(window), device=window.device, dtype=torch.float32)
    return torch.stack([batch_index, left, top, left + width, top + height], dim=1)


def token_targets(
    logits: torch.Tensor,
    classes: torch.Tensor,
    window: torch.Tensor,
    flip: torch.Tensor,
    affine: torch.Tensor,
    *,
    num_classes: int,
    token_grid: int,
    smoothing: float,
) -> TokenTargets:
    maps = dense_maps(logits.float(), classes, num_classes)
    boxes = window_boxes(window, maps.shape[-1])
    # aligned=True: cell centres at +0.5, so a window over the whole image samples the whole map evenly;
    # the default adaptive sampling takes at least one bilinear sample per cell the window covers.
    tokens = roi_align(maps, boxes, output_size=token_grid, aligned=True)
    tokens = torch.where(flip.view(-1, 1, 1, 1), tokens.flip(-1), tokens)
    crop = roi_align(maps, boxes, output_size=1, aligned=True).flatten(1)
    moved = (affine != affine.new_tensor([[1, 0, 0], [0, 1, 0]])).flatten(1).any(dim=1)
    if moved.any():
        fine = roi_align(maps, boxes[moved], output_size=token_grid * SUPERSAMPLING, aligned=True)
        fine = torch.where(flip[moved].view(-1, 1, 1, 1), fine.flip(-1), fine)
        fine = warped(fine, affine[moved])
        tokens[moved] = F.avg_pool2d(fine, SUPERSAMPLING)
        crop[moved] = fine.mean(dim=(-2, -1))
    tokens = tokens.flatten(2).transpose(1, 2)  # [B, C, S, S] -> [B, S*S, C], row-major
    return TokenTargets(smooth(crop.softmax(-1), smoothing), smooth(tokens.softmax(-1), smoothing))


def warped(maps: torch.Tensor, affine: torch.Tensor) -> torch.Tensor:
    """maps [B, C, H, W] resampled at affine(x, y) for each output point (x, y), both in [0, 1] coordinates
    over the map (the loader's convention); grid_sample wants [-1, 1] ones: x' = 2x - 1 on both sides."""
    linear, shift = affine[:, :, :2].float(), affine[:, :, 2:].float()
    theta = torch.cat([linear, 2 * shift + linear.sum(dim=2, keepdim=True) - 1], dim=2)
    grid = F.affine_grid(theta, list(maps.shape), align_corners=False)
    return F.grid_sample(maps, grid, mode="bilinear", padding_mode="border", align_corners=False)


def smooth(probabilities: torch.Tensor, smoothing: float) -> torch.Tensor:
    return probabilities * (1 - smoothing) + smoothing / probabilities.shape[-1]
