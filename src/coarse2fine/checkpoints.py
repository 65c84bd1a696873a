"""One home for a checkpoint's keys: the weights files a user hands the pipeline (safetensors, state dicts,
training checkpoints: which of their keys hold the weights, the EMA's or not), fitting them into a model (another
class count: a new head; another input size: the position embedding resampled as the reference does), the final
model file's payload, and torch files written atomically and read safely (weights_only=True).

Knows nothing of data or tracking; training/weights.py turns a stage's params into these calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import timm
import torch
from timm.layers import resample_abs_pos_embed, resample_abs_pos_embed_nhwc
from timm.models.volo import VOLO
from torch import nn

from coarse2fine.config import CUSTOM_LAYOUT_KEYS, CUSTOM_MODEL, Model, flatten, parse_model
from coarse2fine.errors import UserError, first_line
from coarse2fine.files import atomic_path
from coarse2fine.models import build_model


def load_weights(
    model: nn.Module, path: str | Path, what: str, *, new_classes: bool = False, use_ema: bool = False
) -> LoadReport:
    """Load a local weights file into `model` and say what was done (`LoadReport`): .safetensors, or anything torch
    saved that holds a state dict (plain, or a training checkpoint's, timm's and sail-sg/volo's: "state_dict", else
    "model", or with `use_ema` its EMA weights where it has them; wrapper prefixes stripped: timm's
    `load_state_dict`), with weights_only=True.
    Strict but for the input size and, with `new_classes`, the classifier (`fit_state_dict`). A missing,
    unreadable or ill-fitting file is a one-line UserError starting with `what` and the path."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what}: {path}: weights file not found")
    try:
        state = timm.models.load_state_dict(str(path), use_ema=use_ema, weights_only=True)
    except (OSError, MemoryError):
        raise
    except Exception as error:  # safetensors, pickle and torch errors of every kind for a bad file
        raise UserError(f"{what}: {path}: not a readable weights file: {_why_unreadable(path, error)}") from None
    return fit_state_dict(model, state, f"{what}: {path}", new_classes=new_classes)


# The first bytes of each format torch and safetensors write.
TORCH_ZIP_MAGIC = b"PK\x03\x04"  # torch.save since 1.6: a zip archive
PICKLE_MAGIC = b"\x80"  # torch.save before 1.6 (_use_new_zipfile_serialization=False): a pickle stream
SAFETENSORS_HEADER_START = 8  # a little-endian u64 header length, then the JSON header: "{"


def _why_unreadable(path: Path, error: Exception) -> str:
    """Why a weights file did not load, from its first bytes and the loader's error."""
    with open(path, "rb") as file:
        head = file.read(SAFETENSORS_HEADER_START + 1)
    if not head:
        return "the file is empty"
    reason = f"{type(error).__name__}: {first_line(error)}"
    if head[SAFETENSORS_HEADER_START:] == b"{":
        return f"a truncated or corrupt safetensors file ({reason})"
    if not head.startswith((TORCH_ZIP_MAGIC, PICKLE_MAGIC)):
        return f"unknown format (neither safetensors nor a file torch saved; first bytes {head[:4]!r})"
    if "weights_only" in str(error):  # torch names the objects weights_only loading refuses to unpickle
        return f"it pickles Python objects besides tensors: save the model's state_dict(), not the model ({reason})"
    return f"a truncated or corrupt torch file ({reason})"


@dataclass
class LoadReport:
    """What `fit_state_dict` did with each tensor that did not load as it was."""

    loaded: int = 0
    resampled: list[str] = field(default_factory=list)  # "pos_embed 3x3 -> 4x4"
    reset: list[str] = field(default_factory=list)  # classifier tensors left as initialised (another class count)

    def lines(self, source: str | Path) -> list[str]:
        lines = [f"loaded {self.loaded} tensors from {source}"]
        lines += [f"resampled {entry}" for entry in self.resampled]
        if self.reset:
            lines.append(f"not loaded (another class count; freshly initialised): {', '.join(self.reset)}")
        return lines


