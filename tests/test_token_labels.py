"""Token labeling: the label store, the per-batch targets (window, flip, x/y order, smoothing), the loss with
MixToken, a real training run with token labels and MixToken on the digits records, and the guard on real photos:
a real teacher's targets and the students trained on them, against the ground truth and deliberately bad labels."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import pytest
import torch
from conftest import cpu_runtime, make_params, train_val_loaders

from coarse2fine import forward, models
from coarse2fine.config import Params, TeacherWeight
from coarse2fine.data import records
from coarse2fine.data.loaders import with_target_inputs
from coarse2fine.data.transforms import IDENTITY_AFFINE, IMAGE_MEAN, IMAGE_STD
from coarse2fine.errors import UserError
from coarse2fine.labels.store import TokenLabelStore, write_store
from coarse2fine.labels.targets import entropy, moved_rows, token_targets
from coarse2fine.training import losses, train

FULL_WINDOW = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
NO_FLIP = torch.tensor([False])
NO_WARP = IDENTITY_AFFINE[None]


def one_hot_map(cell_classes: list[list[int]], num_classes: int, log_prob: float = 0.0):
    """A [1, 1, s, s] top-1 map: `cell_classes[row][col]`, certain (log-probability 0) in every cell."""
    classes = torch.tensor(cell_classes).view(1, 1, *np.shape(cell_classes))
    return torch.full(classes.shape, log_prob), classes


def targets(
    log_probs, classes, window=FULL_WINDOW, flip=NO_FLIP, affine=NO_WARP, *, num_classes=4, grid=2, smoothing=0.0
):
    return token_targets(
        log_probs, classes, window, flip, affine, num_classes=num_classes, token_grid=grid, smoothing=smoothing
    )


def identity_for(batch: dict) -> torch.Tensor:
    return IDENTITY_AFFINE.expand(len(batch["index"]), 2, 3)


# ------------------------------------------------------------------------------------------------------ store


def test_store_returns_the_rows_of_the_record_indices(tmp_path):
    rng = np.random.default_rng(0)
    log_probs = rng.normal(size=(7, 3, 4, 4)).astype(np.float32)
    classes = rng.integers(0, 1000, size=(7, 3, 4, 4))
    write_store(tmp_path, log_probs, classes, num_classes=1000)
    store = TokenLabelStore(tmp_path, records=7, num_classes=1000)
    got_log_probs, got_classes = store.lookup(torch.tensor([5, 0, 5]))
    # As stored (half the bytes of float32/int64 to copy to the device): integers, not float16, for the classes.
    assert (got_log_probs.dtype, got_classes.dtype) == (torch.float16, torch.int16)
    assert torch.equal(got_classes.long(), torch.from_numpy(classes[[5, 0, 5]]))
    torch.testing.assert_close(got_log_probs.float(), torch.from_numpy(log_probs[[5, 0, 5]]), atol=1e-2, rtol=1e-3)


def test_store_for_other_records_or_classes_is_a_user_error(tmp_path):
    write_store(tmp_path, np.zeros((7, 1, 2, 2)), np.zeros((7, 1, 2, 2)), num_classes=10)
    with pytest.raises(UserError, match=r"7 records .* train split has 8 records"):
        TokenLabelStore(tmp_path, records=8, num_classes=10)
    with pytest.raises(UserError, match="over 10 classes, the data has 5"):
        TokenLabelStore(tmp_path, records=7, num_classes=5)
    with pytest.raises(UserError, match="no token labels .header.json missing.; run the token_labels stage first"):
        TokenLabelStore(tmp_path / "missing", records=7, num_classes=10)


# ---------------------------------------------------------------------------------------------------- targets


def test_whole_image_window_gives_each_token_its_cell_and_the_crop_their_mean():
    log_probs, classes = one_hot_map([[0, 1], [2, 3]], num_classes=4)
    result = targets(log_probs, classes)
    assert result.tokens.shape == (1, 4, 4) and result.cls.shape == (1, 4)
    torch.testing.assert_close(result.tokens[0], torch.eye(4), atol=1e-6, rtol=0)  # row-major tokens
    # The crop averages the four cells' log-probabilities: each class certain in one cell and all but impossible
    # in three, so the four are equally likely (the mean of the cells' logits, as a CNN pools them).
    torch.testing.assert_close(result.cls[0], torch.full((4,), 0.25))


def test_window_is_top_left_height_width_not_x_y_swapped():
    """The top half of a map whose rows differ: every token must come from the top row. With x and y swapped
    (the reference's bug) the window would be the left half, and half the tokens would come from the bottom."""
    log_probs, classes = one_hot_map([[0, 0], [1, 1]], num_classes=2)
    top_half = torch.tensor([[0.0, 0.0, 0.5, 1.0]])
    result = targets(log_probs, classes, top_half, num_classes=2)
    assert result.tokens[0].argmax(-1).tolist() == [0, 0, 0, 0]
    right_half = torch.tensor([[0.0, 0.5, 1.0, 0.5]])
    assert targets(log_probs, classes, right_half, num_classes=2).tokens[0].argmax(-1).tolist() == [0, 0, 1, 1]


def test_flip_mirrors_the_token_targets_not_the_crop_target():
    log_probs, classes = one_hot_map([[0, 1], [0, 1]], num_classes=2)
    plain = targets(log_probs, classes, num_classes=2)
    flipped = targets(log_probs, classes, flip=torch.tensor([True]), num_classes=2)
    assert plain.tokens[0].argmax(-1).tolist() == [0, 1, 0, 1]
    assert flipped.tokens[0].argmax(-1).tolist() == [1, 0, 1, 0]
    torch.testing.assert_close(plain.cls, flipped.cls)


# Output (x, y) -> input (y, 1 - x), in [0, 1] coordinates: the image turned a quarter clockwise.
QUARTER_TURN = torch.tensor([[[0.0, 1.0, 0.0], [-1.0, 0.0, 1.0]]])


def test_an_affine_moves_the_token_targets_with_the_pixels():
    log_probs, classes = one_hot_map([[0, 1], [2, 3]], num_classes=4)
    turned = targets(log_probs, classes, affine=QUARTER_TURN)
    assert turned.tokens[0].argmax(-1).tolist() == [2, 0, 3, 1]
    torch.testing.assert_close(turned.cls, targets(log_probs, classes).cls)  # the same cells, moved
    # After the flip (the loader's affine maps into the flipped crop): the flipped map [[1, 0], [3, 2]], turned.
    flipped = targets(log_probs, classes, flip=torch.tensor([True]), affine=QUARTER_TURN)
    assert flipped.tokens[0].argmax(-1).tolist() == [3, 1, 2, 0]
    # Half a width to the right: the left column takes the crop's left edge (what moved in), the right one the
    # left half of the map.
    shifted = targets(log_probs, classes, affine=torch.tensor([[[1.0, 0.0, -0.5], [0.0, 1.0, 0.0]]]))
    assert shifted.tokens[0].argmax(-1).tolist() == [0, 0, 2, 2]


def test_the_crop_target_is_the_teacher_prediction_for_the_crop_and_keeps_its_confidence():
    """With every class stored, the target over a window is exactly softmax(mean of the window's logits), the
    teacher's own prediction for a CNN's pooled features. With the top 2 of 10 stored, the classes left out share
    what the top 2 leave, so the target stays as confident as the teacher. The reference's construction (raw
    logits, the others 0) makes a teacher with small logits look far less sure of itself."""
    generator = torch.Generator().manual_seed(0)
    # A confident teacher with small logits, as label smoothing leaves them (the photos' resnet10t: about 4 for
    # its top class, -1.5 for the rest): class 3.
    logits = torch.randn(4, 10, 4, 4, generator=generator) * 0.5 - 1.5
    logits[:, 3] += 5.5
    every_class = torch.arange(10).view(1, 10, 1, 1).expand(4, 10, 4, 4)
    window = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.5, 0.5, 0.5], [0.25, 0.25, 0.5, 0.75], [0.5, 0.0, 0.5, 1.0]])
    flip, affine = torch.zeros(4, dtype=torch.bool), IDENTITY_AFFINE.expand(4, 2, 3)
    exact = targets(logits.log_softmax(1), every_class, window, flip, affine, num_classes=10, grid=1).cls
    left, top, width, height = 0, 0, 4, 4  # the whole-image window, in cells
    torch.testing.assert_close(exact[0], logits[0, :, top:top + height, left:left + width].mean(dim=(1, 2)).softmax(0))
    torch.testing.assert_close(exact[1], logits[1, :, 0:2, 2:4].mean(dim=(1, 2)).softmax(0))

    log_probs, classes = logits.log_softmax(1).topk(2, dim=1)
    kept = targets(log_probs, classes, window, flip, affine, num_classes=10, grid=1).cls
    values, _ = logits.topk(2, dim=1)
    zero_filled = torch.zeros_like(logits).scatter_(1, classes, values)
    reference = targets(zero_filled.log_softmax(1), every_class, window, flip, affine, num_classes=10, grid=1).cls
    assert (kept.argmax(-1) == 3).all() and (reference.argmax(-1) == 3).all()
    assert (kept[:, 3] - exact[:, 3]).abs().max() < 0.01 and (entropy(kept) - entropy(exact)).abs().max() < 0.03
    assert (entropy(reference) > 2 * entropy(exact)).all()  # the reference's: far flatter than the teacher


