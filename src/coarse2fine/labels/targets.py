"""Per-batch token-labeling targets, computed on the batch's device from the teacher's top-k score maps.

For each sample: rebuild its dense [C, s, s] map of log-probabilities from the stored top k (`dense_maps`), cut
out the crop window the loader took (roi_align, bilinear, sub-cell exact) at the model's token grid S x S and at
1 x 1 for the whole crop, mirror the token map if the image was flipped, softmax over classes, label smoothing.
Averaging log-probabilities over a window and taking the softmax is exactly the teacher's prediction for that
region when every class is kept (each cell's normaliser is the same for all classes, so it cancels), as for
the average-pooled logits of a CNN.
A sample whose RandAugment drew a geometric op (its `affine` is not the identity) has its window cut out
`SUPERSAMPLING` times finer, mirrored, warped by that affine (grid_sample; what moved in from outside the crop
takes the label at the crop's nearest edge) and averaged down to S x S and to 1 x 1: the targets follow the
pixels.

Two defects of the reference (TokenLabeling's get_featuremaps/get_label) fixed here:
- it stores raw logits and fills the classes outside the top k with a logit of 0, a value the teacher did not
  give them: for a teacher whose logits are small (trained with label smoothing, or on few classes) the
  zero-filled classes take much of the mass, and the targets come out far flatter than the teacher's
  predictions (see bench/token_targets.py). Here the store holds log-probabilities and the classes outside the top
  k share the probability the top k leave, as the teacher gave it;
- it passed the window to roi_align as (top, left, bottom, right), i.e. with x and y swapped for any non-square
  crop; here boxes are built as roi_align expects them, (x1, y1, x2, y2).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torchvision.ops import roi_align

from coarse2fine.data.transforms import is_moved, moved_rows

# Each token's target averages SUPERSAMPLING x SUPERSAMPLING points of the warped map: 2 is what roi_align's
# adaptive sampling takes for a crop of twice as many map cells as tokens, and costs 4x the token targets' memory
# (ImageNet, 1000 classes, 14 x 14 tokens: 3 MB a moved sample).
SUPERSAMPLING = 2
# The least probability a cell gives the classes outside its top k: float16 rounding of near-certain cells can sum
# the top k to 1 or above, and a log(0) would make a class impossible rather than unlikely.
MIN_PROBABILITY = 1e-8


class TokenTargets(NamedTuple):
    cls: torch.Tensor     # [B, C]: the teacher's distribution over the whole crop
    tokens: torch.Tensor  # [B, S*S, C]: one distribution per token, row-major like the model's aux tokens


def dense_maps(log_probs: torch.Tensor, classes: torch.Tensor, num_classes: int) -> torch.Tensor:
    """[B, k, s, s] top-k log-probabilities and class indices -> [B, C, s, s] log-probability maps, in which the
    C - k classes outside the top k share equally what the top k leave of each cell's probability."""
    batch, top_k, grid, _ = log_probs.shape
    left = (1 - log_probs.exp().sum(dim=1, keepdim=True)).clamp_min(MIN_PROBABILITY)  # float16 rounding: >= 0
    fill = (left / max(num_classes - top_k, 1)).log()
    maps = fill.expand(batch, num_classes, grid, grid).contiguous()
    return maps.scatter_(1, classes, log_probs)


def window_boxes(window: torch.Tensor, grid: int) -> torch.Tensor:
    """[B, 4] windows (top/H, left/W, height/H, width/W) -> roi_align's [B, 5] (batch index, x1, y1, x2, y2)
    in the map's cell units."""
    top, left, height, width = (window.to(torch.float32) * grid).unbind(dim=1)
    batch_index = torch.arange(len(window), device=window.device, dtype=torch.float32)
    return torch.stack([batch_index, left, top, left + width, top + height], dim=1)


