"""Move the champion alias of the pipeline's registered model to a version, by hand.

The lineage stage moves `tracking.candidate_alias` to every result and `tracking.champion_alias` only to a result
trained on the whole data set that beats the champion's top-1 on the same val set (tracking.lineage,
`champion_verdict`). Anything else, a result on new data or a choice the rule cannot make, is promoted here:

    python -m coarse2fine.promote 7            # version 7 of params' tracking.registered_model
    python -m coarse2fine.promote candidate    # the version the candidate alias is on

The store is the pipeline's (MLFLOW_TRACKING_URI, else ./mlflow.db), the names are params.yaml's tracking section.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from coarse2fine import cli
from coarse2fine.config import load_params
from coarse2fine.errors import UserError


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m coarse2fine.promote", description=__doc__.splitlines()[0])
    parser.add_argument("version", help="a version number of the registered model, or an alias (e.g. candidate)")
    parser.add_argument("--params", default="params.yaml", help="names the model and aliases (default: params.yaml)")
    args = parser.parse_args(argv)
    try:
        print(promote(args.params, args.version))
    except UserError as error:
        cli.print_user_error(error)
        sys.exit(cli.USER_ERROR_EXIT)


def promote(params_file: str, version: str) -> str:
    """Move the champion alias to `version`; one line saying where it now points. A UserError names what is
    missing (the store, the model, the version or the alias)."""
    tracking = load_params(params_file, check_model_names=False).tracking
    # MLflow's import (seconds), paid only here.
    from mlflow.exceptions import MlflowException

    from coarse2fine.tracking.identity import sqlite_database, tracking_uri
    from coarse2fine.tracking.lineage import promote as move_alias
    from coarse2fine.errors import first_line
    from coarse2fine.tracking.mlflow_store import opened_store

    uri = tracking_uri()
    database = sqlite_database(uri)
    if database is not None and not database.is_file():
        raise UserError(f"no MLflow store at {database}: run the pipeline first, or set MLFLOW_TRACKING_URI")
    try:
        with opened_store(uri) as client:
            return move_alias(client, tracking.registered_model, tracking.champion_alias, version)
    except MlflowException as error:
        raise UserError(f"cannot promote {tracking.registered_model!r} {version!r} at {uri}: {first_line(error)}") \
            from None


if __name__ == "__main__":
    main()
