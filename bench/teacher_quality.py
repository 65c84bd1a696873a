"""Token labels from teachers of several qualities, against ground truth, as DVC experiments on the photos.

A teacher right on every one of its own training images gives token labels that match ground truth; one that
misreads some of them taught the student its mistakes under the reference's targets (issue 46: 11 points below
ground truth on harder photos). This bench sweeps the teacher's quality by its training epochs (`teacher.epochs`:
the default 30 is right on ~100 % of the train images, fewer epochs leave it wrong on more of them) and, per
quality and seed, trains the students with:

- ground truth: `<student>.token_label.enabled=false` (no teacher; run once per seed),
- the recipe: the shipped params (the label mixed into the class and token targets, w = 0.5 where the teacher
  agrees with the label in pre-training, 0.25 in fine-tuning, 0.1 where it does not),
- the reference's targets: pre-training on the teacher alone, fine-tuning with sail-sg/volo's mix (w 0.5 / 0.9),
  class target only,
- (--arms) the class-only mix: the recipe's weights on the class target only, the tokens the teacher's,
- (--arms) the recipe with one part of token labeling changed: MixToken off, the dense (per-token) loss off, at twice
  its weight or at a half or a fifth of it, both off (the class target alone: the teacher's, or the label's with the
  teacher's weight 0), no label mixed into the targets, the reference's target smoothing, the reference's (centre)
  teacher view; or token labels in pre-training only, fine-tuning on ground truth; or MixToken or the dense loss off,
  or pre-training's teacher weight, in fine-tuning alone (the pre-trained student the recipe's: only fine-tuning
  runs); or MixToken off, or fine-tuning's teacher weight, in pre-training alone; or the teacher's weight 0 in both
  (MixToken and the per-token loss on the label alone).

- (--arms) ground truth and the recipe both on another crop scale: pre-training on the reference's 8-100 %, or
  fine-tuning on pre-training's 35-100 %; ground truth's variant gets its row below ground truth's, against it.

Any other change that reaches ground truth too is a `--set` of every arm (below): the gaps are then both arms' under
that change.

`--data-root DIR` runs on an ImageFolder tree instead of the photos: a held-out set of bench/photo_sets.py, the same
tree at every seed. `--photo-set NAME` builds that set anew at each seed, in the seed's workdir (bench/photo_sets.py
--seed: the seed draws each photo's held-out val block, the patches and the grey ones), as the photos' seeds do: a
set's 15 val patches of a class all come from one block of its photo and are read nearly all right or all wrong
together (issue 56: `lxqt`'s `cloud`, 15 patches of one cluster of cloudlets), so on one tree the seeds' spread leaves
out which part of each photo val shows, and a gap can be one block's. `--set KEY=VALUE ...` gives every arm more
params (e.g. augment.hflip=0.5, as the held-out runs have it).

Each seed is its own project copy (the seed draws the photo patches, the split and the training), so the teacher
runs once per quality and seed and DVC's run cache gives its token labels to every arm. Per quality: the teacher's
val top-1, its dense top-1 on the train images and its cells' (the token_labels stage's metrics); per arm: the
pre-trained student at 48 px (its own) and 64 px, the fine-tuned one at 64 px; the mean over seeds, and each
arm's gap to ground truth: the mean of its per-seed differences, with their standard error from two seeds on. Then,
per arm, the fine-tuned student's val errors in the three classes where the recipe's and ground truth's differ most
(the evaluate stage's per_class.json): a gap is often one class's val block, read wrong by one at every seed.

Run: python bench/teacher_quality.py [--seeds 0 1] [--teacher-epochs 30 8 4 3] [--arms ...] [--data-root DIR |
--photo-set NAME] [--set KEY=VALUE ...] [--workdir DIR [--refresh-params]]
(make teacher-quality; about 5 hours on 2 CPU cores with the defaults: 18 DVC experiments, 9 per seed). `--student-epochs PRE FINE` shortens
the students for a quick look (then the figures are not the defaults').
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from _common import (
    TINY_NEAR_EMPTY, ProjectCopy, add_tiny_argument, add_workdir_arguments, header_line, machine_slug, markdown_table,
    merge_params, project_copy, workspace, write_json,
)
from photo_sets import SETS as PHOTO_SETS
from photo_sets import build as build_photo_set

STUDENTS = ("pretrain", "finetune")
# Both students trained on the class target alone: neither MixToken nor the dense (per-token) loss.
NO_PER_TOKEN = {f"{stage}.token_label.{key}": value for stage in STUDENTS
                for key, value in (("mix_token", "false"), ("dense_weight", "0"))}
# Both students' targets the label alone: the teacher's weight 0 wherever its top-1 agrees or not.
NO_TEACHER = {f"{stage}.token_label.teacher_weight.{case}": "0"
              for stage in STUDENTS for case in ("agrees", "disagrees")}
GROUND_TRUTH = {f"{stage}.token_label.enabled": "false" for stage in STUDENTS}  # both students on the labels
ARMS = {  # name -> the `dvc exp run -S` settings on top of the shipped params
    "ground truth": GROUND_TRUTH,
    "recipe": {},
    "reference targets": {
        "pretrain.token_label.ground_truth_mix": "false",
        "finetune.token_label.teacher_weight.agrees": "0.5", "finetune.token_label.teacher_weight.disagrees": "0.9",
        **{f"{stage}.token_label.ground_truth_tokens": "false" for stage in STUDENTS},
    },
    "class-only mix": {f"{stage}.token_label.ground_truth_tokens": "false" for stage in STUDENTS},
    # The parts of token labeling, one changed at a time on top of the recipe (issue 56's held-out sets).
    "recipe, no MixToken": {f"{stage}.token_label.mix_token": "false" for stage in STUDENTS},
    "recipe, no dense loss": {f"{stage}.token_label.dense_weight": "0" for stage in STUDENTS},
    "recipe, class target only": NO_PER_TOKEN,  # the teacher's class targets, trained as ground truth is
    "recipe, dense weight 1": {f"{stage}.token_label.dense_weight": "1.0" for stage in STUDENTS},  # twice VOLO's 0.5
    # Less of the per-token training that makes the class token follow its tokens (issue 56), the aux head still trained.
    "recipe, dense weight 0.25": {f"{stage}.token_label.dense_weight": "0.25" for stage in STUDENTS},
    "recipe, dense weight 0.1": {f"{stage}.token_label.dense_weight": "0.1" for stage in STUDENTS},
    "recipe, no label mixing": {f"{stage}.token_label.ground_truth_mix": "false" for stage in STUDENTS},
    "recipe, target smoothing 0.1": {  # sail-sg/volo's --smoothing 0.1, which smooths the token targets too
        f"{stage}.token_label.label_smoothing": "0.1" for stage in STUDENTS},
    "recipe, centre teacher view": {"token_labels.teacher_view": "center"},  # the reference's view of each image
    "recipe, ground-truth fine-tuning": {"finetune.token_label.enabled": "false"},  # token labels in pre-training only
    # One part off in fine-tuning alone: the pre-trained student is the recipe's, from DVC's run cache.
    "recipe, fine-tuning without MixToken": {"finetune.token_label.mix_token": "false"},
    "recipe, fine-tuning without dense loss": {"finetune.token_label.dense_weight": "0"},
    # Fine-tuning with pre-training's weight where the teacher agrees with the label (the defaults' until issue 56).
    "recipe, fine-tuning teacher weight 0.5": {"finetune.token_label.teacher_weight.agrees": "0.5"},
    # One part changed in pre-training alone (fine-tuning, the recipe's, runs from the new pre-trained student).
    "recipe, pre-training without MixToken": {"pretrain.token_label.mix_token": "false"},
    # Both students' targets the label alone (no teacher), MixToken and the per-token loss kept: what they cost apart
    # from the teacher's reading of the images.
    "recipe, teacher weight 0": NO_TEACHER,
    # Both: the label alone as the class target, neither MixToken nor the dense loss (ground truth's objective on the
    # class logits, the targets unsmoothed): the corner the other two leave of the teacher and the per-token training.
    "recipe, teacher weight 0, class target only": {**NO_TEACHER, **NO_PER_TOKEN},
    # Pre-training with fine-tuning's weight where the teacher agrees: less of the teacher's reading of each image.
    "recipe, pre-training teacher weight 0.25": {"pretrain.token_label.teacher_weight.agrees": "0.25"},
    # Pre-training on the reference's crops (timm train.py's --scale default, profiles/volo_d1.yaml's augment.scale)
    # in place of the card's 35-100 %: the crop scale's share of the gap to ground truth (issue 56), on both sides.
    "ground truth, pre-training crops 8-100 %": {**GROUND_TRUTH, "pretrain.crop_scale": "[0.08,1.0]"},
    "recipe, pre-training crops 8-100 %": {"pretrain.crop_scale": "[0.08,1.0]"},
    # Fine-tuning on pre-training's crops (augment.scale's, as the reference and the profiles fine-tune) in place of
    # the deviation finetune.crop_scale 80-100 %; the pre-trained students are the shipped arms', from DVC's cache.
    "ground truth, fine-tuning crops 35-100 %": {**GROUND_TRUTH, "finetune.crop_scale": "null"},
    "recipe, fine-tuning crops 35-100 %": {"finetune.crop_scale": "null"},
}
DEFAULT_ARMS = ("ground truth", "recipe", "reference targets")
TEACHER_ONLY = "ground truth"  # the arm the teacher does not reach: run once per seed
CLASS_ROWS = 3  # classes in the per-class table: where the recipe's and ground truth's fine-tuned errors differ most
# What each arm reports: (metrics file under metrics/evaluate, key, column name).
STUDENT_COLUMNS = (
    ("pretrain", "top1", "pretrain @48"), ("pretrain", "top1_at_64", "pretrain @64"),
    ("finetune", "top1", "finetune @64"),
)
TINY = {**TINY_NEAR_EMPTY, "evaluate": {"pretrain": {"extra_sizes": [64]}, "finetune": {"extra_sizes": []}}}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], metavar="N")
    parser.add_argument("--teacher-epochs", type=int, nargs="+", default=[30, 8, 4, 3], metavar="N",
                        help="the teacher qualities, as its training epochs (default: 30 8 4 3; 30 is the shipped one)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(DEFAULT_ARMS), metavar="NAME",
                        help=f"of: {'; '.join(ARMS)} (default: {'; '.join(DEFAULT_ARMS)})".replace("%", "%%"))
    parser.add_argument("--student-epochs", type=int, nargs=2, default=None, metavar=("PRE", "FINE"),
                        help="pretrain and finetune epochs (default: params.yaml's)")
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--data-root", type=Path, default=None, metavar="DIR",
                      help="an ImageFolder tree to run on instead of the photos, the same at every seed, e.g. a "
                           "held-out set of bench/photo_sets.py (data/photo_sets/lomiri)")
    data.add_argument("--photo-set", choices=list(PHOTO_SETS), default=None, metavar="NAME",
                      help=f"a held-out set of bench/photo_sets.py ({', '.join(PHOTO_SETS)}) built at each seed, in "
                           "the seed's workdir: its val blocks drawn by the seed")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="settings",
                        help="params for every arm, as dvc exp run -S takes them (e.g. augment.hflip=0.5; "
                             "+KEY=VALUE for a key params.yaml does not write)")
    add_workdir_arguments(parser, "the project copies")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report and numbers here")
    parser.add_argument("--report-from", type=Path, nargs="+", default=None, metavar="JSON",
                        help="train nothing: the report of earlier runs' --json files (e.g. one process per seed)")
    add_tiny_argument(parser, "bench/startup.py's near-empty copy (data.subset 0.1, 1 epoch per training stage, no MLflow models), "
                              "teacher epochs 1, one seed")
    args = parser.parse_args()
    if args.tiny:
        args.teacher_epochs, args.seeds = [1], args.seeds[:1]
    return args


def main() -> None:
    args = parse_args()
    if args.report_from is not None:
        runs = runs_of(args.report_from)
        args.seeds = sorted({run["seed"] for run in runs})
        args.teacher_epochs = sorted({run["teacher_epochs"] for run in runs}, reverse=True)
        args.arms = [arm for arm in ARMS if any(run["arm"] == arm for run in runs)]
        args.student_epochs = runs[0]["student_epochs"]
    else:
        runs = train_arms(args)
    text = "\n".join([header_line(), "", report(runs, args)])
    print(text)
    write_json(args, text, {"runs": runs}, topic=result_topic(args), machine=runs_machine(runs))


def runs_machine(runs: list[dict]) -> str | None:
    """The machine the runs name, for the result file's name (a report made elsewhere from them by --report-from is
    named after where they ran, not after the machine that made it); None when they name none, `several-machines`
    when their seeds ran on different ones."""
    machines = machines_of(runs)
    return None if not machines else machines[0] if len(machines) == 1 else "several-machines"


def machines_of(runs: list[dict]) -> list[str]:
    """The machines the runs name (runs recorded before they named one name none)."""
    return sorted({run["machine"] for run in runs if "machine" in run})


def runs_of(paths: list[Path]) -> list[dict]:
    """The runs of earlier --json files; a run (seed, teacher epochs, arm) given twice stops the report, naming both
    files: a report re-made from its own file plus the ones it was made from would count those seeds twice. So do a
    seed's runs from two machines: each arm is compared with ground truth at its seed, and another CPU's rounding
    trains other students from the same seed (lxqt's recipe at seed 0, fine-tuned: 74.55 % on 2 Intel Xeon cores,
    75.15 % on 2 AMD EPYC cores, from teachers of the same val top-1): such a pair would measure the machines too."""
    runs, source, machines = [], {}, {}
    for path in paths:
        for run in json.loads(path.read_text())["runs"]:
            key = (run["seed"], run["teacher_epochs"], run["arm"])
            if key in source:
                raise SystemExit(f"seed {key[0]}, teacher epochs {key[1]}, arm {key[2]!r} is in both {source[key]} "
                                 f"and {path}: give each run once")
            machine = run.get("machine", "an unnamed machine")
            first = machines.setdefault(run["seed"], (machine, path))
            if first[0] != machine:
                raise SystemExit(f"seed {run['seed']} ran on {first[0]} ({first[1]}) and on {machine} ({path}): a "
                                 "seed's arms are compared only when one machine ran them all")
            source[key] = path
            runs.append(run)
    return runs


def result_topic(args: argparse.Namespace) -> str:
    """The result file's topic: the bench's name, then the data set's folder name unless it is the photos, and the
    student epochs unless they are the defaults'."""
    topic = "teacher_quality"
    if args.photo_set is not None:
        topic = f"teacher_quality_{args.photo_set}_drawn_per_seed"
    elif args.data_root is not None:
        topic = f"teacher_quality_{args.data_root.resolve().name}"
    if args.student_epochs is None:
        return topic
    return f"{topic}_students_{args.student_epochs[0]}_{args.student_epochs[1]}"