def fit_state_dict(
    model: nn.Module, state: dict[str, torch.Tensor], source: str | Path, *, new_classes: bool = False
) -> LoadReport:
    """Load weights of the same architecture into `model`, which may take another input size.

    A position embedding of another grid is resampled with timm's helpers (VOLO's NHWC one, plain bicubic as the
    reference; ViT's keeping its prefix tokens, antialiased as timm's own checkpoint filter). With `new_classes`,
    classifier tensors of another class count keep their initialisation.
    Nothing is dropped silently: those keys are in the report, and any other key missing, unexpected or
    misshapen is a UserError naming `source`, the class counts and the keys.
    """
    expected = model.state_dict()
    report, fitted, misshapen = LoadReport(), {}, []
    classifiers = _classifier_prefixes(model)
    for key, target in expected.items():
        if key not in state:
            continue
        value = state[key]
        if value.shape == target.shape:
            fitted[key] = value
        elif key.endswith("pos_embed") and (resampled := _resample_pos_embed(model, value, target)) is not None:
            fitted[key] = resampled
            report.resampled.append(f"{key} {_grid(value, model)} -> {_grid(target, model)}")
        elif new_classes and key.startswith(classifiers) and value.shape[1:] == target.shape[1:]:
            report.reset.append(key)
        else:
            misshapen.append(f"{key} {tuple(value.shape)} vs {tuple(target.shape)}")
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    if missing or unexpected or misshapen:
        problems = [
            f"{label} {len(keys)}: {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}"
            for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape (file vs model)", misshapen))
            if keys
        ]
        raise UserError(
            f"{source} does not fit {type(model).__name__} with {_num_classes(model)} classes "
            f"({'; '.join(problems)}): a file for another architecture or class count?"
        )
    model.load_state_dict(fitted, strict=False)
    report.loaded = len(fitted)
    return report


