"""Token labels (params token_labels.*): the teacher's top-k dense scores for every train record, in data/token_labels.

`token_labels.mode: generate` runs the teacher: ranks split the records; a killed run resumes from its last
finished chunk (the work dir, .resume/token_labels under dvc.yaml: resume state, not an output, so that DVC's run
cache can restore a finished store, e.g. after token labeling was off everywhere and back on, without a teacher
forward); 1 or N ranks write the same bytes. `import` reads the reference's published label files instead
(token_labels.import_dir; coarse2fine.labels.imported), no teacher forward. When no student learns from token
labels (pretrain/finetune.token_label.enabled both false), an empty store: neither the teacher nor the records
are read.
The store also holds what dvc.yaml's students depend on (`store.write_student_deps`), so that a student with token
labeling off is not rerun when the labels change.
Metrics: the teacher's dense top-1 (spatially averaged map vs the label) and its cells' top-1, what the student
will be taught against what the teacher said (entropy and top-1 of the whole-image target from the store vs the
teacher's own prediction, the probability the top k leave), bytes per image and what the same settings would take
for ImageNet-1K, generation (or import) img/s.
"""

import argparse
import functools
import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Callable

from coarse2fine import checkpoints, cli, distributed, provenance
from coarse2fine.config import Params
from coarse2fine.data import records
from coarse2fine.distributed import Runtime
from coarse2fine.errors import UserError
from coarse2fine.files import file_sha256, project_path
from coarse2fine.labels import store
from coarse2fine.labels.generate import (
    REFERENCE_IMAGENET_BYTES, Generation, View, dense_head, generate, unreliable_teacher_warning,
)
from coarse2fine.labels.imported import REFERENCE_VIEW, import_labels
from coarse2fine.tracking.identity import stage_params
from coarse2fine.tracking.runs import Tracker

# What this stage reads (as dvc.yaml lists it): the generation's settings and the resize. Not loader.workers, which
# it runs with: a speed knob, the same store whatever the count. Nor the students' token_label.enabled: whether any
# student reads the labels (Params.token_labels_needed) reaches DVC through data/token_labels_source.json, which the
# source stage rewrites when that flips; listing the flags here would regenerate every label whenever one student
# stops reading them while the other still does.
PARAM_SECTIONS = ("token_labels", "augment.interpolation")


def main(params: Params, args: argparse.Namespace) -> None:
    cfg = params.token_labels
    with distributed.session(params.launch.device) as runtime:
        if not params.token_labels_needed:
            _write_unused_store(params, args, runtime)
            return
        classes = records.read_classes(args.records)
        if cfg.mode == "import":
            make_store = _importer(params, args, runtime)
        else:
            make_store = _generator(params, args, runtime, classes)
        tracking = Tracker("token_labels", params, runtime, metrics_dir=args.metrics, param_sections=PARAM_SECTIONS)
        with tracking as tracker:
            tracker.log_records(args.records, "train")
            metrics = make_store().metrics()
            tracker.log_summary(metrics)
            warning = unreliable_teacher_warning(metrics)
            tracker.set_tag("teacher_warning", warning or "none")
            if runtime.is_main:
                store.write_student_deps(Path(args.out), store_written=True)
                print(
                    f"token_labels: {metrics['images']} images, teacher dense top-1 {metrics['dense_top1']:.2f} % "
                    f"(cells {metrics['cell_top1']:.2f} %), entropy {metrics['teacher_entropy']:.3f} nats; the "
                    f"targets it gives: top-1 {metrics['target_top1']:.2f} %, entropy {metrics['target_entropy']:.3f} "
                    f"(uniform {math.log(len(classes)):.3f}); the top {cfg.top_k} leave {metrics['outside_top_k']:.3f} "
                    f"of each cell's probability",
                    flush=True,
                )
                if warning is not None:
                    print(f"token_labels: {warning}", flush=True)
                print(
                    f"token_labels: {metrics['bytes_per_image']} bytes/image "
                    f"(ImageNet-1K: {metrics['imagenet_gb']:.2f} GB, the reference's "
                    f"{REFERENCE_IMAGENET_BYTES / 1e9:.1f} GB), {metrics['img_per_s']:.0f} img/s",
                    flush=True,
                )