def moved_among(rows: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
    """A micro-batch's `moved` for token_targets, found without reading the device: `rows` are its row indices in
    the batch, `moved` the batch's. Which of its rows moved is on the device, how many rows it has and the batch moved
    is on the host: its first min(those) rows once the moved ones are sorted first, a superset of them."""
    candidates = min(len(rows), len(moved))
    return torch.isin(rows, moved).to(torch.uint8).argsort(descending=True, stable=True)[:candidates]


def token_targets(
    log_probs: torch.Tensor,
    classes: torch.Tensor,
    window: torch.Tensor,
    flip: torch.Tensor,
    affine: torch.Tensor,
    *,
    num_classes: int,
    token_grid: int,
    smoothing: float,
    moved: torch.Tensor | None = None,
) -> TokenTargets:
    """The class and token targets of a batch's crops. `log_probs`/`classes` [B, k, s, s] as the store keeps them
    (any float and integer types); `moved`: `moved_rows(affine)`, which the training step gets from the loader
    (found here when None: on a GPU that waits for the device), or a superset of it (`moved_among`: the rows in it
    whose affine is the identity keep their unwarped targets). Shapes never depend on tensor values, so nothing
    here synchronises with the GPU."""
    maps = dense_maps(log_probs.float(), classes.long(), num_classes)
    boxes = window_boxes(window, maps.shape[-1])
    # aligned=True: cell centres at +0.5, so a window over the whole image samples the whole map evenly;
    # the default adaptive sampling takes at least one bilinear sample per cell the window covers.
    tokens = roi_align(maps, boxes, output_size=token_grid, aligned=True)
    tokens = torch.where(flip.view(-1, 1, 1, 1), tokens.flip(-1), tokens)
    crop = roi_align(maps, boxes, output_size=1, aligned=True).flatten(1)
    moved = moved_rows(affine) if moved is None else moved.to(maps.device)
    if len(moved):  # the tensor's length is host metadata: no wait for the device
        fine = roi_align(maps, boxes.index_select(0, moved), output_size=token_grid * SUPERSAMPLING, aligned=True)
        fine = torch.where(flip.index_select(0, moved).view(-1, 1, 1, 1), fine.flip(-1), fine)
        fine = warped(fine, affine.index_select(0, moved))
        warp = is_moved(affine.index_select(0, moved))
        pooled = torch.where(warp.view(-1, 1, 1, 1), F.avg_pool2d(fine, SUPERSAMPLING), tokens.index_select(0, moved))
        mean = torch.where(warp.view(-1, 1), fine.mean(dim=(-2, -1)), crop.index_select(0, moved))
        tokens, crop = tokens.index_copy(0, moved, pooled), crop.index_copy(0, moved, mean)
    tokens = tokens.flatten(2).transpose(1, 2)  # [B, C, S, S] -> [B, S*S, C], row-major
    return TokenTargets(smooth(crop.softmax(-1), smoothing), smooth(tokens.softmax(-1), smoothing))


def warped(maps: torch.Tensor, affine: torch.Tensor) -> torch.Tensor:
    """maps [B, C, H, W] resampled at affine(x, y) for each output point (x, y), both in [0, 1] coordinates
    over the map (the loader's convention); grid_sample wants [-1, 1] ones: x' = 2x - 1 on both sides."""
    linear, shift = affine[:, :, :2].float(), affine[:, :, 2:].float()
    theta = torch.cat([linear, 2 * shift + linear.sum(dim=2, keepdim=True) - 1], dim=2)
    grid = F.affine_grid(theta, list(maps.shape), align_corners=False)
    return F.grid_sample(maps, grid, mode="bilinear", padding_mode="border", align_corners=False)


def entropy(probabilities: torch.Tensor) -> torch.Tensor:
    """In nats, over the last dimension (log 2 = 0.69 for an even pair; the log of the class count for uniform)."""
    return -(probabilities * probabilities.clamp_min(MIN_PROBABILITY).log()).sum(dim=-1)


def smooth(probabilities: torch.Tensor, smoothing: float) -> torch.Tensor:
    return probabilities * (1 - smoothing) + smoothing / probabilities.shape[-1]