def train_arms(args: argparse.Namespace) -> list[dict]:
    """Every seed's project copy, every teacher quality and arm: one run record each (printed as it ends)."""
    runs = []
    with workspace(args.workdir) as work:
        for seed in args.seeds:
            change = {"seed": seed, "data": data_params(args, work / f"seed{seed}", seed)}
            project = project_copy(work / f"seed{seed}", merge_params(change, TINY) if args.tiny else change,
                                   args.refresh_params)
            students = {}
            if args.student_epochs is not None:
                students = {f"{stage}.epochs": str(epochs) for stage, epochs in zip(STUDENTS, args.student_epochs)}
            for epochs in args.teacher_epochs:
                for arm in args.arms:
                    if arm == TEACHER_ONLY and epochs != args.teacher_epochs[0]:
                        continue
                    settings = {"teacher.epochs": str(epochs), **students, **dict(
                        setting.split("=", 1) for setting in args.settings), **ARMS[arm]}
                    runs.append({"seed": seed, "teacher_epochs": epochs, "arm": arm, "machine": machine_slug(),
                                 "student_epochs": args.student_epochs, **run_arm(project, settings)})
                    print(json.dumps(runs[-1]), flush=True)
                    # A killed sweep keeps what it ran.
                    write_json(args, "(unfinished)", {"runs": runs}, topic=result_topic(args))
    return runs


