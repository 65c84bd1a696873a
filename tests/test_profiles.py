"""Every profile in profiles/ is a complete, valid params file whose model, optimizer, schedule and objective
build and take one real optimizer step (at a reduced resolution, batch and class count), so none can rot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import cpu_runtime

from coarse2fine import losses, models, train
from coarse2fine.config import flatten, load_params, parse_params
from coarse2fine.labels import store

PROFILES = sorted((Path(__file__).resolve().parents[1] / "profiles").glob("*.yaml"))
CLASSES = 10
BATCH = 2
# Reduced sizes with the profile's ratio of fine to coarse resolution, multiples of VOLO's and ViT's stride 16.
REDUCED_SIZE = {224: 32, 384: 48, 448: 64, 512: 80}


def test_there_are_profiles_for_the_published_recipes():
    assert {path.stem for path in PROFILES} >= {
        "volo_d1", "volo_d2", "volo_d3", "volo_d4", "volo_d5", "volo_d5_512", "vit_b16_colossalai"
    }


@pytest.mark.parametrize("path", PROFILES, ids=lambda path: path.stem)
def test_profile_is_complete_and_valid(path):
    params = load_params(path)
    assert set(flatten(params)) == set(flatten(parse_params({})))  # every knob spelled out
    assert params.data.source == "imagefolder" and not Path(params.data.root).is_absolute()
    assert path.read_text().startswith("# ") and "Assumes:" in path.read_text()


class OneBatch:
    """A loader of one synthetic batch, as the Trainer sees a loader."""

    def __init__(self, batch: dict[str, torch.Tensor]):
        self.batch = batch

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self):
        yield self.batch

    def __len__(self) -> int:
        return 1


def synthetic_batch(img_size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "image": torch.randn(BATCH, 3, img_size, img_size, generator=generator),
        "label": torch.arange(BATCH) % CLASSES,
        "index": torch.arange(BATCH),
        "window": torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.1, 0.2, 0.7, 0.6]]),
        "flip": torch.tensor([False, True]),
        # The second sample as RandAugment's shear leaves it: its token targets take the warped path.
        "affine": torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], [[1.0, 0.2, 0.0], [0.0, 1.0, 0.0]]]),
    }


def build_trainer(params, stage: str, model, img_size: int, tmp_path: Path) -> train.Trainer:
    """The profile's optimizer, schedule and objective for `stage`, as the stage builds them, at a reduced size."""
    cfg = getattr(params, stage).model_copy(update={"img_size": img_size, "batch_size": BATCH})
    objective = None
    if cfg.token_label.enabled:  # a store of random teacher scores, as the token_labels stage writes one
        top_k, grid = params.token_labels.top_k, 2
        scores = torch.randn(BATCH, CLASSES, grid, grid).log_softmax(dim=1)
        log_probs, classes = (part.numpy() for part in scores.topk(top_k, dim=1))
        store.write_store(tmp_path / stage, log_probs.astype("float16"), classes, CLASSES)
        labels = store.TokenLabelStore(tmp_path / stage, records=BATCH, num_classes=CLASSES)
        objective = losses.TokenLabelObjective.from_params(labels, cfg)
    batch = OneBatch(synthetic_batch(img_size))
    trainer = train.Trainer(
        stage=stage, params=params, cfg=cfg, model=model, classes=[str(c) for c in range(CLASSES)],
        train_loader=batch, val_loader=batch, runtime=cpu_runtime(), param_sections=("model", stage), provenance={},
        checkpoint_dir=tmp_path / "ckpt", model_file=tmp_path / "model.pt", metrics_dir=tmp_path / "metrics",
        objective=objective,
    )
    assert type(trainer.optimizer).__name__.lower() == cfg.optimizer.name
    assert trainer.scaler.is_enabled() == (cfg.precision == "fp16")
    return trainer


@pytest.mark.parametrize("path", PROFILES, ids=lambda path: path.stem)
def test_profile_takes_one_real_optimizer_step(path, tmp_path):
    """Both training sections are built; the step is the fine-tuning one (the larger grid, ground-truth mixing),
    once per profile: the big VOLOs take seconds to build on a CPU."""
    params = load_params(path)
    img_size = REDUCED_SIZE[params.finetune.img_size]
    model = models.build_model(params.model, CLASSES, img_size, mix_token=params.finetune.token_label.mixes_tokens)
    build_trainer(params, "pretrain", model, REDUCED_SIZE[params.pretrain.img_size], tmp_path)
    trainer = build_trainer(params, "finetune", model, img_size, tmp_path)
    batch = synthetic_batch(img_size)
    before = {name: value.detach().clone() for name, value in model.named_parameters()}
    # fp16's loss scaler skips the first updates while its scale overflows the gradients (as on a GPU): each
    # skip halves the scale, until one step lands.
    for _ in range(24):
        loss = trainer.backward(batch, micro_steps=1, sync=True)
        assert torch.isfinite(loss)
        trainer.optimizer_step()
        changed = [name for name, value in model.named_parameters() if not torch.equal(before[name], value)]
        if changed:
            break
    assert len(changed) > len(before) // 2, f"only {len(changed)} of {len(before)} tensors moved"