def test_entropy_is_in_nats_and_log_c_for_uniform():
    assert float(entropy(torch.full((5,), 0.2))) == pytest.approx(np.log(5))
    assert float(entropy(torch.tensor([1.0, 0.0]))) == pytest.approx(0.0, abs=1e-6)


def test_a_tiny_warp_gives_the_targets_of_no_warp():
    """The warped path (a finer roi_align, grid_sample, average) agrees with the plain roi_align one where both
    sample the same points: windows of twice as many map cells as tokens (8 x 8 map, 2 x 2 tokens)."""
    generator = torch.Generator().manual_seed(0)
    log_probs = -0.7 - 3 * torch.rand(3, 2, 8, 8, generator=generator)  # two classes' probabilities, sum <= 1
    classes = torch.stack([torch.randperm(5, generator=generator)[:2] for _ in range(3 * 64)]).view(3, 8, 8, 2)
    classes = classes.permute(0, 3, 1, 2).contiguous()
    window = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.5, 0.0, 0.5, 0.5], [0.25, 0.5, 0.5, 0.5]])
    flip = torch.tensor([False, True, False])
    nudged = IDENTITY_AFFINE.repeat(3, 1, 1)
    nudged[:, 0, 2] = 1e-6
    plain, warped = (
        targets(log_probs, classes, window, flip, affine, num_classes=5, grid=2)
        for affine in (IDENTITY_AFFINE.expand(3, 2, 3), nudged)
    )
    torch.testing.assert_close(warped.tokens, plain.tokens, atol=1e-5, rtol=0)
    torch.testing.assert_close(warped.cls, plain.cls, atol=1e-5, rtol=0)


def test_token_grid_finer_than_the_map_interpolates_and_smoothing_keeps_distributions():
    log_probs, classes = one_hot_map([[0, 1], [2, 3]], num_classes=4)
    result = targets(log_probs, classes, grid=4, smoothing=0.1)
    assert result.tokens.shape == (1, 16, 4)
    torch.testing.assert_close(result.tokens.sum(-1), torch.ones(1, 16))
    assert result.tokens.min() >= 0.1 / 4 - 1e-7
    # The corner tokens sit inside one cell each: that cell's class.
    assert result.tokens[0, [0, 3, 12, 15]].argmax(-1).tolist() == [0, 1, 2, 3]