def data_params(args: argparse.Namespace, seed_work: Path, seed: int) -> dict:
    """params.yaml's `data` of a seed's project copy: the photos, the --data-root tree, or the --photo-set drawn at
    that seed."""
    if args.photo_set is not None:
        return {"source": "imagefolder", "root": str(photo_set_tree(seed_work, args.photo_set, seed, args.tiny))}
    if args.data_root is not None:
        return {"source": "imagefolder", "root": str(args.data_root.resolve())}
    return {"source": "photos"}


def photo_set_tree(seed_work: Path, name: str, seed: int, tiny: bool) -> Path:
    """bench/photo_sets.py's set `name` drawn at `seed`, under `seed_work`: built once, then reused from a kept
    --workdir (a rebuilt tree's new files would rerun convert and every stage after it, the teacher's training too).
    The set's description is written after its tree, so a build that was killed is built again."""
    out = seed_work / "photo_set"
    description = out / f"{name}.json"
    if not description.is_file() or json.loads(description.read_text())["seed"] != seed:
        out.mkdir(parents=True, exist_ok=True)
        build_photo_set(name, out, seed, tiny)
    return (out / name).resolve()


def run_arm(project: ProjectCopy, settings: dict[str, str]) -> dict:
    """One `dvc exp run` from the committed params with `settings`: the teacher's and the students' metrics."""
    project.run("git", "checkout", "-q", "HEAD", "--", "params.yaml")  # each arm names only what it changes
    run = project.timed_dvc(
        "exp", "run", *[f"-S={key}={value}" for key, value in settings.items()],
        "evaluate@pretrain", "evaluate@finetune",
    )
    metrics = project.path / "metrics"
    result = {"stages_run": sorted(run.stage_seconds), "seconds": round(run.seconds)}
    result["students"] = {
        column: json.loads((metrics / "evaluate" / stage / "metrics.json").read_text())[key]
        for stage, key, column in STUDENT_COLUMNS
    }
    per_class = json.loads((metrics / "evaluate" / "finetune" / "per_class.json").read_text())
    result["finetune_wrong"] = {row["class"]: row["total"] - row["correct"] for row in per_class}
    teacher = json.loads((metrics / "teacher" / "metrics.json").read_text())
    labels = json.loads((metrics / "token_labels" / "metrics.json").read_text())
    if "dense_top1" in labels:  # an arm without token labels leaves an empty store (no teacher forward)
        result["teacher"] = {"val_top1": teacher["val_top1"], "dense_top1": labels["dense_top1"],
                             "cell_top1": labels["cell_top1"]}
    return result


