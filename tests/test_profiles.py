"""Every profile in profiles/ is a complete, valid params file whose model, optimizer, schedule and objective
build and take one real optimizer step (at a reduced resolution, batch and class count), so none can rot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ListLoader, cpu_runtime

from coarse2fine import models
from coarse2fine.config import TeacherWeight, TokenLabel, flatten, load_params
from coarse2fine.data.loaders import with_target_inputs
from coarse2fine.labels import store
from coarse2fine.training import losses, train

PROFILES = sorted((Path(__file__).resolve().parents[1] / "profiles").glob("*.yaml"))
CLASSES = 10
BATCH = 2
# Reduced sizes with the profile's ratio of fine to coarse resolution, multiples of VOLO's and ViT's stride 16.
REDUCED_SIZE = {224: 32, 384: 48, 448: 64, 512: 80}


def test_there_are_profiles_for_the_published_recipes():
    assert {path.stem for path in PROFILES} >= {
        "volo_d1", "volo_d2", "volo_d3", "volo_d4", "volo_d5", "volo_d5_512", "vit_b16_colossalai",
        "volo_d1_384_from_224",
    }


def spelled_out(raw: dict, prefix: str = "") -> set[str]:
    """The key paths a YAML mapping writes."""
    keys = set()
    for key, value in raw.items():
        keys |= spelled_out(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return keys


@pytest.mark.parametrize("path", PROFILES, ids=lambda path: path.stem)
def test_profile_is_complete_and_valid(path):
    params = load_params(path)
    # Every knob that applies to the profile's models is written out (and no other: the schema refuses those).
    assert spelled_out(yaml.safe_load(path.read_text())) == set(flatten(params))
    assert params.data.source == "imagefolder" and not Path(params.data.root).is_absolute()
    assert path.read_text().startswith("# ") and "Assumes:" in path.read_text() and "Sources:" in path.read_text()


@dataclass(frozen=True)
class Stage:
    """A training stage's effective values, as the reference runs it."""

    global_batch: int
    peak_lr: float
    min_lr: float
    warmup_epochs: float
    total_epochs: int  # with the cooldown at min_lr
    eval_crop_pct: float


@dataclass(frozen=True)
class Recipe:
    gpus: int
    pretrain: Stage
    finetune: Stage
    drop_path: float
    dropout: float
    label_smoothing: float


