"""Rewrites every stage's code deps in dvc.yaml (`make deps`) as `provenance.stage_code_deps` finds them from the
imports: within each stage's `deps:` list, the lines naming stages/ or src/ files are replaced by the current list,
where the first of them stood; every other line (data deps, comments, params, outs) stays as it is.
`--check` only says whether dvc.yaml is up to date (exit 1 if not)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

from coarse2fine import provenance

ROOT = Path(__file__).resolve().parents[1]
CODE_DEP = re.compile(r"^(\s+)- (stages|src)/\S+\s*$")
STAGE = re.compile(r"^  ([a-z_]+):\s*$")


def rewritten(text: str) -> str:
    stages = yaml.safe_load(text)["stages"]
    commands = {name: stage.get("do", stage)["cmd"] for name, stage in stages.items()}
    lines, stage, in_deps, written = [], None, False, False
    for line in text.splitlines():
        if STAGE.match(line):
            stage, in_deps, written = STAGE.match(line).group(1), False, False
        elif re.match(r"^\s+deps:\s*$", line):
            in_deps = True
        elif re.match(r"^\s+[a-z_]+:", line):
            in_deps = False
        code = CODE_DEP.match(line) if in_deps else None
        if not code:
            lines.append(line)
        elif not written:
            lines.extend(f"{code.group(1)}- {dep}" for dep in provenance.stage_code_deps(commands[stage], ROOT))
            written = True
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if dvc.yaml's code deps are not the imports'")
    args = parser.parse_args()
    path = ROOT / "dvc.yaml"
    text, new = path.read_text(), rewritten(path.read_text())
    if args.check:
        sys.exit(0 if text == new else "dvc.yaml's code deps differ from the imports: run make deps")
    if text != new:
        path.write_text(new)
        print("dvc.yaml: code deps rewritten")


if __name__ == "__main__":
    main()