# ----------------------------------------------------------------------------------------------------- losses


@pytest.mark.parametrize("box, lam", [((0, 0, 0, 0), 1.0), ((1, 1, 1, 2), 1.0), ((0, 0, 1, 2), 0.5), ((0, 0, 2, 2), 0.0)])
def test_mix_token_lam_is_the_share_of_own_tokens(box, lam):
    assert losses.mix_token_lam(box, token_grid=2) == lam


def with_store_rows(batch: dict, log_probs: torch.Tensor, classes: torch.Tensor) -> dict:
    """`batch` as the loader gives it with token labels: the rows of in-memory maps (the real store is tested above)."""
    index = batch["index"]
    return {**batch, "token_log_probs": log_probs[index], "token_classes": classes[index],
            "moved": moved_rows(batch["affine"])}


def test_token_label_loss_mixes_the_class_target_by_the_box_area():
    batch_size, classes_count = 2, 3
    generator = torch.Generator().manual_seed(0)
    log_probs = -0.7 - 3 * torch.rand(batch_size, 2, 2, 2, generator=generator)
    classes = torch.stack([torch.randperm(classes_count, generator=generator)[:2] for _ in range(8)])
    classes = classes.view(2, 2, 2, 2).permute(0, 3, 1, 2).contiguous()  # distinct classes per cell
    objective = losses.TokenLabelObjective(3, label_smoothing=0.1, dense_weight=0.5)
    window = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.25, 0.5, 0.5, 0.5]])
    batch = {"index": torch.tensor([0, 1]), "window": window, "flip": torch.tensor([False, True]), "label": torch.tensor([0, 2])}
    batch["affine"] = identity_for(batch)
    cls_logits = torch.randn(batch_size, classes_count, generator=generator)
    aux_logits = torch.randn(batch_size, 4, classes_count, generator=generator)
    mixed = forward.TrainOutput(cls_logits, aux_logits, mix_box=(0, 0, 1, 2))  # half the tokens: lam 0.5

    expected = token_targets(
        log_probs, classes, batch["window"], batch["flip"], batch["affine"], num_classes=3, token_grid=2, smoothing=0.1
    )
    cls_target = 0.5 * expected.cls + 0.5 * expected.cls.flip(0)
    manual = losses.soft_cross_entropy(cls_logits, cls_target) + 0.5 * losses.soft_cross_entropy(
        aux_logits, expected.tokens
    )
    batch = with_store_rows(batch, log_probs, classes)
    torch.testing.assert_close(objective(mixed, batch), manual)
    unmixed = objective(forward.TrainOutput(cls_logits, aux_logits), batch)
    assert not torch.isclose(unmixed, manual)

    # What it taught over both calls, as trained: the mixed class target first, then the unmixed one.
    taught = objective.target_metrics(lambda sums: sums)
    class_targets = torch.cat([cls_target, expected.cls])
    assert taught["target_entropy"] == pytest.approx(float(entropy(class_targets).mean()), rel=1e-5)
    assert taught["token_target_entropy"] == pytest.approx(float(entropy(expected.tokens).mean()), rel=1e-5)
    hits = class_targets.argmax(-1) == batch["label"].repeat(2)
    assert taught["target_top1"] == pytest.approx(100 * float(hits.float().mean()))
    token_hits = expected.tokens.argmax(-1) == batch["label"].view(-1, 1)
    assert taught["token_target_top1"] == pytest.approx(100 * float(token_hits.float().mean()))
    assert objective.target_metrics(lambda sums: sums) == {}  # reset: each epoch reports its own
    assert losses.GroundTruthObjective(0.1).target_metrics(lambda sums: sums) == {}


REFERENCE_WEIGHT = TeacherWeight(agrees=0.5, disagrees=0.9)  # sail-sg/volo's `0.9 - 0.4 * (label == top-1)`