# sail-sg/volo at 6883c87: README's commands (8 GPUs, -b, --lr, --drop-path; fine-tuning --lr 8.0e-6 --min-lr 4.0e-6
# --epochs 30 --warmup-epochs 5) and main.py's defaults (--epochs 300, --cooldown-epochs 10, --warmup-epochs 20,
# --min-lr 1e-5, --smoothing 0.1). Eval crops: timm's pretrained configs (volo_dN_224 0.96; d1/d2_384, d3_448 1.0;
# d4_448, d5_448, d5_512 1.15).
VOLO_FINETUNE_LR, VOLO_FINETUNE_MIN_LR = 8e-6, 4e-6
REFERENCE = {
    # README: "-b 128 --lr 1.6e-3 --drop-path 0.1" (310 epochs); "-b 64 --lr 8.0e-6" at 384 ("40 epoch").
    "volo_d1": Recipe(8, Stage(1024, 1.6e-3, 1e-5, 20, 310, 0.96), Stage(512, 8e-6, 4e-6, 5, 40, 1.0), 0.1, 0.0, 0.1),
    # README: the fine-tuning command alone, "--finetune" from the published d1_224_84.2.pth.tar (pretrain imports it;
    # its training values stay D1's).
    "volo_d1_384_from_224": Recipe(
        8, Stage(1024, 1.6e-3, 1e-5, 20, 310, 0.96), Stage(512, 8e-6, 4e-6, 5, 40, 1.0), 0.1, 0.0, 0.1
    ),
    # README: "-b 128 --lr 1.0e-3 --drop-path 0.2"; "-b 48" at 384.
    "volo_d2": Recipe(8, Stage(1024, 1e-3, 1e-5, 20, 310, 0.96), Stage(384, 8e-6, 4e-6, 5, 40, 1.0), 0.2, 0.0, 0.1),
    # README: "-b 128 --lr 1.0e-3 --drop-path 0.5"; "-b 30" at 448.
    "volo_d3": Recipe(8, Stage(1024, 1e-3, 1e-5, 20, 310, 0.96), Stage(240, 8e-6, 4e-6, 5, 40, 1.0), 0.5, 0.0, 0.1),
    # The VOLO paper's Table 2 / NVIDIA's write-up: LR_base 1e-3 at batch 1024, drop-path 0.5; fine-tuning batch: no
    # source (D3's, named in the profile's header).
    "volo_d4": Recipe(8, Stage(1024, 1e-3, 1e-5, 20, 310, 0.96), Stage(240, 8e-6, 4e-6, 5, 40, 1.15), 0.5, 0.0, 0.1),
    # The VOLO paper / NVIDIA's write-up: "LRbase=8.0e-4", drop-path 0.75; fine-tuning batch: no source (D3's).
    "volo_d5": Recipe(8, Stage(1024, 8e-4, 1e-5, 20, 310, 0.96), Stage(240, 8e-6, 4e-6, 5, 40, 1.15), 0.75, 0.0, 0.1),
    # NVIDIA's write-up's 512 fine-tuning: "-b 4 --lr 2.3e-5 --epochs 30 --warmup-epochs 5" on 8 GPUs (min LR and
    # cooldown: main.py's defaults as the write-up runs sail-sg's code; its --drop-path 0.5 is a named deviation).
    "volo_d5_512": Recipe(
        8, Stage(1024, 8e-4, 1e-5, 20, 310, 0.96), Stage(32, 2.3e-5, 4e-6, 5, 40, 1.15), 0.75, 0.0, 0.1
    ),
    # hpcaitech/ColossalAI examples/vit_b16_imagenet_data_parallel at 0b22e54: 256 per GPU x 32 accumulated x 4 GPUs
    # (the write-up's 32K), LAMB lr 1.8e-2, LinearWarmupLR(warmup_steps=50, total_steps=300): linear to 0, no
    # cooldown; vit_base_patch16_224(drop_rate=0.1); CrossEntropyLoss without smoothing; validation 256 -> 224.
    # Its fine-tuning has no source: this project's addition at 384 (not pinned to a reference).
    "vit_b16_colossalai": Recipe(
        4, Stage(32768, 1.8e-2, 0.0, 50, 300, 0.875), Stage(256, 1e-4, 1e-6, 2, 20, 1.0), 0.0, 0.1, 0.0
    ),
}


def effective(params, name: str) -> Stage:
    cfg = getattr(params, name)
    global_batch = cfg.global_batch(params.launch.nproc_per_node)
    crop = getattr(params.evaluate, name).crop_pct
    assert cfg.val_crop_pct == crop  # the stage's own validation sees what evaluate reports
    return Stage(
        global_batch, cfg.optimizer.peak_lr(global_batch), cfg.schedule.min_lr, cfg.schedule.warmup_epochs,
        cfg.total_epochs, crop,
    )


def test_every_profile_has_its_reference():
    assert {path.stem for path in PROFILES} == set(REFERENCE)


@pytest.mark.parametrize("path", PROFILES, ids=lambda path: path.stem)
def test_profile_reproduces_the_reference_recipe(path):
    params, reference = load_params(path), REFERENCE[path.stem]
    assert params.launch.nproc_per_node == reference.gpus
    for name in ("pretrain", "finetune"):
        ours = effective(params, name)
        assert ours == pytest.approx(reference_stage := getattr(reference, name)), f"{name}: {ours} vs {reference_stage}"
        cfg = getattr(params, name)
        assert cfg.label_smoothing == cfg.token_label.label_smoothing == reference.label_smoothing
        if cfg.token_label.enabled:  # the reference's targets: the teacher's alone in pre-training, then its mix
            # (sail-sg/volo: TokenLabelCrossEntropy; fine-tuning TokenLabelGTCrossEntropy, `0.9 - 0.4 * agrees`)
            assert cfg.token_label.ground_truth_mix == (name == "finetune")
            assert cfg.token_label.teacher_weight == TeacherWeight(agrees=0.5, disagrees=0.9)
            assert not cfg.token_label.ground_truth_tokens
    assert params.model.drop_path == reference.drop_path
    assert getattr(params.model, "dropout", 0.0) == reference.dropout