def _classifier_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The classifier's parameter prefixes, as timm's pretrained config names them (VOLO's aux head too)."""
    classifier = (getattr(model, "pretrained_cfg", None) or {}).get("classifier", "head")
    names = (classifier,) if isinstance(classifier, str) else tuple(classifier)
    if isinstance(model, VOLO):
        names += ("aux_head",)
    return tuple(f"{name}." for name in names)


def _prefix_tokens(model: nn.Module) -> int:
    """Tokens of a ViT's pos_embed that are not on the patch grid (class/register tokens)."""
    return 0 if getattr(model, "no_embed_class", False) else getattr(model, "num_prefix_tokens", 0)


def _resample_pos_embed(model: nn.Module, value: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
    if value.ndim == 4:  # VOLO: [1, H, W, C]
        # Plain bicubic, as sail-sg/volo's utils.resize_pos_embed_4d (F.interpolate(mode="bicubic")): timm's helper
        # antialiases by default, which gives other values up (renormalised borders) and far other ones down.
        return resample_abs_pos_embed_nhwc(value, new_size=list(target.shape[1:3]), antialias=False)
    patch_embed = getattr(model, "patch_embed", None)
    if value.ndim == 3 and hasattr(patch_embed, "grid_size"):  # ViT: [1, prefix + H x W, C]
        return resample_abs_pos_embed(
            value, new_size=list(patch_embed.grid_size), num_prefix_tokens=_prefix_tokens(model)
        )
    return None


def _grid(pos_embed: torch.Tensor, model: nn.Module) -> str:
    if pos_embed.ndim == 4:
        return f"{pos_embed.shape[1]}x{pos_embed.shape[2]}"
    side = round((pos_embed.shape[1] - _prefix_tokens(model)) ** 0.5)
    return f"{side}x{side}"


def _num_classes(model: nn.Module) -> int | str:
    return getattr(model, "num_classes", "?")


MODEL_FILE_KEYS = ("model", "model_cfg", "img_size", "classes", "stage")


def save_model_file(
    path: str | Path, model: nn.Module, *, model_cfg: Model, img_size: int, classes: Sequence[str], stage: str,
    eval_transform: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the final model file (a plain dict, loadable with weights_only=True) atomically; return its fields
    other than the weights. `eval_transform`: how images are preprocessed for it (data.transforms.eval_transform);
    files written before it was recorded lack the key."""
    card = {
        "model_cfg": flatten(model_cfg),  # tuples as lists
        "img_size": img_size,
        "classes": list(classes),
        "stage": stage,
    }
    if eval_transform is not None:
        card["eval_transform"] = eval_transform
    atomic_save({"model": model.state_dict(), **card}, path)
    return card


def read_model_file(path: str | Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """The model file's fields (weights under "model"); a missing, corrupt or foreign file is a UserError."""
    payload = load_file(path, "model file", device)
    if not isinstance(payload, dict) or not set(MODEL_FILE_KEYS) <= payload.keys():
        raise UserError(f"{path}: not a model file (expected the keys {', '.join(MODEL_FILE_KEYS)})")
    return payload


def load_model_file(
    path: str | Path, device: torch.device | str = "cpu", img_size: int | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """The model (in eval mode, on `device`) and the file's other fields. `img_size`: rebuild it for that input
    size (the position embedding resampled) instead of the one it was trained at."""
    payload = read_model_file(path, device)
    return model_from_payload(payload, path, device, img_size), {k: v for k, v in payload.items() if k != "model"}


def model_from_payload(
    payload: dict[str, Any], path: str | Path, device: torch.device | str = "cpu", img_size: int | None = None
) -> nn.Module:
    """The model of a `read_model_file` payload (in eval mode, on `device`), at `img_size` or its own size."""
    try:
        model_cfg = parse_model(_current_model_record(payload["model_cfg"]), strict=False)  # lists back to tuples
        model = build_model(model_cfg, len(payload["classes"]), img_size or payload["img_size"])
    except ValueError as error:  # a bad model_cfg
        raise UserError(f"{path}: inconsistent model file: {first_line(error)}") from None
    fit_state_dict(model, payload["model"], path)
    return model.to(device).eval()


def init_from_model_file(model: nn.Module, model_cfg: Model, path: str | Path) -> LoadReport:
    """Start `model` (built from `model_cfg`, at any input size) from the weights of a model file of the same
    architecture, e.g. fine-tuning at a higher resolution from the pre-trained model."""
    payload = read_model_file(path)
    ours = {key: value for key, value in flatten(model_cfg).items() if key not in TRAINING_ONLY_MODEL_KEYS}
    theirs = {key: value for key, value in payload["model_cfg"].items() if key not in TRAINING_ONLY_MODEL_KEYS}
    differences = [f"{key} {theirs.get(key)!r} vs {value!r}" for key, value in ours.items() if theirs.get(key) != value]
    if differences:
        raise UserError(
            f"{path}: another architecture than model.* ({'; '.join(differences)}; file vs params): rerun the stage "
            f"that wrote it"
        )
    return fit_state_dict(model, payload["model"], path, new_classes=True)


def _current_model_record(record: dict[str, Any]) -> dict[str, Any]:
    """Files written before the schema was per family recorded the tiny VOLO's layout keys for every model."""
    if record.get("name") == CUSTOM_MODEL:
        return record
    return {key: value for key, value in record.items() if key not in CUSTOM_LAYOUT_KEYS}


# Model keys that change how a model trains, not its weights' layout.
TRAINING_ONLY_MODEL_KEYS = frozenset({"drop_path", "dropout"})


def atomic_save(obj: Any, path: str | Path) -> None:
    """torch.save to a temporary file beside `path`, read it back, then rename: a crash never leaves a half-written
    file, and a file the storage garbled or cut short never replaces the last good one (a checkpoint: the run it
    would resume). Read back memory-mapped: the archive and every tensor record are checked, not copied."""
    with atomic_path(path) as temporary:
        with open(temporary, "wb") as file:  # a file object: a failed write's OSError stays behind torch's error
            torch.save(obj, file)
        try:
            torch.load(temporary, map_location="cpu", weights_only=True, mmap=True)
        except (OSError, MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as error:  # what a bad file raises (load_file): RuntimeError, UnpicklingError, EOFError...
            raise UserError(
                f"{path}: the file just written does not read back ({first_line(error)}); the previous one is kept: "
                f"check the file system and rerun"
            ) from None


def existing_file(path: str | Path, what: str) -> Path:
    """`path`, or a UserError if there is no such file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: {what} not found")
    return path


def load_file(path: str | Path, what: str, device: torch.device | str = "cpu") -> Any:
    """torch.load(weights_only=True) of a file the user handed us; a missing or corrupt file is a UserError
    naming it. A failure to read it (an I/O error, no memory) is not the file's fault and propagates as is."""
    path = existing_file(path, what)
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except (OSError, MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as error:  # torch raises KeyError, EOFError, RuntimeError, UnpicklingError... for bad files
        raise UserError(f"{path}: not a readable {what} ({type(error).__name__}: {first_line(error)})") from None