def report(runs: list[dict], args: argparse.Namespace) -> str:
    """One row per teacher quality and arm: means over seeds (each seed in brackets), the arm's gap to ground truth;
    ground truth's row, then its variants'; then the classes where the recipe's fine-tuned student and ground truth's
    differ most."""
    runs = sorted(runs, key=lambda run: run["seed"])  # each cell's seeds in one order
    columns = [column for _, _, column in STUDENT_COLUMNS]
    truth = {column: {run["seed"]: run["students"][column] for run in runs if run["arm"] == TEACHER_ONLY}
             for column in columns}

    def cells_and_gap(chosen: list[dict]) -> list[str]:
        cells = [mean([run["students"][column] for run in chosen]) for column in columns]
        gaps = [  # against ground truth at the same seeds
            paired_gap([run["students"][column] - truth[column][run["seed"]] for run in chosen])
            if all(run["seed"] in truth[column] for run in chosen) else "-" for column in columns
        ]
        return [*cells, " / ".join(gaps)]

    rows = []
    for epochs in sorted(args.teacher_epochs, reverse=True):
        at_quality = [run for run in runs if run["teacher_epochs"] == epochs and "teacher" in run]
        if not at_quality:  # ground truth alone ran: no teacher to show
            continue
        teachers = {run["seed"]: run["teacher"] for run in at_quality}.values()
        teacher = " / ".join(mean([t[key] for t in teachers]) for key in ("val_top1", "dense_top1", "cell_top1"))
        for arm in args.arms:
            if arm != TEACHER_ONLY and (chosen := [run for run in at_quality if run["arm"] == arm]):
                rows.append([str(epochs), teacher, arm, *cells_and_gap(chosen)])
    if any(truth.values()):
        rows.append(["-", "-", TEACHER_ONLY, *[mean(list(truth[column].values())) for column in columns], "0"])
    for arm in args.arms:  # ground truth's variants (no teacher reaches them), against it at the same seeds
        if arm != TEACHER_ONLY and (chosen := [run for run in runs if run["arm"] == arm and "teacher" not in run]):
            rows.append(["-", "-", arm, *cells_and_gap(chosen)])
    epochs_line = "students: params.yaml's epochs" if args.student_epochs is None else (
        f"students: pretrain {args.student_epochs[0]} + finetune {args.student_epochs[1]} epochs (not the defaults)")
    return "\n".join([
        f"{data_line(args)}, seeds {', '.join(map(str, args.seeds))}{ran_on(runs)}; {epochs_line}; top-1 % on val, "
        "mean over seeds (per seed, in that order)",
        "",
        markdown_table(["teacher epochs", "teacher val / dense train / cells top-1 %", "targets", *columns,
                        "gap to ground truth (pretrain @48 / @64 / finetune) ± its standard error"], rows),
        *class_errors(runs, args),
    ])