def three_samples_on_a_3x3_grid(seed: int) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of 3 with token labels on a 3 x 3 token grid, its cell maps and the student's logits: with 3 samples
    the flipped partner (2, 1, 0) is not the rolled one (2, 0, 1), and a box of 2 of the 9 tokens gives lam = 7/9,
    not 1 - lam."""
    generator = torch.Generator().manual_seed(seed)
    log_probs = -0.5 - 3 * torch.rand(3, 2, 3, 3, generator=generator)
    classes = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(27)])
    classes = classes.view(3, 3, 3, 2).permute(0, 3, 1, 2).contiguous()  # two distinct classes per cell
    batch = {
        "index": torch.tensor([0, 1, 2]), "label": torch.tensor([1, 3, 0]), "flip": torch.tensor([False, True, False]),
        "window": torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.1, 0.2, 0.6, 0.7], [0.3, 0.0, 0.7, 0.5]]),
    }
    batch["affine"] = identity_for(batch)
    cls_logits = torch.randn(3, 4, generator=generator)
    aux_logits = torch.randn(3, 9, 4, generator=generator)
    return batch, log_probs, classes, cls_logits, aux_logits


MIX_BOX, MIX_LAM = (0, 1, 1, 3), 7 / 9  # rows 0..1, columns 1..3 of a 3 x 3 grid: 2 tokens of 9 taken from the partner


def test_mix_token_mixes_each_class_target_with_its_flipped_partner_by_the_share_of_its_own_tokens():
    batch, log_probs, classes, cls_logits, aux_logits = three_samples_on_a_3x3_grid(seed=3)
    assert losses.mix_token_lam(MIX_BOX, token_grid=3) == pytest.approx(MIX_LAM)
    expected = token_targets(
        log_probs, classes, batch["window"], batch["flip"], batch["affine"], num_classes=4, token_grid=3, smoothing=0.1
    )
    teacher = expected.cls
    # By hand: sample 0 takes sample 2's tokens inside the box, 1 its own (the middle of the flip), 2 sample 0's.
    cls_target = torch.stack([
        MIX_LAM * teacher[0] + (1 - MIX_LAM) * teacher[2],
        teacher[1],
        MIX_LAM * teacher[2] + (1 - MIX_LAM) * teacher[0],
    ])
    manual = losses.soft_cross_entropy(cls_logits, cls_target) + 0.5 * losses.soft_cross_entropy(
        aux_logits, expected.tokens
    )
    objective = losses.TokenLabelObjective(4, label_smoothing=0.1, dense_weight=0.5)
    output = forward.TrainOutput(cls_logits, aux_logits, mix_box=MIX_BOX)
    torch.testing.assert_close(objective(output, with_store_rows(batch, log_probs, classes)), manual)


def test_label_mixing_comes_before_mix_token_as_in_the_reference():
    """sail-sg/volo's TokenLabelGTCrossEntropy mixes the ground truth into each sample's teacher target, then
    MixToken mixes the samples' targets: the partner's part is the partner's label-mixed target."""
    batch, log_probs, classes, cls_logits, aux_logits = three_samples_on_a_3x3_grid(seed=4)
    expected = token_targets(
        log_probs, classes, batch["window"], batch["flip"], batch["affine"], num_classes=4, token_grid=3, smoothing=0.1
    )
    teacher, labels = expected.cls, batch["label"].tolist()
    smoothed = [torch.full((4,), 0.1 / 4) + 0.9 * torch.nn.functional.one_hot(torch.tensor(label), 4) for label in labels]
    weights = [0.5 if int(teacher[i].argmax()) == labels[i] else 0.9 for i in range(3)]  # REFERENCE_WEIGHT
    own = [weights[i] * teacher[i] + (1 - weights[i]) * smoothed[i] for i in range(3)]
    cls_target = torch.stack([
        MIX_LAM * own[0] + (1 - MIX_LAM) * own[2], own[1], MIX_LAM * own[2] + (1 - MIX_LAM) * own[0],
    ])
    manual = losses.soft_cross_entropy(cls_logits, cls_target) + 0.5 * losses.soft_cross_entropy(
        aux_logits, expected.tokens
    )
    objective = losses.TokenLabelObjective(
        4, label_smoothing=0.1, ground_truth_mix=True, teacher_weight=REFERENCE_WEIGHT
    )
    output = forward.TrainOutput(cls_logits, aux_logits, mix_box=MIX_BOX)
    torch.testing.assert_close(objective(output, with_store_rows(batch, log_probs, classes)), manual)




def test_ground_truth_mixing_weights_the_teacher_by_whether_it_agrees_with_the_label():
    teacher = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])
    labels = torch.tensor([0, 2])  # the teacher's top-1 agrees with sample 0 (w = 0.5), not with sample 1
    reference = torch.tensor([[0.5 * 0.7 + 0.5, 0.5 * 0.2, 0.5 * 0.1], [0.9 * 0.1, 0.9 * 0.6, 0.9 * 0.3 + 0.1]])
    torch.testing.assert_close(losses.mix_ground_truth(teacher, labels, 0.0, REFERENCE_WEIGHT), reference)
    # Label smoothing 0.3 over 3 classes turns the one-hot label into (0.8, 0.1, 0.1).
    smoothed = torch.tensor([[0.5 * 0.7 + 0.5 * 0.8, 0.5 * 0.2 + 0.05, 0.5 * 0.1 + 0.05],
                             [0.9 * 0.1 + 0.01, 0.9 * 0.6 + 0.01, 0.9 * 0.3 + 0.08]])
    torch.testing.assert_close(losses.mix_ground_truth(teacher, labels, 0.3, REFERENCE_WEIGHT), smoothed)
    # The default trusts a teacher that contradicts the label least (0.1): the label stays the target's top-1.
    corrected = losses.mix_ground_truth(teacher, labels, 0.0, TeacherWeight())
    torch.testing.assert_close(corrected[1], torch.tensor([0.1 * 0.1, 0.1 * 0.6, 0.1 * 0.3 + 0.9]))
    assert corrected.argmax(-1).tolist() == labels.tolist()
    assert TeacherWeight() == TeacherWeight(agrees=0.5, disagrees=0.1)


