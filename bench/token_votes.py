"""What a VOLO student's class token says about each val class, beside what its own tokens say (issue 56, point 2).

A token-labeled student is trained to name a class at every token (the dense loss) and to read a MixToken crop as
the area share of the classes its tokens came from; a ground-truth student's tokens are trained only through the
best one. On a val block whose tokens look like another class (held-out `lxqt`'s `cloud`: cumulus its training
patches rarely show, tokens that look like `flowers`), both students' tokens name the other class, and the question
is whether the class token follows them. This bench answers it per class, for every experiment of the project
copies bench/teacher_quality.py keeps (each copy one seed), each experiment named by the arm whose settings it ran.

For each experiment's model (`--stage`: the fine-tuned one by default) from DVC's cache, over the copy's val records
as the evaluate stage reads them (its loader, at the model's own size, `evaluate.<stage>.crop_pct`): per class, the
model's top-1 (class logits + 0.5 x best token logits, what the evaluate stage scores), the class token's alone (the
head on the class token), the share of the tokens whose own prediction (the aux head) names the label, and the class
most tokens name. Each cell is the mean over the copies, each copy's figure in brackets in the order given.

Run: python bench/token_votes.py --projects WORKDIR/seed0/project WORKDIR/seed2/project ... [--classes cloud]
[--stage finetune] [--arms ...] [--json PATH]
(e.g. after `python bench/teacher_quality.py --workdir WORKDIR ...`; about 10 s an experiment on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import dvc.api
import torch
import yaml
from timm.models.volo import VOLO

from _common import add_results_argument, header_line, markdown_table, write_json
from coarse2fine import checkpoints, distributed
from coarse2fine.cli import print_user_error
from coarse2fine.config import Params, flatten, parse_params
from coarse2fine.data import records
from coarse2fine.data.loaders import build_loader
from coarse2fine.errors import UserError
from coarse2fine.forward import TrainOutput
from teacher_quality import ARMS

STAGES = ("pretrain", "finetune")
SCORES = ("top1", "class_token_top1", "tokens_naming_label")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--projects", type=Path, nargs="+", required=True, metavar="DIR",
                        help="project copies of bench/teacher_quality.py (WORKDIR/seed<N>/project), one per seed")
    parser.add_argument("--stage", choices=STAGES, default="finetune", help="whose model (default: finetune)")
    parser.add_argument("--classes", nargs="+", default=None, metavar="NAME", help="these val classes (default: all)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=None, metavar="NAME",
                        help="these arms (default: every arm an experiment ran)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the report and numbers here")
    add_results_argument(parser)
    return parser.parse_args()


def git(project: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=project, capture_output=True, text=True, check=True).stdout


def committed_params(project: Path) -> Params:
    """The copy's committed params (the workspace's may be an experiment's, or a running one's)."""
    return parse_params(yaml.safe_load(git(project, "show", "HEAD:params.yaml")), f"{project}/params.yaml")


def experiments(project: Path) -> dict[str, str]:
    """arm -> the commit of the copy's latest experiment that ran it. An experiment's arm: the params it changed from
    the copy's committed ones, less those every experiment changed (the bench's --set), as teacher_quality.ARMS
    names them; one that matches no arm is left out."""
    committed = flatten(committed_params(project))
    changes = {}
    for line in git(project, "for-each-ref", "--sort=committerdate", "--format=%(objectname) %(refname)",
                    "refs/exps").splitlines():
        commit, ref = line.split()
        if ref.count("/") != 4:  # refs/exps/<xx>/<baseline>/<name>; not DVC's own (refs/exps/exec/...)
            continue
        params = flatten(parse_params(yaml.safe_load(git(project, "show", f"{commit}:params.yaml")), ref))
        changes[commit] = {key: value for key, value in params.items() if committed.get(key) != value}
    every = list(changes.values())
    common = {key: value for key, value in every[0].items() if all(key in changed and changed[key] == value
                                                                   for changed in every)} if every else {}
    arms = {name: {key: yaml.safe_load(value) for key, value in settings.items()} for name, settings in ARMS.items()}
    found = {}
    for commit, changed in changes.items():  # oldest first: a later run of an arm replaces an earlier one
        own = {key: value for key, value in changed.items() if key not in common}
        found |= {name: commit for name, settings in arms.items() if settings == own}
    return found


def model_at(project: Path, commit: str, stage: str, directory: Path) -> Path:
    """The experiment's model file, from DVC's cache (written to `directory`: the model loader reads paths)."""
    path = directory / f"{commit}_{stage}.pt"
    with dvc.api.open(f"models/{stage}/model.pt", repo=str(project), rev=commit, mode="rb") as source:
        path.write_bytes(source.read())
    return path


def votes(
    model_file: Path, project: Path, params: Params, stage: str, runtime: distributed.Runtime
) -> dict[str, dict[str, object]]:
    """class -> {images, top1, class_token_top1, tokens_naming_label (%), token_votes: {class: tokens}}."""
    payload = checkpoints.read_model_file(model_file, runtime.device)
    model = checkpoints.model_from_payload(payload, model_file, runtime.device)
    if not isinstance(model, VOLO) or model.aux_head is None:
        raise SystemExit(f"{model_file}: not a VOLO with a per-token head ({type(model).__name__})")
    records_dir = project / "data" / "records"
    classes = records.read_classes(records_dir)
    loader = build_loader(
        "val", records_dir, img_size=payload["img_size"], batch_size=params.evaluate.batch_size, runtime=runtime,
        loader_cfg=params.loader, augment_cfg=params.augment, crop_pct=getattr(params.evaluate, stage).crop_pct,
        seed=params.seed,
    )
    counts = {name: Counter() for name in classes}
    with torch.inference_mode():
        for batch in loader:
            features = model.forward_features(batch["image"])
            class_logits, token_logits = model.head(features[:, 0]), model.aux_head(features[:, 1:])
            merged = TrainOutput(class_logits, token_logits).merged()  # model(x): what the evaluate stage scores
            token_classes = token_logits.argmax(dim=-1)
            for label, prediction, class_token, tokens in zip(
                batch["label"].tolist(), merged.argmax(1).tolist(), class_logits.argmax(1).tolist(), token_classes
            ):
                count = counts[classes[label]]
                count["images"] += 1
                count["top1"] += prediction == label
                count["class_token_top1"] += class_token == label
                count.update({f"token:{classes[c]}": n for c, n in Counter(tokens.tolist()).items()})
    result = {}
    for name, count in counts.items():
        tokens = {key.removeprefix("token:"): n for key, n in count.items() if key.startswith("token:")}
        images = count["images"]
        result[name] = {"images": images, "top1": 100 * count["top1"] / images,
                        "class_token_top1": 100 * count["class_token_top1"] / images,
                        "tokens_naming_label": 100 * tokens.get(name, 0) / sum(tokens.values()), "token_votes": tokens}
    return result


def report(found: dict[str, dict[str, dict]], projects: list[Path], args: argparse.Namespace) -> str:
    """One row per arm and class: each score's mean over the copies (each copy's in brackets)."""
    def cell(values: list[float]) -> str:
        each = " / ".join(f"{value:.1f}" for value in values)
        return f"{sum(values) / len(values):.1f} ({each})" if len(values) > 1 else each

    rows = []
    for arm in (arm for arm in ARMS if arm in found):
        per_copy = [found[arm][str(project)] for project in projects if str(project) in found[arm]]
        for name in args.classes or sorted(per_copy[0]):
            scores = [copy[name] for copy in per_copy]
            tokens = sum((Counter(score["token_votes"]) for score in scores), Counter())
            most, most_tokens = tokens.most_common(1)[0]
            means = [cell([score[key] for score in scores]) for key in SCORES]
            rows.append([arm, name, str(scores[0]["images"]), *means,
                         f"{most} ({100 * most_tokens / sum(tokens.values()):.0f} %)", str(len(scores))])
    return "\n".join([
        header_line(), "",
        f"the {args.stage} students of {len(projects)} project copies ({', '.join(map(str, projects))}), on their val "
        "records at their own size; top-1 %: the model's prediction (class + 0.5 x best token logits); class token: "
        "the head on the class token alone; tokens naming the label: % of all val tokens of the class whose aux head "
        "names it; each a mean over the copies (each copy in brackets)",
        "",
        markdown_table(["arm", "class", "images", "top-1 %", "class token top-1 %", "tokens naming the label %",
                        "most tokens name", "copies"], rows),
    ])


def main() -> None:
    args = parse_args()
    found: dict[str, dict[str, dict]] = {}  # arm -> project -> class -> scores
    with distributed.session("cpu") as runtime, tempfile.TemporaryDirectory() as scratch:
        for project in args.projects:
            try:
                names = records.read_classes(project / "data" / "records")
            except UserError as error:  # not a project copy, or one whose stages never ran
                print_user_error(error)
                raise SystemExit(2) from None
            if unknown := sorted(set(args.classes or []) - set(names)):
                raise SystemExit(f"{project}: no val class {', '.join(unknown)} (its classes: {', '.join(names)})")
            params = committed_params(project)  # the val loader's settings, the same in every experiment
            for arm, commit in experiments(project).items():
                if args.arms is None or arm in args.arms:
                    model_file = model_at(project, commit, args.stage, Path(scratch))
                    found.setdefault(arm, {})[str(project)] = votes(model_file, project, params, args.stage, runtime)
    if not found:
        raise SystemExit(f"no experiment of {', '.join(map(str, args.projects))} ran any of the arms asked for")
    text = report(found, args.projects, args)
    print(text)
    write_json(args, text, {"votes": found}, topic=result_topic(args.projects[0], args.stage))


def result_topic(project: Path, stage: str) -> str:
    """token_votes, then the data set as teacher_quality's result files name it (an ImageFolder's folder name; the
    photos unnamed), and the stage unless it is fine-tuning."""
    data = committed_params(project).data
    topic = "token_votes" if data.source != "imagefolder" else f"token_votes_{Path(data.root).name}"
    return topic if stage == "finetune" else f"{topic}_{stage}"


if __name__ == "__main__":
    main()
