"""A training stage assembled, for the teacher, pre-training and fine-tuning alike: the loaders, the seed, the model
(from `init_weights`, or fine-tuning's pre-trained model file, its position embedding resampled), the objective
(the student's token labels from the store, or the ground truth) and the one Trainer; or, with `mode: import`, the
stage's model imported from a weights file and evaluated instead (coarse2fine.training.weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from coarse2fine import checkpoints, config, distributed, models, provenance
from coarse2fine.data import records
from coarse2fine.data.loaders import build_loader, Loader
from coarse2fine.files import file_sha256
from coarse2fine.labels import store
from coarse2fine.mesh import ParallelDims
from coarse2fine.training import losses, train, weights


def train_teacher(
    params: config.Params, paths: train.StagePaths, param_sections: Sequence[str], script: str | Path
) -> None:
    """Train `teacher.model` on the records (from `teacher.init_weights` if given), or import `teacher.weights`."""
    cfg = params.teacher
    _train_stage("teacher", params, cfg, cfg.model, paths, param_sections, script)


def train_student(
    stage: str, params: config.Params, cfg: config.Pretrain, paths: train.StagePaths, param_sections: Sequence[str],
    script: str | Path,
) -> None:
    """Train `params.model` under `cfg` (params.pretrain or params.finetune) and write the stage's outputs; with
    `cfg.mode` import, write them from `cfg.weights` instead."""
    labels, objective = None, None
    if cfg.mode == "train" and cfg.token_label.enabled:
        num_classes = len(records.read_classes(paths.records))
        labels = store.TokenLabelStore(
            paths.token_labels, records=records.read_manifest(paths.records)["splits"]["train"]["images"],
            num_classes=num_classes, records_digest=records.manifest_digest(paths.records),
        )
        objective = losses.TokenLabelObjective.from_params(num_classes, cfg)
    _train_stage(stage, params, cfg, params.model, paths, param_sections, script, labels=labels, objective=objective,
                 mix_token=cfg.token_label.mixes_tokens)


def _train_stage(
    stage: str, params: config.Params, cfg: config.Train, model_cfg: config.Model, paths: train.StagePaths,
    param_sections: Sequence[str], script: str | Path, *, labels: store.TokenLabelStore | None = None,
    objective: losses.TokenLabelObjective | None = None, mix_token: bool = False,
) -> None:
    classes = records.read_classes(paths.records)
    training = cfg.mode == "train"
    # With the params: what the weights depend on. A checkpoint made from other inputs or code is not resumed.
    inputs = {"data_digest": records.manifest_digest(paths.records), **provenance.fingerprint(script)}
    if labels is not None:
        inputs["token_labels_digest"] = store.header_digest(paths.token_labels)
    with distributed.session(params.launch.device) as runtime:
        # The ranks of one tensor or pipeline group train on the same batches, seeded alike (coarse2fine.mesh).
        data_runtime = runtime.data_view(ParallelDims.of_run(params.parallel, runtime.world_size))
        loaders = stage_loaders(params, cfg, paths.records, runtime, data_runtime, labels)
        runtime.announce(stage, cfg.precision, loader=loaders["val"].backend)
        train.seed_everything(params.seed, data_runtime)
        model = models.build_model(model_cfg, num_classes=len(classes), img_size=cfg.img_size, mix_token=mix_token)
        if not training:
            weights.import_model(
                stage, params, cfg, model, model_cfg=model_cfg, classes=classes, records_dir=paths.records,
                val_loader=loaders["val"], runtime=runtime, model_file=paths.model_file, metrics_dir=paths.metrics_dir,
                param_sections=param_sections,
            )
            return
        notes = []
        if cfg.init_weights:  # where training starts, in place of the pre-trained model file
            notes += weights.start_from_weights(stage, cfg, model)
            inputs |= weights.weights_digest(cfg)
        elif paths.init_from is not None:
            notes += checkpoints.init_from_model_file(model, model_cfg, paths.init_from).lines(paths.init_from)
            inputs["init_digest"] = file_sha256(paths.init_from)
        if labels is not None:
            grid = model_cfg.token_grid(cfg.img_size)
            notes.append(
                f"token labels: the teacher's {labels.grid}x{labels.grid} score maps -> {grid}x{grid} token targets"
            )
        if runtime.is_main:
            for note in notes:
                print(f"{stage}: {note}", flush=True)
        train.Trainer(
            stage=stage, params=params, cfg=cfg, model=model, classes=classes, model_cfg=model_cfg,
            train_loader=loaders["train"], val_loader=loaders["val"], runtime=runtime,
            param_sections=param_sections, provenance=inputs, paths=paths, objective=objective,
        ).fit()


def stage_loaders(
    params: config.Params, cfg: config.Train, records_dir: Path, runtime: distributed.Runtime,
    data_runtime: distributed.Runtime, labels: store.TokenLabelStore | None,
) -> dict[str, Loader]:
    """The stage's val loader, and with `cfg.mode` train its train loader (on the data ranks, with the token labels).
    Validation runs at the evaluation batch (`evaluate.batch_size`), not the training one: a forward without
    gradients holds a fraction of a step's memory, and a batch of 4 (VOLO-D5 at 512) would be 1,563 val steps a rank
    an epoch on ImageNet (50,000 / 8 ranks / 4)."""
    splits = {"train": cfg.batch_size} if cfg.mode == "train" else {}
    splits["val"] = params.evaluate.batch_size
    return {
        split: build_loader(
            split, records_dir, img_size=cfg.img_size, batch_size=batch_size,
            runtime=data_runtime if split == "train" else runtime,
            loader_cfg=params.loader, augment_cfg=cfg.train_augment(params.augment), crop_pct=cfg.val_crop_pct,
            seed=params.seed,
            token_labels=labels if split == "train" else None,
        )
        for split, batch_size in splits.items()
    }