def test_the_per_token_mix_weights_each_token_by_its_own_top1():
    tokens = torch.tensor([[[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]], [[0.2, 0.2, 0.6], [0.3, 0.3, 0.4]]])  # [B=2, N=2, C=3]
    labels = torch.tensor([0, 2])
    mixed = losses.mix_ground_truth(tokens, labels.unsqueeze(1), 0.0, TeacherWeight())
    # Sample 0: token 0 agrees (w 0.5), token 1 does not (w 0.1); sample 1: both agree.
    torch.testing.assert_close(mixed[0, 0], 0.5 * tokens[0, 0] + 0.5 * torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(mixed[0, 1], 0.1 * tokens[0, 1] + 0.9 * torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(mixed[1], 0.5 * tokens[1] + 0.5 * torch.tensor([0.0, 0.0, 1.0]))


@pytest.mark.parametrize("ground_truth_tokens", [False, True])
def test_the_objective_mixes_the_ground_truth_into_the_targets_it_is_asked_to(ground_truth_tokens: bool):
    generator = torch.Generator().manual_seed(1)
    log_probs = torch.randn(2, 2, 2, 2, generator=generator)
    classes = torch.tensor([[0, 1], [2, 0]]).expand(2, 2, 2, 2).permute(0, 1, 3, 2).contiguous() % 3
    classes[:, 1] = (classes[:, 0] + 1) % 3  # two distinct classes per cell
    batch = {
        "index": torch.tensor([0, 1]), "label": torch.tensor([2, 1]),
        "window": torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.25, 1.0, 0.5]]), "flip": torch.tensor([False, False]),
    }
    batch["affine"] = identity_for(batch)
    output = forward.TrainOutput(torch.randn(2, 3, generator=generator), torch.randn(2, 4, 3, generator=generator))
    expected = token_targets(
        log_probs, classes, batch["window"], batch["flip"], batch["affine"], num_classes=3, token_grid=2, smoothing=0.1
    )
    weight = TeacherWeight(agrees=0.6, disagrees=0.2)
    tokens = expected.tokens
    if ground_truth_tokens:
        tokens = losses.mix_ground_truth(tokens, batch["label"].unsqueeze(1), 0.1, weight)
        assert not torch.allclose(tokens, expected.tokens)
    manual = losses.soft_cross_entropy(
        output.cls_logits, losses.mix_ground_truth(expected.cls, batch["label"], 0.1, weight)
    ) + 0.5 * losses.soft_cross_entropy(output.aux_logits, tokens)
    objective = losses.TokenLabelObjective(
        3, label_smoothing=0.1, ground_truth_mix=True, teacher_weight=weight, ground_truth_tokens=ground_truth_tokens
    )
    torch.testing.assert_close(objective(output, with_store_rows(batch, log_probs, classes)), manual)


def test_the_token_label_loss_reads_no_tensor_value_so_a_gpu_step_never_waits(monkeypatch):
    """Tensors on the meta device have shapes and no values: a host read of one (`.item()`, `if t.any()`, a boolean
    mask's data-dependent shape, a `.cpu()` store lookup) raises there, as it would stall a GPU step. The loss with
    ground-truth mixing, MixToken and warped samples runs through, its inputs as the loader gives them."""
    batch_size, classes_count, top_k, grid = 4, 10, 3, 4
    meta = torch.device("meta")
    affine = IDENTITY_AFFINE.expand(batch_size, 2, 3).clone()
    affine[1, 0, 1] = affine[3, 1, 2] = 0.2  # sheared, translated
    batch = {
        "label": torch.arange(batch_size), "index": torch.arange(batch_size), "window": torch.rand(batch_size, 4),
        "flip": torch.tensor([False, True, False, True]), "affine": affine,
        "token_log_probs": torch.zeros(batch_size, top_k, grid, grid, dtype=torch.float16),
        "token_classes": torch.zeros(batch_size, top_k, grid, grid, dtype=torch.int16),
        "moved": moved_rows(affine),
    }
    output = forward.TrainOutput(
        torch.randn(batch_size, classes_count, device=meta), torch.randn(batch_size, 4, classes_count, device=meta),
        mix_box=(0, 0, 1, 2),
    )
    objective = losses.TokenLabelObjective(
        classes_count, label_smoothing=0.1, ground_truth_mix=True, ground_truth_tokens=True
    )
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # none for meta
    loss = objective(output, {key: value.to(meta) for key, value in batch.items()})
    assert loss.device == meta and loss.shape == ()


def test_training_on_token_labels_teaches_each_token_the_class_under_it_in_the_crop(tmp_path):
    """Real updates of the Trainer on one batch, with a teacher map of one class per cell: every token of the
    model must come to predict the teacher's class at that token of the crop window, mirrored for a flipped
    crop. Only the dense term trains the model's (row-major) token logits; the crop term sees none of this."""
    classes = torch.tensor([[0, 1], [2, 3]]).expand(4, 1, 2, 2)
    write_store(tmp_path / "labels", torch.zeros(classes.shape).numpy(), classes.numpy(), num_classes=4)  # certain
    store = TokenLabelStore(tmp_path / "labels", records=4, num_classes=4)
    windows_and_tokens = [  # (top, left, height, width) and flip -> the classes of the 2x2 tokens, row-major
        ([0.0, 0.0, 1.0, 1.0], False, [0, 1, 2, 3]),
        ([0.0, 0.0, 1.0, 1.0], True, [1, 0, 3, 2]),
        ([0.0, 0.0, 0.5, 1.0], False, [0, 1, 0, 1]),  # the top half
        ([0.0, 0.5, 1.0, 0.5], False, [1, 1, 3, 3]),  # the right half
    ]
    windows, flips, expected = zip(*windows_and_tokens)
    batch = {
        "image": torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0)),
        "index": torch.arange(4), "window": torch.tensor(windows), "flip": torch.tensor(flips), "label": torch.arange(4),
    }
    batch["affine"] = identity_for(batch)
    batch = with_target_inputs(batch, store)
    updates = 10
    # One batch per epoch, so `updates` epochs schedule `updates` updates; lr 0.256 x 4 / 1024 = 1e-3.
    params = make_params(pretrain={
        "epochs": updates, "batch_size": 4, "schedule": {"warmup_epochs": 0}, "optimizer": {"lr_base": 0.256},
    })
    torch.manual_seed(0)
    trainer = train.Trainer(
        stage="pretrain", params=params, cfg=params.pretrain, model=models.build_model(params.model, 4, 32),
        classes=list("abcd"), train_loader=[batch], val_loader=[batch], runtime=cpu_runtime(),
        param_sections=("pretrain",), provenance={}, paths=train.StagePaths.under(tmp_path),
        objective=losses.TokenLabelObjective(4, label_smoothing=params.pretrain.token_label.label_smoothing),
    )
    for _ in range(updates):
        trainer.backward(batch, micro_steps=1, sync=True)
        trainer.optimizer_step()
    with torch.no_grad():
        assert trainer.train_forward(batch["image"]).aux_logits.argmax(-1).tolist() == list(map(list, expected))