def test_the_fine_tune_only_profile_is_volo_d1_from_the_published_224_model():
    """Only the pre-trained student differs from volo_d1: imported from sail-sg/volo's release file at its 224 px."""
    directory = PROFILES[0].parent
    ours, full = (flatten(load_params(directory / f"{name}.yaml")) for name in ("volo_d1_384_from_224", "volo_d1"))
    assert {key for key in full if ours[key] != full[key]} == {"pretrain.mode", "pretrain.weights"}
    assert (ours["pretrain.mode"], ours["pretrain.weights"]) == ("import", "models/imports/d1_224_84.2.pth.tar")
    assert (ours["model.name"], ours["pretrain.img_size"], ours["finetune.img_size"]) == ("volo_d1_224", 224, 384)
    header = (directory / "volo_d1_384_from_224.yaml").read_text()
    assert "sail-sg/volo/releases/download/volo_1/d1_224_84.2.pth.tar" in header  # where the file comes from


def test_volo_fine_tuning_lr_does_not_scale_with_the_batch():
    """The reference fine-tunes every VOLO at 8e-6 whatever its batch (512, 384, 240): scaled by global/1024 from
    one lr_base, D3's would be 3.75e-6, below min_lr 4e-6."""
    for name in ("volo_d1", "volo_d2", "volo_d3", "volo_d4", "volo_d5"):
        stage = effective(load_params(PROFILES[0].parent / f"{name}.yaml"), "finetune")
        assert (stage.peak_lr, stage.min_lr) == (VOLO_FINETUNE_LR, VOLO_FINETUNE_MIN_LR)


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
    full = getattr(params, stage)
    # The profile's own peak LR (at its global batch) for the reduced batch, so the schedule's check still holds.
    peak_lr = full.optimizer.peak_lr(full.global_batch(params.launch.nproc_per_node))
    optimizer = full.optimizer.model_copy(update={"lr_base": peak_lr, "lr_scaling": "none"})
    # Eager: the VOLO profiles compile their training forward, minutes per big model on a CPU; test_gpu_defaults.py
    # tests the compiled step.
    cfg = full.model_copy(update={"img_size": img_size, "batch_size": BATCH, "optimizer": optimizer, "compile": False})
    objective, labels = None, None
    if cfg.token_label.enabled:  # a store of random teacher scores, as the token_labels stage writes one
        top_k, grid = params.token_labels.top_k, 2
        scores = torch.randn(BATCH, CLASSES, grid, grid).log_softmax(dim=1)
        log_probs, classes = (part.numpy() for part in scores.topk(top_k, dim=1))
        store.write_store(tmp_path / stage, log_probs.astype("float16"), classes, CLASSES)
        labels = store.TokenLabelStore(tmp_path / stage, records=BATCH, num_classes=CLASSES)
        objective = losses.TokenLabelObjective.from_params(CLASSES, cfg)
    loader = ListLoader([with_target_inputs(synthetic_batch(img_size), labels)])
    trainer = train.Trainer(
        stage=stage, params=params, cfg=cfg, model=model, classes=[str(c) for c in range(CLASSES)],
        train_loader=loader, val_loader=loader, runtime=cpu_runtime(), param_sections=("model", stage), provenance={},
        paths=train.StagePaths.under(tmp_path),
        objective=objective,
    )
    assert type(trainer.optimizer).__name__.lower() == cfg.optimizer.name
    assert trainer.scaler.is_enabled() == (cfg.precision == "fp16")
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("path", PROFILES, ids=lambda path: path.stem)
def test_profile_takes_one_real_optimizer_step(path, tmp_path):
    """Both training sections are built; the step is the fine-tuning one (the larger grid, ground-truth mixing),
    once per profile: the big VOLOs take seconds to build on a CPU."""
    params = load_params(path)
    img_size = REDUCED_SIZE[params.finetune.img_size]
    model = models.build_model(params.model, CLASSES, img_size, mix_token=params.finetune.token_label.mixes_tokens)
    build_trainer(params, "pretrain", model, REDUCED_SIZE[params.pretrain.img_size], tmp_path)
    trainer = build_trainer(params, "finetune", model, img_size, tmp_path)
    (batch,) = trainer.train_loader
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


