"""A trained model as an MLflow model: logged by its training run, loaded back by predict."""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from importlib.metadata import version
from typing import Any

import mlflow
import numpy as np
import torch
from mlflow.exceptions import MlflowException
from torch import nn

from coarse2fine.errors import UserError
from coarse2fine.tracking.identity import sqlite_database, tracking_uri
from coarse2fine.errors import first_line

logger = logging.getLogger(__name__)


def imported_mlflow_pytorch():
    """mlflow.pytorch, imported without its side effect on logging: its Lightning module calls
    `logging.basicConfig(level=logging.ERROR)` at import, which would silence every later warning of this project
    (they reach stderr through logging's last resort, root having no handler), e.g. a model that was not logged."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    import mlflow.pytorch

    root.handlers[:] = handlers
    root.setLevel(level)
    return mlflow.pytorch


def log_model(run_id: str, stage: str, model: nn.Module, card: Mapping[str, Any]) -> str | None:
    """`model` as an MLflow model of the run (`mlflow.pytorch.log_model`) in its "pt2" format (torch.export: the
    graph and tensors, loaded without unpickling any code), with a signature ([batch, 3, S, S] images -> [batch,
    classes] logits), an input example and the model file's fields (`card`: classes, eval_transform, ...) as
    metadata. Returns its model id; None, after one warning, when torch.export or the store refused it."""
    mlflow_pytorch = imported_mlflow_pytorch()  # about 1 s that only the stages logging a model pay
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    side = card["img_size"]
    exported = copy.deepcopy(model).cpu().eval()  # CPU weights load anywhere; the copy leaves training alone
    example = torch.zeros(2, 3, side, side)  # batch 2: a batch of 1 would be exported as a fixed size
    signature = ModelSignature(
        inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, 3, side, side), "images")]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, len(card["classes"])), "logits")]),
    )
    try:
        with mlflow.start_run(run_id=run_id):
            info = mlflow_pytorch.log_model(
                exported, name="model", signature=signature, input_example=example.numpy(),
                serialization_format="pt2", metadata=dict(card),
                # Pinned from this environment, not inferred (inference imports the model's whole stack).
                pip_requirements=[f"{name}=={version(name)}" for name in ("torch", "timm")],
                # MLflow would check the example through its pyfunc server path, whose PyTorch flavor takes no
                # JSON tensor inputs: a warning on every run about a path this project does not use.
                validate_serving_input=False,
            )
    except Exception as error:  # torch.export refusing the model's code, or the store failing
        logger.warning(
            "warning: %s: the model was not logged to MLflow (%s); the model file holds it", stage, first_line(error)
        )
        return None
    return info.model_id


def load_logged_model(uri: str, device: torch.device | str = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """A model `log_model` logged (`models:/<name>@<alias>`, `models:/<name>/<version>`, `models:/<id>`,
    `runs:/<run>/model`) from this project's store, and its card (classes, img_size, eval_transform, stage).

    Its "pt2" archive is checked by MLflow to hold only tensors and plain data before torch.export loads it:
    no code is unpickled (unless MLFLOW_ALLOW_PICKLE_DESERIALIZATION=true is set). A missing name, alias or
    version is a UserError."""
    mlflow_pytorch = imported_mlflow_pytorch()
    uri_of_store = tracking_uri()
    database = sqlite_database(uri_of_store)
    if database is not None and not database.is_file():
        raise UserError(
            f"{uri}: no MLflow store at {uri_of_store} (run the pipeline first, or set MLFLOW_TRACKING_URI)"
        )
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    mlflow.set_tracking_uri(uri_of_store)
    try:
        card = mlflow.models.get_model_info(uri).metadata or {}
        model = mlflow_pytorch.load_model(uri, device=str(device))
    except MlflowException as error:
        raise UserError(f"{uri}: cannot load it from {uri_of_store}: {first_line(error)}") from None
    if "classes" not in card or "eval_transform" not in card:
        raise UserError(f"{uri}: not logged by this project (its metadata lacks classes and eval_transform)")
    return model, card