def test_the_training_forward_mixes_tokens_only_when_the_model_is_built_with_mix_token():
    params = make_params()
    torch.manual_seed(0)

    def boxes(mix_token: bool) -> list[tuple[int, int, int, int]]:
        train_forward = forward.TrainForward(models.build_model(params.model, 10, 64, mix_token=mix_token).train())
        return [train_forward(torch.randn(4, 3, 64, 64)).mix_box for _ in range(8)]

    mixed = boxes(mix_token=True)
    assert any(losses.mix_token_lam(box, token_grid=4) < 1 for box in mixed)
    assert all(0 <= edge <= 4 for box in mixed for edge in box)
    assert boxes(mix_token=False) == [(0, 0, 0, 0)] * 8


# -------------------------------------------------------------------------------------------- a real training


@pytest.mark.slow
def test_trainer_learns_digits_from_token_labels_with_mix_token(digits_records, tmp_path):
    """A 'teacher' that knows each train image's class (probability 0.9 for it in every cell, 0.08 for the next
    class): training only on those token labels, with MixToken on, must learn the digits, in the class logits and
    in every token's."""
    examples = [
        example for shard, _ in records.shard_files(digits_records, "train") for example in records.read_shard(shard)
    ]
    labels = np.array([example["label"] for example in examples])[np.argsort([ex["index"] for ex in examples])]
    grid = 2
    top_classes = np.stack([labels, (labels + 1) % 10], axis=1)[:, :, None, None].repeat(grid, 2).repeat(grid, 3)
    top_log_probs = np.broadcast_to(np.log([0.9, 0.08])[None, :, None, None], top_classes.shape)
    write_store(tmp_path / "labels", top_log_probs, top_classes, num_classes=10)
    store = TokenLabelStore(tmp_path / "labels", records=len(labels), num_classes=10)

    params = make_params(pretrain={"epochs": 10, "batch_size": 32, "optimizer": {"lr_base": 3.2e-2}})
    runtime = cpu_runtime()
    loaders = train_val_loaders(digits_records, params, runtime, batch_size=32, token_labels=store)
    train.seed_everything(params.seed, runtime)
    model = models.build_model(params.model, 10, 32, mix_token=True)
    metrics = train.Trainer(
        stage="pretrain", params=params, cfg=params.pretrain, model=model, classes=records.read_classes(digits_records),
        train_loader=loaders[0], val_loader=loaders[1], runtime=runtime, param_sections=("pretrain",),
        provenance={"data_digest": "digits"}, paths=train.StagePaths.under(tmp_path),
        objective=losses.TokenLabelObjective(10, label_smoothing=params.pretrain.token_label.label_smoothing),
    ).fit()
    # Measured 86 % (20 epochs reach 96 %). Chance is 10 %.
    assert metrics["val_top1"] >= 80
    # Only the dense term trains the token logits: measured 82 % of the val tokens predict their teacher class;
    # 3 % without the dense term, whose run still passes the top-1 check above (82 %).
    model.eval()
    with torch.inference_mode():
        token_hits = torch.cat([
            model.aux_head(model.forward_features(batch["image"])[:, 1:]).argmax(-1) == batch["label"][:, None]
            for batch in loaders[1]
        ])
    assert token_hits.float().mean() >= 0.5


# ------------------------------------------------------------------------------------ guard, on real photos

PHOTO_RECORDS = {"source": "photos", "photos": {"size": 32, "train_per_class": 24, "val_per_class": 8}, "convert_workers": 1}
PHOTO_CLASSES = 18
PHOTO_TOP_K = 3  # few of 18 classes kept: where the reference's zero fill flattens the targets most
# Flat targets as the students had them (their loss stayed near 3 nats, a uniform target's 2.9 for 18
# classes): the teacher's logits divided by 4 give class targets of 2.7 nats.
FLATTENING = 4.0


class PhotoTeacher(NamedTuple):
    records_dir: Path
    params: Params
    teacher: torch.nn.Module
    head: Callable
    top1: float
    # "store" (ours), "reference" (its zero fill), "flattened" (ours, the logits / FLATTENING), "shifted" (ours, one
    # record off)
    stores: dict[str, Path]


def train_photo_teacher(
    records_dir: Path, root: Path, epochs: int
) -> tuple[Params, torch.nn.Module, Callable, float, dict]:
    """The default resnet10t trained `epochs` epochs on the photo records at 32 px, and its real store at root/store:
    params, teacher, its dense head, val top-1 and the store's metrics (dense_top1: its dense top-1 on its own
    training images)."""
    from coarse2fine.labels.generate import View, dense_head, generate

    params = make_params(
        data=PHOTO_RECORDS, loader={"workers": 1},
        teacher={"epochs": epochs, "batch_size": 32, "optimizer": {"lr_base": 0.16}},
    )
    runtime = cpu_runtime()
    loaders = train_val_loaders(records_dir, params, runtime, batch_size=32)
    train.seed_everything(0, runtime)
    teacher = models.build_model(params.teacher.model, PHOTO_CLASSES, 32)
    top1 = train.Trainer(
        stage="teacher", params=params, cfg=params.teacher, model=teacher, classes=records.read_classes(records_dir),
        model_cfg=params.teacher.model, train_loader=loaders[0], val_loader=loaders[1], runtime=runtime,
        param_sections=("teacher",), provenance={},
        paths=train.StagePaths(root / "ckpt", root / "teacher.pt", root / "metrics"),
    ).fit()["val_top1"]
    teacher.eval()
    head = dense_head(teacher)
    generation = generate(
        head, records_dir, out_dir=root / "store", work_dir=root / "labels_partial",
        view=View("whole", 32, "bicubic"), top_k=PHOTO_TOP_K, batch_size=64, workers=0, runtime=runtime,
        autocast_dtype=None, inputs={}, header={},
    )
    return params, teacher, head, top1, generation.metrics()