# sail-sg/volo: main.py's --cls-weight 1.0 and --dense-weight 0.5 (TokenLabelCrossEntropy; TokenLabelGTCrossEntropy
# with --ground-truth), --smoothing 0.1; models/volo.py's VOLO(..., return_dense=True, mix_token=True): every VOLO
# of the reference trains on token labels with MixToken, in pre-training and in fine-tuning.
VOLO_TOKEN_LABEL = {"enabled": True, "cls_weight": 1.0, "dense_weight": 0.5, "mix_token": True,
                    "teacher_weight": {"agrees": 0.5, "disagrees": 0.9}, "ground_truth_tokens": False,
                    "label_smoothing": 0.1}
VOLO_PROFILES = [path for path in PROFILES if path.stem.startswith("volo_")]


@pytest.mark.parametrize("path", VOLO_PROFILES, ids=lambda path: path.stem)
def test_every_token_label_key_of_a_volo_profile_is_the_reference_s(path):
    written = yaml.safe_load(path.read_text(encoding="utf-8"))
    for name in ("pretrain", "finetune"):
        token_label = written[name]["token_label"]
        # Every key the schema has, written out in the profile (nothing left to a default that could change).
        assert set(token_label) == set(TokenLabel.model_fields) == set(VOLO_TOKEN_LABEL) | {"ground_truth_mix"}, name
        assert {key: token_label[key] for key in VOLO_TOKEN_LABEL} == VOLO_TOKEN_LABEL, name
        assert token_label["ground_truth_mix"] == (name == "finetune")


@pytest.mark.parametrize("path", VOLO_PROFILES, ids=lambda path: path.stem)
def test_the_objective_built_from_a_volo_profile_takes_its_weights_not_the_constructor_s(path):
    """TokenLabelObjective's own default teacher weight is the project's (0.5 / 0.1); a profile's 0.5 / 0.9 must reach
    the objective the Trainer gets (losses.TokenLabelObjective.from_params)."""
    params = load_params(path)
    for name in ("pretrain", "finetune"):
        cfg = getattr(params, name)
        objective = losses.TokenLabelObjective.from_params(1000, cfg)
        assert objective.teacher_weight == TeacherWeight(agrees=0.5, disagrees=0.9) != TeacherWeight()
        assert (objective.cls_weight, objective.dense_weight, objective.label_smoothing) == (1.0, 0.5, 0.1)
        assert objective.ground_truth_mix == (name == "finetune") and not objective.ground_truth_tokens


@pytest.mark.parametrize("path", VOLO_PROFILES, ids=lambda path: path.stem)
def test_a_volo_profile_names_its_teacher_view_among_its_deviations(path):
    """The reference generated its labels from a centre crop; the profiles keep `whole`, and say so."""
    header = "".join(line for line in path.read_text(encoding="utf-8").splitlines(keepends=True) if line.startswith("#"))
    assert load_params(path).token_labels.teacher_view == "whole"
    assert "# Deviations:" in header and "teacher_view: whole" in header.split("# Deviations:", 1)[1]


@pytest.mark.parametrize("path", VOLO_PROFILES, ids=lambda path: path.stem)
def test_a_volo_profile_keeps_the_best_epoch_as_the_reference_does(path):
    """sail-sg/volo's main.py saves through timm's CheckpointSaver (decreasing=False on --eval-metric top1): the
    run's model is model_best.pth.tar, and it logs '*** Best metric'. The students keep their best epoch too."""
    params = load_params(path)
    assert (params.pretrain.keep, params.finetune.keep) == ("best", "best")