def mean(values: list[float], digits: int = 2) -> str:
    """A table cell: the mean, then each value in brackets when there are several."""
    shown = f"{statistics.fmean(values):.{digits}f}"
    return shown if len(values) == 1 else f"{shown} ({' / '.join(f'{value:.{digits}f}' for value in values)})"


def class_errors(runs: list[dict], args: argparse.Namespace) -> list[str]:
    """The fine-tuned students' val errors in the CLASS_ROWS classes where the recipe's and ground truth's differ most
    over the seeds both ran (the best teacher's runs): a gap is often one class's val images, read right by one student
    and wrong by the other at every seed (docs/recipe.md, "Where `lxqt`'s shortfall comes from"). Runs recorded
    before the bench kept each class's errors have none: no table then."""
    best = max(args.teacher_epochs)
    errors = {arm: {run["seed"]: run["finetune_wrong"] for run in runs if run["arm"] == arm and "finetune_wrong" in run
                    and (arm == TEACHER_ONLY or run["teacher_epochs"] == best)} for arm in args.arms}
    recipe, truth = errors.get("recipe", {}), errors.get(TEACHER_ONLY, {})
    paired = [seed for seed in recipe if seed in truth]
    if not paired:
        return []
    classes = sorted(recipe[paired[0]], key=lambda name: -abs(sum(recipe[seed][name] - truth[seed][name]
                                                                    for seed in paired)))[:CLASS_ROWS]
    arms = [arm for arm in args.arms if errors.get(arm)]
    rows = [[name, *(mean([wrong[name] for wrong in errors[arm].values()], digits=1) for arm in arms)]
            for name in classes]
    seeds = ", ".join(map(str, paired))
    return ["", f"val images wrong per class, fine-tuned (the {len(classes)} classes where the recipe and ground truth "
                f"differ most at seeds {seeds}; teacher epochs {best}), mean over the seeds each arm ran (per seed, "
                "in order)",
            "", markdown_table(["class", *arms], rows)]