def photo_student_top1(records_dir: Path, store: Path | None, token_label: dict, run_dir: Path) -> float:
    """The tiny VOLO pre-trained 16 epochs at 32 px on the photo records: on the ground truth (`store` None) or on
    token labels from `store` with `token_label` (pretrain.token_label settings); its val top-1."""
    train_count = records.read_manifest(records_dir)["splits"]["train"]["images"]
    runtime = cpu_runtime()
    params = make_params(data=PHOTO_RECORDS, loader={"workers": 1}, pretrain={
        "img_size": 32, "epochs": 16, "batch_size": 32, "token_label": {"enabled": store is not None, **token_label},
    })
    labels = None if store is None else TokenLabelStore(store, records=train_count, num_classes=PHOTO_CLASSES)
    loaders = train_val_loaders(records_dir, params, runtime, batch_size=32, token_labels=labels)
    train.seed_everything(params.seed, runtime)
    model = models.build_model(params.model, PHOTO_CLASSES, 32)
    return train.Trainer(
        stage="pretrain", params=params, cfg=params.pretrain, model=model,
        classes=records.read_classes(records_dir), train_loader=loaders[0], val_loader=loaders[1],
        runtime=runtime, param_sections=("pretrain",), provenance={}, paths=train.StagePaths.under(run_dir),
        objective=None if labels is None else losses.TokenLabelObjective.from_params(PHOTO_CLASSES, params.pretrain),
    ).fit()["val_top1"]


@pytest.fixture(scope="module")
def photo_records(tmp_path_factory) -> Path:
    """432 patches of the 18 photographs at 32 px, converted once for the module's photo tests."""
    from coarse2fine.data.convert import convert

    records_dir = tmp_path_factory.mktemp("photos") / "records"
    convert(make_params(data=PHOTO_RECORDS), cpu_runtime(), records_dir)
    return records_dir


@pytest.fixture(scope="module")
def ground_truth_top1(photo_records: Path) -> float:
    """The student trained on the photo records' labels: the yardstick of both student tests below."""
    return photo_student_top1(photo_records, None, {}, photo_records.parent / "student_ground_truth")


@pytest.fixture(scope="module")
def photo_teacher(photo_records: Path, tmp_path_factory) -> PhotoTeacher:
    """A real teacher (the default resnet10t, output stride 8: a 4 x 4 map at 32 px) trained on 432 patches of the
    18 photographs at 32 px, its real store, and three stores made wrong on purpose from the same teacher: the
    reference's construction (its top-k raw logits, every other class a logit of 0, TokenLabeling's
    get_featuremaps), ours from logits flattened by a temperature, and ours given to the wrong records (shifted
    by one)."""
    from coarse2fine.labels.generate import TrainRecords, View

    root, records_dir = tmp_path_factory.mktemp("photo_teacher"), photo_records
    params, teacher, head, top1, _ = train_photo_teacher(records_dir, root, epochs=20)
    stores = {name: root / name for name in ("store", "reference", "flattened", "shifted")}
    whole = TrainRecords(records_dir, View("whole", 32, "bicubic"))
    good = TokenLabelStore(stores["store"], records=len(whole), num_classes=PHOTO_CLASSES)
    write_store(stores["shifted"], np.roll(good.log_probs, 1, axis=0), np.roll(good.classes, 1, axis=0),
                num_classes=PHOTO_CLASSES)
    mean, std = (torch.tensor(value).view(1, 3, 1, 1) * 255 for value in (IMAGE_MEAN, IMAGE_STD))
    with torch.inference_mode():
        logits = torch.cat([
            head((torch.stack([whole[position][0] for position in chunk]).float() - mean) / std)
            for chunk in torch.arange(len(whole)).split(64)
        ])
    order = torch.tensor([whole[position][2] for position in range(len(whole))]).argsort()  # by record index
    values, classes = logits[order].topk(PHOTO_TOP_K, dim=1)
    zero_filled = torch.zeros_like(logits).scatter_(1, classes, values)
    write_store(stores["reference"], zero_filled.log_softmax(1).gather(1, classes).half().numpy(), classes.numpy(),
                num_classes=PHOTO_CLASSES)
    flat = (logits[order] / FLATTENING).log_softmax(1).gather(1, classes)
    write_store(stores["flattened"], flat.half().numpy(), classes.numpy(), num_classes=PHOTO_CLASSES)
    return PhotoTeacher(records_dir, params, teacher, head, top1, stores)


