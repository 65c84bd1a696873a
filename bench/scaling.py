"""Throughput of the pretrain stage as it leaves one process and one node: 1 process, 2 processes on one node, and
2 nodes of 1 process each (two torchrun agents on this machine meeting at a c10d rendezvous, as two hosts
would), all through the launcher as dvc.yaml runs the stage, on the same records at the same global batch.

Each layout's figure is its last epoch's `train_img_per_s` (every rank's images per second) and
`train_img_per_s_per_rank` from the stage's metrics; the layouts run one after another, in rotating order over
--repeats, and the table gives medians and the ratio to one process. Every layout gets all the machine's cores
(OMP_NUM_THREADS = cores / ranks): on one machine the ranks split the same cores, so the ratio measures what
data parallelism costs or gains over intra-op threads there, not how it scales across machines.

Run: python bench/scaling.py [--epochs N] [--repeats R] [--layouts NAME ...] [--workdir DIR] [--json PATH] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from _common import (
    TINY_DIGITS, ProjectCopy, add_tiny_argument, header_line, markdown_table, project_copy, tiny_sizes, workspace,
    write_json,
)

# Layout -> params `launch` (the rendezvous port is filled in per run). The global batch is 64 in each.
LAYOUTS = {
    "1 node x 1 process": ({"nproc_per_node": 1}, 64),
    "1 node x 2 processes": ({"nproc_per_node": 2}, 32),
    "2 nodes x 1 process (c10d)": ({"nnodes": 2, "nproc_per_node": 1}, 32),
}
REFERENCE, *MULTI_PROCESS = LAYOUTS


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3, help="pretrain epochs per run; the last one is timed")
    parser.add_argument("--repeats", type=int, default=2, help="runs per layout (default: 2)")
    parser.add_argument("--layouts", nargs="+", choices=MULTI_PROCESS, default=MULTI_PROCESS, metavar="NAME",
                        help=f"the layouts run beside {REFERENCE} (always run: the ratios' reference), of: "
                             f"{'; '.join(MULTI_PROCESS)} (default: all)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the project copy here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report and numbers here")
    add_tiny_argument(parser, f"bench/optimizers.py --tiny's copy (data.subset {TINY_DIGITS['data']['subset']:g}, "
                              f"model.patch_size {TINY_DIGITS['model']['patch_size']}; reused from the same --workdir), "
                              "--epochs 1, --repeats 1")
    args = parser.parse_args()
    tiny_sizes(parser, args, epochs=1, repeats=1)
    return args


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_layout(project: ProjectCopy, name: str, epochs: int, out: Path) -> dict:
    """The pretrain stage under `name`'s layout (one launcher per node); its last epoch's throughputs."""
    launch, batch_size = LAYOUTS[name]
    launch = {**launch, "rdzv_endpoint": f"127.0.0.1:{free_port()}"}
    shutil.rmtree(out, ignore_errors=True)  # a kept --workdir's earlier run
    out.mkdir(parents=True)
    params = yaml.safe_load((project.path / "params.yaml").read_text())
    params.update(launch=launch)
    params["pretrain"].update(epochs=epochs, batch_size=batch_size, token_label={"enabled": False})
    (out / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    command = [
        sys.executable, "-m", "coarse2fine.launch", "stages/pretrain.py", "--params", str(out / "params.yaml"),
        "--records", "data/records", "--token-labels", str(out / "none"), "--checkpoint-dir", str(out / "ckpt"),
        "--out", str(out / "model"), "--metrics", str(out / "metrics"),
    ]
    world = launch.get("nnodes", 1) * launch["nproc_per_node"]  # every rank runs on this machine
    threads = max(1, (os.cpu_count() or 1) // world)  # each layout uses all the cores, split between its ranks
    env = {**project.env, "MLFLOW_TRACKING_URI": f"sqlite:///{out / 'mlflow.db'}", "PYTHONPATH": "src",
           "OMP_NUM_THREADS": str(threads)}
    agents = [subprocess.Popen(command, cwd=project.path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True) for _ in range(launch.get("nnodes", 1))]
    for agent in agents:
        _, stderr = agent.communicate(timeout=3600)
        if agent.returncode:
            raise RuntimeError(f"{name}: the stage failed:\n{stderr[-3000:]}")
    metrics = json.loads((out / "metrics" / "metrics.json").read_text())
    return {"global": metrics["train_img_per_s"], "per_rank": metrics["train_img_per_s_per_rank"]}


def main() -> None:
    args = parse_args()
    names = [REFERENCE, *args.layouts]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with workspace(args.workdir) as work:
        digits = {"data": {"source": "digits"}, "pretrain": {"img_size": 32}}
        project = project_copy(work, TINY_DIGITS if args.tiny else digits)
        project.repro("convert")
        for repeat in range(args.repeats):
            for offset in range(len(names)):
                name = names[(repeat + offset) % len(names)]
                runs[name].append(run_layout(project, name, args.epochs, work / f"{repeat}-{names.index(name)}"))
    medians = {name: {key: statistics.median(run[key] for run in runs[name]) for key in ("global", "per_rank")}
               for name in names}
    base = medians[names[0]]["global"]
    rows = [[name, f"{value['global']:.0f}", f"{value['per_rank']:.0f}", f"{value['global'] / base:.2f}"]
            for name, value in medians.items()]
    text = "\n".join([
        header_line(),
        f"pretrain stage, digits{' (--tiny: a tenth, patch 8)' if args.tiny else ''} at 32 px, "
        f"global batch 64, last of {args.epochs} epochs, median of {args.repeats}",
        "",
        markdown_table(["layout", "img/s (global)", "img/s per rank", "vs 1 process"], rows),
    ])
    print(text)
    write_json(args, text, {"runs": runs, "medians": medians})


if __name__ == "__main__":
    main()