def _write_unused_store(params: Params, args: argparse.Namespace, runtime: Runtime) -> None:
    """No student reads token labels: a store of nothing but the false student dep (no teacher, no records)."""
    runtime.announce("token_labels (read by no student)")
    with Tracker("token_labels", params, runtime, metrics_dir=args.metrics, param_sections=PARAM_SECTIONS) as tracker:
        if runtime.is_main:
            shutil.rmtree(args.out, ignore_errors=True)
            store.write_student_deps(Path(args.out), store_written=False)
            print(
                "token_labels: no student learns from token labels (pretrain/finetune.token_label.enabled): "
                "an empty store, no teacher forward",
                flush=True,
            )
        tracker.log_summary({"images": 0})


def _generator(
    params: Params, args: argparse.Namespace, runtime: Runtime, classes: list[str]
) -> Callable[[], Generation]:
    """The teacher's forward over every train record (mode generate)."""
    cfg = params.token_labels
    runtime.announce("token_labels", cfg.precision, loader="torch")  # generate's own DataLoader
    teacher, info = checkpoints.load_model_file(args.teacher, runtime.device)
    if info["classes"] != classes:
        raise UserError(f"{args.teacher}: a teacher for other classes than {args.records}; rerun the teacher stage")
    records_digest = records.manifest_digest(args.records)
    # What the store is a function of: a killed run's chunks are only kept when all of it is the same.
    inputs = {
        **stage_params(params, PARAM_SECTIONS),
        "teacher_digest": file_sha256(args.teacher),
        "records_digest": records_digest,
        **provenance.fingerprint(__file__),
    }
    header = {
        "teacher": {"name": info["model_cfg"]["name"], "img_size": info["img_size"], "view": cfg.teacher_view},
        "records_digest": records_digest,
        "inputs_digest": hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest(),
    }
    return functools.partial(
        generate, dense_head(runtime.place(teacher)), args.records, out_dir=args.out, work_dir=args.work_dir,
        view=View(cfg.teacher_view, info["img_size"], params.augment.interpolation),
        top_k=cfg.top_k, batch_size=cfg.batch_size, workers=params.loader.workers, runtime=runtime,
        autocast_dtype=runtime.autocast_dtype(cfg.precision), inputs=inputs, header=header,
    )


def _importer(params: Params, args: argparse.Namespace, runtime: Runtime) -> Callable[[], Generation]:
    """The reference's label files read into the store (mode import); the teacher is not loaded."""
    cfg = params.token_labels
    runtime.announce("token_labels (import)")
    header = {
        "teacher": {"imported_from": cfg.import_dir, "view": REFERENCE_VIEW},
        "records_digest": records.manifest_digest(args.records),
    }
    return functools.partial(
        import_labels, args.records, project_path(cfg.import_dir), out_dir=args.out, top_k=cfg.top_k,
        batch_size=cfg.batch_size, runtime=runtime, header=header,
    )


if __name__ == "__main__":
    parser = cli.stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--records", default="data/records", help="records directory (default: data/records)")
    parser.add_argument(
        "--teacher", default="models/teacher/model.pt",
        help="mode generate: the teacher (default: models/teacher/model.pt)",
    )
    parser.add_argument("--out", default="data/token_labels", help="the label store (default: data/token_labels)")
    parser.add_argument(
        "--work-dir", default=".resume/token_labels",
        help="a killed run's finished chunks, deleted once the store is written (default: .resume/token_labels)",
    )
    parser.add_argument("--metrics", default="metrics/token_labels", help="default: metrics/token_labels")
    cli.run(main, parser)
