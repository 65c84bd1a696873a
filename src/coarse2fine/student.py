"""Training the student, for the pre-training and fine-tuning stages: the objective (token labels from the
store, or the ground truth), the loaders, the model (fine-tuning: started from the pre-trained model file,
its position embedding resampled; either stage: from `init_weights`, if given) and the shared Trainer; or,
with `mode: import`, the stage's model imported from a weights file instead (coarse2fine.weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from coarse2fine import config, distributed, losses, models, provenance, train, weights
from coarse2fine.data import records
from coarse2fine.data.loaders import build_loader
from coarse2fine.files import file_sha256
from coarse2fine.labels import store
from coarse2fine.mesh import ParallelDims


@dataclass(frozen=True)
class StudentPaths:
    records: Path
    token_labels: Path
    checkpoint_dir: Path
    model_file: Path
    metrics_dir: Path
    init_from: Path | None = None  # fine-tuning: the pre-trained model file


def train_student(
    stage: str, params: config.Params, cfg: config.Pretrain, paths: StudentPaths, param_sections: Sequence[str],
    script: str | Path,
) -> None:
    """Train `params.model` under `cfg` (params.pretrain or params.finetune) and write the stage's outputs; with
    `cfg.mode` import, write them from `cfg.weights` instead."""
    classes = records.read_classes(paths.records)
    training = cfg.mode == "train"
    # With the params: what the weights depend on. A checkpoint made from other inputs or code is not resumed.
    data_digest = records.manifest_digest(paths.records)
    inputs = {"data_digest": data_digest, **provenance.fingerprint(script)}
    objective, labels = None, None
    if training and cfg.token_label.enabled:
        labels = store.TokenLabelStore(
            paths.token_labels, records=records.read_manifest(paths.records)["splits"]["train"]["images"],
            num_classes=len(classes), records_digest=data_digest,
        )
        objective = losses.TokenLabelObjective.from_params(len(classes), cfg)
        inputs["token_labels_digest"] = store.header_digest(paths.token_labels)
    with distributed.session(params.launch.device) as runtime:
        # The ranks of one tensor or pipeline group train on the same batches, seeded alike (coarse2fine.mesh).
        data_runtime = runtime.data_view(ParallelDims.of_run(params.parallel, runtime.world_size))
        loaders = {
            split: build_loader(
                split, paths.records, img_size=cfg.img_size, batch_size=cfg.batch_size,
                runtime=data_runtime if split == "train" else runtime,
                loader_cfg=params.loader, augment_cfg=cfg.train_augment(params.augment), crop_pct=cfg.val_crop_pct,
                seed=params.seed,
                token_labels=labels if split == "train" else None,
            )
            for split in (("train", "val") if training else ("val",))
        }
        runtime.announce(stage, cfg.precision, loader=loaders["val"].backend)
        train.seed_everything(params.seed, data_runtime)
        model = models.build_model(
            params.model, num_classes=len(classes), img_size=cfg.img_size, mix_token=cfg.token_label.mixes_tokens
        )
        if not training:
            weights.import_model(
                stage, params, cfg, model, model_cfg=params.model, classes=classes, records_dir=paths.records,
                val_loader=loaders["val"], runtime=runtime, model_file=paths.model_file, metrics_dir=paths.metrics_dir,
                param_sections=param_sections,
            )
            return
        notes = []
        if cfg.init_weights:  # where training starts, in place of the pre-trained model file
            notes += weights.start_from_weights(stage, cfg, model)
            inputs |= weights.weights_digest(cfg)
        elif paths.init_from is not None:
            notes += models.init_from_model_file(model, params.model, paths.init_from).lines(paths.init_from)
            inputs["init_digest"] = file_sha256(paths.init_from)
        if labels is not None:
            grid = params.model.token_grid(cfg.img_size)
            notes.append(f"token labels: the teacher's {labels.grid}x{labels.grid} score maps -> {grid}x{grid} token targets")
        if runtime.is_main:
            for note in notes:
                print(f"{stage}: {note}", flush=True)
        train.Trainer(
            stage=stage, params=params, cfg=cfg, model=model, classes=classes,
            train_loader=loaders["train"], val_loader=loaders["val"], runtime=runtime,
            param_sections=param_sections, provenance=inputs, records_dir=paths.records,
            checkpoint_dir=paths.checkpoint_dir, model_file=paths.model_file, metrics_dir=paths.metrics_dir,
            objective=objective,
        ).fit()
