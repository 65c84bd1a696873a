"""What `tracking.log_models` costs a training stage of each profile: the MLflow model that stage logs, through the
project's own `tracking.logged_model.log_model` (a deep copy of the model, torch.export at the stage's size, the
"pt2" archive written into an MLflow store), timed and sized per profile's fine-tuned architecture at its
fine-tuning resolution, with random weights (the cost does not depend on their values).

Per profile: the model's parameters and fp32 bytes, the seconds log_model took and the bytes it added to the
artifact store, and the same projected per pipeline (pretrain + finetune: two models) and per experiment sweep of
ten pipelines, beside the model files that models/ holds anyway (which DVC's cache links, no copy: .dvc/config).
The profiles set `tracking.log_models` from these figures (docs/scaling.md, "ImageNet on a cluster").
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import mlflow
import yaml

from coarse2fine import models
from coarse2fine.config import parse_params
from coarse2fine.tracking.logged_model import log_model

from _common import PROJECT_ROOT, add_tiny_argument, goal, header_line, markdown_table, write_json

PROFILES = tuple(sorted(path.stem for path in (PROJECT_ROOT / "profiles").glob("*.yaml")))
SWEEP = 10  # pipelines in a sweep, for the projection


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", nargs="+", default=PROFILES, choices=PROFILES, metavar="NAME",
                        help=f"profiles to measure (default: all of profiles/: {', '.join(PROFILES)})")
    add_tiny_argument(parser, "the shipped params' tiny VOLO only (params.yaml), no profile")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the raw numbers to FILE")
    return parser.parse_args()


def store_bytes(root: Path) -> int:
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file())


def measure(name: str, params_file: Path, store: Path) -> dict:
    """One logged model of `params_file`'s fine-tuned architecture, in a fresh run of the store in `store`."""
    params = parse_params(yaml.safe_load(params_file.read_text(encoding="utf-8")), str(params_file))
    size = params.finetune.img_size
    num_classes = 1000 if params.data.source == "imagefolder" else 10
    model = models.build_model(params.model, num_classes=num_classes, img_size=size)
    parameters = sum(tensor.numel() for tensor in model.state_dict().values())
    classes = [f"class {k}" for k in range(num_classes)]
    card = {"classes": classes, "img_size": size, "stage": "finetune", "eval_transform": {}}
    mlflow.set_tracking_uri(f"sqlite:///{store / 'mlflow.db'}")
    client = mlflow.MlflowClient()
    experiment = client.create_experiment(name, artifact_location=(store / "mlruns").as_uri())
    run_id = client.create_run(experiment).info.run_id
    before = store_bytes(store / "mlruns") if (store / "mlruns").exists() else 0
    start = time.perf_counter()
    logged = log_model(run_id, "finetune", model, card)
    seconds = time.perf_counter() - start
    if logged is None:
        raise SystemExit(f"{name}: the model was not logged (see the warning above)")
    added = store_bytes(store / "mlruns") - before
    return {"profile": name, "model": getattr(params.model, "name", "volo_custom"), "img_size": size,
            "parameters": parameters, "model_bytes": parameters * 4, "seconds": seconds, "artifact_bytes": added}


def main() -> None:
    args = parse_args()
    targets = {"params.yaml": PROJECT_ROOT / "params.yaml"} if args.tiny else {
        name: PROJECT_ROOT / "profiles" / f"{name}.yaml" for name in args.profiles
    }
    rows, raw = [], []
    with tempfile.TemporaryDirectory(prefix="model-export-") as work:
        store = Path(work)
        for name, path in targets.items():
            print(f"model_export: {name} ...", file=sys.stderr, flush=True)
            result = measure(name, path, store)
            raw.append(result)
            megabytes = result["artifact_bytes"] / 1e6
            rows.append([
                name, f"{result['model']} @ {result['img_size']}", f"{result['parameters'] / 1e6:.1f} M",
                f"{result['model_bytes'] / 1e6:.0f}", f"{result['seconds']:.1f}", f"{megabytes:.0f}",
                f"{2 * result['seconds']:.0f} s, {2 * megabytes / 1e3:.2f} GB", f"{2 * SWEEP * megabytes / 1e3:.1f} GB",
            ])
    text = "\n".join([
        header_line(),
        "",
        "One MLflow model per training stage (`tracking.log_models: true`): deep copy + torch.export + the pt2 "
        "archive in a SQLite store with local artifacts, per profile's fine-tuned model at its fine-tuning size "
        "(random weights, 2 CPU threads). A pipeline logs two (pretrain, finetune); the teacher's is logged too "
        "when trained here.",
        "",
        markdown_table(
            ["profile", "model", "parameters", "fp32 MB", "log_model s", "artifact MB", "a pipeline (2 models)",
             f"{SWEEP} pipelines"],
            rows,
        ),
        "",
        goal("every profile's model exports (torch.export accepts it)", True, f"{len(rows)} of {len(rows)}"),
    ])
    print(text)
    write_json(args, text, {"rows": raw}, "model_export")


if __name__ == "__main__":
    main()
