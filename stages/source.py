"""List the source images (params data.source, data.root) into data/source.json: what convert reads; each
training stage's weights file (<stage>.weights with mode import, or <stage>.init_weights) into
data/<stage>_source.json (teacher, pretrain, finetune); and imported token labels (token_labels.mode,
token_labels.import_dir) into data/token_labels_source.json, or there that no student learns from token labels
(pretrain/finetune.token_label.enabled): token_labels then writes an empty store.

dvc.yaml runs this stage at every `dvc repro` (always_changed): it stats every file under the data root, so
an image added, removed or replaced changes data/source.json and reruns convert and what follows, while an
unchanged tree writes the same bytes and leaves every later stage cached. It only lists files, so it runs as
plain `python` (torchrun's start-up would cost more than the listing).
"""

import argparse
import json
from pathlib import Path

from coarse2fine import cli, files
from coarse2fine.config import Params
from coarse2fine.data.listing import source_state, token_labels_state, weights_state


def main(params: Params, args: argparse.Namespace) -> None:
    listings = (
        (args.out, source_state(params.data)),
        (args.teacher_out, weights_state("teacher", params.teacher)),
        (args.pretrain_out, weights_state("pretrain", params.pretrain)),
        (args.finetune_out, weights_state("finetune", params.finetune)),
        (args.labels_out, token_labels_state(params)),
    )
    for path, state in listings:
        with files.atomic_path(path) as temporary:
            temporary.write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    parser = cli.stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/source.json"), help="default: data/source.json")
    parser.add_argument(
        "--teacher-out", type=Path, default=Path("data/teacher_source.json"), help="default: data/teacher_source.json"
    )
    for stage in ("pretrain", "finetune"):
        parser.add_argument(
            f"--{stage}-out", type=Path, default=Path(f"data/{stage}_source.json"),
            help=f"default: data/{stage}_source.json",
        )
    parser.add_argument(
        "--labels-out", type=Path, default=Path("data/token_labels_source.json"),
        help="default: data/token_labels_source.json",
    )
    cli.run(main, parser, check_model_names=False)  # no model here; every later stage checks them