@pytest.mark.slow  # the photo teacher: 20 epochs, about 75 s
def test_on_real_photos_the_targets_keep_the_teachers_confidence_and_flat_or_misaligned_ones_are_caught(photo_teacher):
    """The real store and the real train loader's crops: the class targets the student gets are as sharp as the
    ones all C classes would give and agree with the teacher's own prediction on each crop; the reference's
    construction of the same labels (top-k logits, the others 0) and targets from flattened logits are measurably
    flatter, and labels given to the wrong records (shifted by one) disagree with the ground truth. The same statistics are the stages' metrics
    (target_entropy ...)."""
    from coarse2fine.labels.generate import TrainRecords, View

    records_dir, params, teacher, head = photo_teacher[:4]
    stores = {
        name: TokenLabelStore(path, records=records.read_manifest(records_dir)["splits"]["train"]["images"],
                              num_classes=PHOTO_CLASSES)
        for name, path in photo_teacher.stores.items()
    }
    loaders = train_val_loaders(records_dir, params, cpu_runtime(), batch_size=32)
    whole = TrainRecords(records_dir, View("whole", 32, "bicubic"))
    mean, std = (torch.tensor(value).view(1, 3, 1, 1) * 255 for value in (IMAGE_MEAN, IMAGE_STD))
    every_class = torch.arange(PHOTO_CLASSES).view(1, PHOTO_CLASSES, 1, 1)

    constructions = (*stores, "every class")
    stats = {name: {"entropy": [], "hits": [], "kl": []} for name in constructions}
    with torch.inference_mode():
        for batch in loaders[0]:
            crop = batch["window"], batch["flip"], batch["affine"]
            logits = head((torch.stack([whole[int(i)][0] for i in batch["index"]]).float() - mean) / std)
            on_crop = teacher(batch["image"]).softmax(-1)  # the crop at 32 px: the teacher's own input size

            def class_target(log_probs, classes):
                return token_targets(
                    log_probs, classes, *crop, num_classes=PHOTO_CLASSES, token_grid=4, smoothing=0.0
                ).cls

            targets = {name: class_target(*store.lookup(batch["index"])) for name, store in stores.items()}
            targets["every class"] = class_target(logits.log_softmax(1), every_class.expand_as(logits))
            for name, target in targets.items():
                stats[name]["entropy"].append(entropy(target))
                stats[name]["hits"].append((target.argmax(-1) == batch["label"]).float())
                stats[name]["kl"].append((on_crop * (on_crop.log() - target.log())).sum(-1))
    means = {name: {key: float(torch.cat(values).mean()) for key, values in stat.items()} for name, stat in stats.items()}
    print(f"teacher val top-1 {photo_teacher.top1:.1f} %, {means}")
    assert photo_teacher.top1 >= 60  # a teacher worth learning from (chance is 5.6 %)

    def faithful(name):
        """As sharp as the teacher's map over all 18 classes (top-3 kept) and right on the crops it labels."""
        return abs(means[name]["entropy"] - means["every class"]["entropy"]) < 0.1 and means[name]["hits"] >= 0.85

    assert faithful("store")
    assert not faithful("reference")  # the reference's zero fill: flatter targets
    assert not faithful("flattened")
    assert not faithful("shifted")  # labels given to the wrong records
    assert means["store"]["kl"] < means["reference"]["kl"]  # closer to what the teacher says of the crop itself


@pytest.mark.slow
def test_on_real_photos_a_student_learns_as_well_from_token_labels_as_from_labels_and_not_from_misaligned_ones(
    photo_teacher, ground_truth_top1
):
    """The same student, epochs and data, trained on the ground truth and on token labels: from the good teacher
    they must at least match the ground truth (measured 77.1 vs 72.9 %), given to the wrong records they must not
    (4.2 %). Flatness is guarded by the targets test above, not here: with their order kept, targets flattened to
    2.7 nats trained this student to 75.7 % (AdamW rescales the smaller gradients), and the reference's zero fill to
    74.3 % with a weaker teacher. MixToken is off: it regularises, which pays at the recipe's length (the guide's
    ablation: +5.2 points at 60 + 10 epochs) and costs at 16 epochs (measured -4 to -7 points)."""
    def student_top1(store: str) -> float:
        # The teacher's targets alone (no label mixed in): what the store teaches, which the label would mend.
        return photo_student_top1(photo_teacher.records_dir, photo_teacher.stores[store], {"ground_truth_mix": False},
                                  photo_teacher.stores[store].parent / f"student_{store}")

    top1 = {None: ground_truth_top1, **{store: student_top1(store) for store in ("store", "shifted")}}
    print(f"teacher {photo_teacher.top1:.1f} %, students {top1}")
    # One val image is 0.69 points: "match" allows two images.
    assert top1["store"] >= top1[None] - 1.5
    assert top1["shifted"] <= top1[None] - 30


# A teacher of few epochs: wrong on a share of its own training images like the (6.8 %) or more.
WEAK_TEACHER_EPOCHS = 3
REFERENCE_TARGETS = {"ground_truth_mix": False}  # the reference's pre-training: the teacher's targets alone


@pytest.mark.slow  # a 3-epoch teacher and two 16-epoch students on real photos (and the shared ground-truth one)
def test_a_teacher_wrong_on_its_own_training_images_does_not_cost_the_default_student(
    photo_records, ground_truth_top1, tmp_path
):
    """The guard of the label mix (<student>.token_label.ground_truth_mix with teacher_weight 0.5 / 0.1 and
    ground_truth_tokens, the defaults): from a teacher wrong on a measured share of its training images, the
    reference's targets (the teacher alone) must cost the student (the test's teeth: this teacher does harm) and
    the default targets must not: within two val images of ground truth. MixToken off, as in the test above."""
    *_, teacher_top1, labels = train_photo_teacher(photo_records, tmp_path, epochs=WEAK_TEACHER_EPOCHS)
    store = tmp_path / "store"
    top1 = {
        "ground truth": ground_truth_top1,
        "reference": photo_student_top1(photo_records, store, REFERENCE_TARGETS, tmp_path / "reference"),
        "default": photo_student_top1(photo_records, store, {}, tmp_path / "default"),
    }
    print(f"teacher val {teacher_top1:.1f} %, dense top-1 on its train images {labels['dense_top1']:.2f} %, "
          f"cells {labels['cell_top1']:.2f} %; students {top1}")
    assert labels["dense_top1"] <= 93  # wrong on at least 7 % of its own training images
    assert top1["reference"] <= top1["ground truth"] - 5
    assert top1["default"] >= top1["ground truth"] - 1.5  # one val image is 0.69 points