def paired_gap(differences: list[float]) -> str:
    """The mean of an arm's per-seed differences to ground truth, and from two seeds on the standard error of that
    mean (their sample sd / sqrt(seeds)): each seed's pair shares its data, split and teacher, so the pairs' spread
    is what the mean is uncertain by, not the spread of either arm's own figures."""
    mean = f"{round(statistics.fmean(differences), 2) + 0.0:+.2f}"  # + 0.0: no "-0.00" for a mean that rounds to 0
    if len(differences) < 2:
        return mean
    return f"{mean} ± {statistics.stdev(differences) / len(differences) ** 0.5:.2f}"


def ran_on(runs: list[dict]) -> str:
    """Where the runs ran, as they name it (the header line names the machine that made the report)."""
    machines = machines_of(runs)
    return f" (run on {', '.join(machines)})" if machines else ""


def data_line(args: argparse.Namespace) -> str:
    """The data set and the params every arm had, for the report's first line."""
    data = "photos"
    if args.photo_set is not None:
        data = f"the held-out set {args.photo_set} drawn at each seed (bench/photo_sets.py --seed: val blocks, patches)"
    elif args.data_root is not None:
        data = f"the ImageFolder set {args.data_root.resolve().name}"
    return data + "".join(f", {setting}" for setting in args.settings)


if __name__ == "__main__":
    main()
