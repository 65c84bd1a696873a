"""Whether two runs of the pipeline wrote the same outputs: the proof that a change of code layout changed no
behaviour. Give it two project directories that ran the same stages with the same params (e.g. the default
pipeline at a commit before the change and at one after it: `bench/_common.ProjectCopy(..., source=tree)` makes a
copy of another commit's tree). For every stage in both dvc.lock files, each output's DVC hash is compared; where
they differ, a metrics file or plots folder is compared again without its timing fields (seconds and images per
second change from run to run), and a token-label store again without its header's `inputs_digest` (a digest of
what the store was made from, the stage's code files included, so that a killed run's chunks are resumed under the
same code only: any code change, a move too, changes it by design; the labels are the store's arrays), anything else
differs. Prints a table; exit 1 if anything differs.

Run: python scripts/same_outputs.py BEFORE_DIR AFTER_DIR"""

from __future__ import annotations

import argparse
import filecmp
import json
import sys
from pathlib import Path

import yaml

# The metrics a run times (the stages' summaries and their DVCLive plots): they differ between two identical runs.
TIMING_FIELDS = frozenset({
    "seconds", "images_per_second", "img_per_s", "epoch_seconds", "train_img_per_s", "train_img_per_s_per_rank",
})


def outputs(project: Path) -> dict[tuple[str, str], str]:
    """(stage, output path) -> the output's hash as dvc.lock records it."""
    path = project / "dvc.lock"
    if not path.is_file():
        raise SystemExit(f"{path}: no such file: run the pipeline in {project} first (dvc repro)")
    lock = yaml.safe_load(path.read_text())
    return {(stage, out["path"]): out["md5"]
            for stage, entry in lock["stages"].items() for out in entry.get("outs", [])}


def untimed(path: Path) -> object:
    """A metrics file's content, or a plots folder's TSV files by name, without the timing fields."""
    if path.is_dir():
        return {str(file.relative_to(path)): file.read_text() for file in sorted(path.rglob("*.tsv"))
                if file.stem not in TIMING_FIELDS}
    content = json.loads(path.read_text())
    if not isinstance(content, dict):
        return content
    return {key: value for key, value in content.items() if key not in TIMING_FIELDS}


def verdict(before: Path, after: Path, out: str, hashes: tuple[str, str]) -> str:
    if hashes[0] == hashes[1]:
        return "identical"
    if not ((before / out).exists() and (after / out).exists()):
        return "DIFFERS"
    comparable = (before / out).is_dir() or Path(out).suffix == ".json"
    if out.startswith("metrics/") and comparable and untimed(before / out) == untimed(after / out):
        return "identical but timing"
    if (before / out).is_dir():
        differing = differing_files(before / out, after / out)
        headers = header_without_inputs(before / out), header_without_inputs(after / out)
        if set(differing) <= CODE_FINGERPRINTED and headers[0] is not None and headers[0] == headers[1]:
            return "identical but the code's fingerprint"
        return f"DIFFERS: {', '.join(differing)}"  # which of its files, for the reader to judge
    return "DIFFERS"


# A token-label store's files that hold its inputs' digest: the header, and the students' dep file (the header's
# sha256: coarse2fine.labels.store.write_student_deps).
CODE_FINGERPRINTED = {"header.json", "enabled/true"}


def header_without_inputs(store: Path) -> dict | None:
    """A token-label store's header without `inputs_digest`; None for a folder that is not one."""
    header = store / "header.json"
    if not header.is_file():
        return None
    return {key: value for key, value in json.loads(header.read_text()).items() if key != "inputs_digest"}


def differing_files(before: Path, after: Path) -> list[str]:
    """The files of two folders that differ, or are in one only, by path relative to the folder."""
    names = {path.relative_to(root) for root in (before, after) for path in root.rglob("*") if path.is_file()}
    return sorted(str(name) for name in names if not (before / name).is_file() or not (after / name).is_file()
                  or not filecmp.cmp(before / name, after / name, shallow=False))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args()
    before, after = outputs(args.before), outputs(args.after)
    rows = [(stage, out, before[stage, out], after[stage, out],
             verdict(args.before, args.after, out, (before[stage, out], after[stage, out])))
            for stage, out in sorted(before.keys() & after.keys())]
    print("| stage | output | before | after | |\n| --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    only = sorted(before.keys() ^ after.keys())
    if only:
        print(f"\nin one lock only: {', '.join(f'{stage} {out}' for stage, out in only)}")
    differing = [row for row in rows if row[-1].startswith("DIFFERS")]
    print(f"\n{len(rows) - len(differing)} of {len(rows)} outputs the same" + ("" if not differing else
          f"; differing: {', '.join(f'{stage} {out}' for stage, out, *_ in differing)}"))
    return 1 if differing or only else 0


if __name__ == "__main__":
    sys.exit(main())
