"""`python -m coarse2fine.predict MODEL IMAGE_OR_DIR... [--json]`: the top-5 classes of images, by a trained model.

MODEL is a model file (`models/finetune/model.pt`) or a model the training stages logged to this project's MLflow
store (`models:/coarse2fine@champion`, `models:/<name>/<version>`, `runs:/<run>/model`; the store is
MLFLOW_TRACKING_URI or ./mlflow.db). Images are files of any format PIL reads, or directories, walked recursively
in sorted order with hidden files and folders skipped. Each image is prepared as its record was for the model's
validation: RGB as the convert stage makes it (transparent pixels on white, EXIF orientation ignored), then the
model's own eval transform (data.transforms.eval_transform: resize, centre crop, normalise). A file that cannot be read
as an image is reported with the reason and the others are still predicted; the exit code is 0 when at least one
image was predicted, 2 (one `error:` line) when none was or the model cannot be loaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch
from PIL import Image, UnidentifiedImageError

from coarse2fine import checkpoints, cli, distributed
from coarse2fine.data.convert import DECODE_ERRORS, on_white_rgb
from coarse2fine.data.transforms import IMAGE_MEAN, IMAGE_STD, eval_transform
from coarse2fine.data.torch_backend import to_normalised_tensor, val_resize_and_crop
from coarse2fine.errors import UserError
from coarse2fine.evaluate import TOP_K
from coarse2fine.tracking.logged_model import load_logged_model

MLFLOW_URI_SCHEMES = ("models:/", "runs:/")


@dataclass(frozen=True)
class Prediction:
    image: str
    top5: list[tuple[str, float]]  # (class, probability), most probable first; fewer with fewer classes


@dataclass(frozen=True)
class Unreadable:
    image: str
    reason: str


class EvalTransform:
    """A recorded eval transform applied to an RGB PIL image: the torch val loader's steps
    (torch_backend.ValTransform), built from the model's record instead of from the loader's settings."""

    def __init__(self, spec: dict[str, Any], model_ref: str):
        if list(spec["mean"]) != list(IMAGE_MEAN) or list(spec["std"]) != list(IMAGE_STD):
            raise UserError(
                f"{model_ref}: normalises with mean {spec['mean']}, std {spec['std']}; this project's loaders only "
                f"with {list(IMAGE_MEAN)}, {list(IMAGE_STD)}"
            )
        self.resize_and_crop = val_resize_and_crop(spec["img_size"], spec["crop_pct"], spec["interpolation"])

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return to_normalised_tensor(self.resize_and_crop(image))


class Predictor:
    """A trained model in eval mode, its class names and its eval transform."""

    def __init__(self, model_ref: str, device: torch.device):
        self.device = device
        if model_ref.startswith(MLFLOW_URI_SCHEMES):
            self.model, card = load_logged_model(model_ref, device)  # torch.export's module: already in eval mode
            spec = card["eval_transform"]
        else:
            card = checkpoints.read_model_file(model_ref, device)
            self.model = checkpoints.model_from_payload(card, model_ref, device)
            spec = card.get("eval_transform") or _assumed_eval_transform(model_ref, card["img_size"])
        self.classes: list[str] = card["classes"]
        self.transform = EvalTransform(spec, model_ref)

    def predict(self, paths: Iterable[Path], batch_size: int) -> Iterator[Prediction | Unreadable]:
        """Each unreadable path as soon as it is met, the predictions batch by batch."""
        batch: list[tuple[Path, torch.Tensor]] = []
        for path in paths:
            try:
                batch.append((path, self.transform(open_rgb(path))))
            except UnreadableImage as error:
                yield Unreadable(str(path), str(error))
            if len(batch) == batch_size:
                yield from self._predict_batch(batch)
                batch = []
        if batch:
            yield from self._predict_batch(batch)

    def _predict_batch(self, batch: list[tuple[Path, torch.Tensor]]) -> list[Prediction]:
        images = torch.stack([image for _, image in batch]).to(self.device)
        with torch.inference_mode():
            probabilities = self.model(images).float().softmax(dim=1)
        best = probabilities.topk(min(TOP_K, len(self.classes)), dim=1)
        return [
            Prediction(str(path), [(self.classes[label], probability) for label, probability in zip(labels, values)])
            for (path, _), labels, values in zip(batch, best.indices.tolist(), best.values.tolist())
        ]


def _assumed_eval_transform(model_file: str, img_size: int) -> dict[str, Any]:
    """Model files written before the eval transform was recorded: the params' defaults (val_crop_pct 1.0,
    augment.interpolation bicubic), said once."""
    print(
        f"warning: {model_file} does not record its eval transform (an older model file): assuming a {img_size} px "
        f"centre crop (crop_pct 1.0) and bicubic resizing, the params' defaults",
        file=sys.stderr,
    )
    return eval_transform(img_size, 1.0, "bicubic")


class UnreadableImage(Exception):
    """A file that is not an image PIL can decode; the message is the reason."""


def open_rgb(path: Path) -> Image.Image:
    """The image, fully decoded, as RGB the way the convert stage makes records of it."""
    try:
        file = open(path, "rb")
    except OSError as error:
        raise UnreadableImage(error.strerror or type(error).__name__) from None
    try:
        with file, Image.open(file) as image:
            image.load()  # Image.open reads only the header: decode everything so truncation shows here
            return on_white_rgb(image)
    except UnidentifiedImageError:
        raise UnreadableImage("not an image PIL can read") from None
    except DECODE_ERRORS as error:
        raise UnreadableImage(f"cannot decode: {type(error).__name__}: {error}") from None


def image_files(inputs: Sequence[str | Path]) -> Iterator[Path]:
    """Each input that is not a directory (a missing one is reported unreadable later), and the visible files under
    each directory, recursively, sorted."""
    for path in map(Path, inputs):
        if path.is_dir():
            found = (file for file in path.rglob("*") if file.is_file() and not _hidden(file.relative_to(path)))
            yield from sorted(found)
        else:
            yield path


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def choose_device(name: str) -> torch.device:
    """`auto`: the device a stage would use (coarse2fine.distributed: CUDA when there is one)."""
    return torch.device("cpu") if name == "cpu" else distributed.init().device


def run(args: argparse.Namespace) -> None:
    predictor = Predictor(args.model, choose_device(args.device))
    predictions, unreadable = [], []
    for result in predictor.predict(image_files(args.images), args.batch_size):
        if isinstance(result, Unreadable):
            unreadable.append(result)
            print(f"unreadable: {result.image}: {result.reason}", file=sys.stderr, flush=True)
            continue
        predictions.append(result)
        if not args.json:
            print(_text_block(result), flush=True)
    if not predictions:
        found = f"no readable image ({len(unreadable)} unreadable, listed above)" if unreadable else "no files"
        raise UserError(f"{' '.join(map(str, args.images))}: {found}")
    if args.json:
        json.dump(_json_document(predictions, unreadable), sys.stdout, indent=2, ensure_ascii=False)
        print()


def _text_block(prediction: Prediction) -> str:
    width = max(len(name) for name, _ in prediction.top5)
    lines = [f"  {name:<{width}}  {100 * probability:6.2f} %" for name, probability in prediction.top5]
    return "\n".join([prediction.image, *lines])


def _json_document(predictions: list[Prediction], unreadable: list[Unreadable]) -> dict[str, list]:
    return {
        "predictions": [
            {"image": entry.image, "top5": [{"class": name, "probability": p} for name, p in entry.top5]}
            for entry in predictions
        ],
        "unreadable": [{"image": entry.image, "reason": entry.reason} for entry in unreadable],
    }


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m coarse2fine.predict", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model file (models/<stage>/model.pt) or models:/<name>@<alias>")
    parser.add_argument("images", nargs="+", metavar="IMAGE_OR_DIR", help="image files or directories of them")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout instead of text")
    parser.add_argument("--batch-size", type=_positive_int, default=64, help="images per forward (default: 64)")
    parser.add_argument("--device", choices=("auto", "cpu"), default="auto", help="auto: CUDA when available")
    args = parser.parse_args(argv)
    try:
        run(args)
    except UserError as error:
        cli.print_user_error(error)
        sys.exit(cli.USER_ERROR_EXIT)


if __name__ == "__main__":
    main()
