"""Run every benchmark in sequence (never concurrently) and print their reports: loader (plain, then with the
recipe's RandAugment and random erasing: loader_recipe), loader_profile, rand_augment, convert, train_step, layout,
caching, startup, token_labels, memory, and peer (timm's train.py) when --timm-repo is given. `make bench` runs this.

Each benchmark's progress goes to stderr, its report (header line, markdown table, goals) to stdout; with
--json-dir DIR each also writes DIR/<name>.json. A failing benchmark is reported and the others still run; the
exit code is 1 if any failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = (
    "loader", "loader_recipe", "loader_profile", "rand_augment", "convert", "train_step", "layout", "caching",
    "startup", "token_labels", "memory",
)
# name -> (script, its options): the recipe's train augment (sail-sg/volo: --aa rand-m9-mstd0.5-inc1 --reprob 0.25).
SCRIPTS = {"loader_recipe": ("loader", ["--rand-augment", "rand-m9-mstd0.5-inc1", "--reprob", "0.25"])}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timm-repo", type=Path, metavar="PATH",
                        help="a timm source checkout (train.py + timm/): also run peer.py against timm's train.py")
    parser.add_argument("--json-dir", type=Path, metavar="DIR", help="write each benchmark's raw numbers to DIR/<name>.json")
    parser.add_argument("--only", nargs="+", choices=(*BENCHMARKS, "peer"), metavar="NAME",
                        help=f"run only these ({', '.join(BENCHMARKS)}, peer)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    runs = {name: SCRIPTS.get(name, (name, [])) for name in BENCHMARKS}
    if args.timm_repo is not None:
        runs["peer"] = ("peer", ["--timm-repo", str(args.timm_repo)])
    if args.only:
        runs = {name: options for name, options in runs.items() if name in args.only}
    if args.json_dir is not None:
        args.json_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    for name, (script, options) in runs.items():
        if args.json_dir is not None:
            options = [*options, "--json", str(args.json_dir / f"{name}.json")]
        print(f"## {name}\n", flush=True)
        if subprocess.run([sys.executable, str(HERE / f"{script}.py"), *options], cwd=HERE).returncode:
            failed.append(name)
            print(f"{name}: FAILED (see its stderr above)")
        print(flush=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
