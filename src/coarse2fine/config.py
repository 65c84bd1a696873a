"""The params.yaml schema: the single source of truth for every knob.

Every stage loads and validates the whole file once at start (`load_params`); a user mistake becomes one
line naming the key path and the problem (`ParamsError`), which `stages/*` turn into exit code 2 before
any heavy work. Modules receive the typed objects below and never read params.yaml themselves.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, TypeAdapter, ValidationError, ValidationInfo, field_validator,
    model_validator,
)

from coarse2fine.errors import UserError
from coarse2fine.files import atomic_path
from coarse2fine.mesh import ParallelDims

CUSTOM_MODEL = "volo_custom"
# Validation context key: False skips the check of model names against timm's registry, which imports timm
# (seconds of start-up): for the `source` stage, which runs at every `dvc repro` and builds no model.
CHECK_MODEL_NAMES = "check_model_names"


@functools.cache
def timm_model_names() -> frozenset[str]:
    """Every architecture timm can build. Listing them imports timm (2 s); this installation's list is kept in the
    user's cache, so a stage that builds no model (convert) checks the names without importing timm."""
    cache = _model_names_cache()
    with contextlib.suppress(OSError):
        return frozenset(cache.read_text(encoding="utf-8").split())
    import timm

    names = frozenset(timm.list_models())
    with contextlib.suppress(OSError):  # a read-only home only costs the next stage the import
        cache.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(cache) as temporary:
            temporary.write_text("\n".join(sorted(names)), encoding="utf-8")
    return names


def _model_names_cache() -> Path:
    """A file per timm installation: its version, where it is and when a model module of it was last written (an
    editable checkout keeps its version while its models change)."""
    package = Path(importlib.util.find_spec("timm").origin).parent  # found, not imported
    written = max(path.stat().st_mtime_ns for path in package.glob("models/*.py"))
    key = f"{importlib.metadata.version('timm')} {package} {written}"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "coarse2fine" / f"timm-models-{hashlib.sha256(key.encode()).hexdigest()[:16]}.txt"


def has_token_outputs(name: str) -> bool:
    """VOLO has a prediction per token (its aux head): token labeling and MixToken need one. timm names every
    VOLO architecture volo_* (tests/test_models.py checks that against its registry)."""
    return name == CUSTOM_MODEL or name.startswith("volo_")


class ParamsError(UserError):
    """A bad params.yaml; the message is one line per problem, each naming the key path."""


class Section(BaseModel):
    # Unknown keys are errors (a typo must not silently fall back to a default); no type coercion
    # beyond int->float, so `lr: "1e-3"` is reported rather than guessed.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Launch(Section):
    """Where a stage's processes run; coarse2fine.launch turns it into torchrun's arguments. Only the world size
    (nnodes x nproc_per_node) changes a result, the global batch and so the LR of the training stages, which list
    both keys; the rest says where the ranks meet and how often torchrun restarts them."""

    # local: this machine runs the stage (nnodes 1: torchrun --standalone); slurm: inside an allocation, `srun`
    # starts one torchrun agent per node and they meet on the allocation's first node (scripts/slurm/); ssh: this
    # machine (where `dvc repro` runs) starts one agent per node of `hosts` over SSH, and they meet on the first
    # (coarse2fine.ssh).
    scheduler: Literal["local", "slurm", "ssh"] = "local"
    nnodes: int = Field(1, gt=0)
    nproc_per_node: int = Field(1, gt=0)
    # ssh: the nodes as ssh reaches them (and as they reach the first for the rendezvous), one per node, in node order.
    hosts: tuple[str, ...] = ()
    rdzv_endpoint: str = Field("127.0.0.1:29500", pattern=r"^[^\s:]+:\d+$")  # host:port (slurm, ssh: its port only)
    rdzv_id: str = Field("coarse2fine", pattern=r"^[A-Za-z0-9_.-]+$")  # slurm: the job id is appended
    max_restarts: int = Field(0, ge=0)  # torchrun restarts the whole group after a failure, the stage resumes
    # auto: a GPU per local rank when torch sees any, else the CPU; cuda: a GPU per local rank or exit 2, never the
    # CPU (a driver too old for torch's CUDA build would otherwise train on the CPU); cpu: the CPU even on a GPU node.
    device: Literal["auto", "cuda", "cpu"] = "auto"

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @model_validator(mode="after")
    def _hosts_for_ssh(self) -> Launch:
        if self.scheduler == "ssh" and len(self.hosts) != self.nnodes:
            raise ValueError(f"hosts: scheduler ssh needs one host per node (nnodes {self.nnodes}), got {list(self.hosts)}")
        if any(not host or any(char.isspace() for char in host) or host.startswith("-") for host in self.hosts):
            raise ValueError(f"hosts: {list(self.hosts)} holds an empty name, a space or a leading '-'")
        return self


class Checkpoint(Section):
    """How often the training stages (teacher, pretrain, finetune) checkpoint inside an epoch, besides at its end;
    how often, never what they compute: no stage lists these keys (changing them reruns nothing, and a checkpoint
    stays resumable). A run resumed from one continues the epoch's sample stream where it stopped: bit-identical to
    an uninterrupted run on a CPU."""

    # A checkpoint once this many minutes have passed since the last (checked every 10 updates, on rank 0's clock);
    # 0: none by time. 30 bounds what a kill costs to 2/3 of a VOLO-D5 ImageNet epoch on one 8-GPU node (about
    # 45 minutes, issue 20) for a few seconds of writing.
    every_minutes: float = Field(30.0, ge=0)
    every_updates: int = Field(0, ge=0)  # a checkpoint every this many optimizer updates; 0: none by count


class Parallel(Section):
    """How a training stage (teacher, pretrain, finetune) spreads its model over the ranks (coarse2fine.parallel):
    a mesh of data x tensor x pipeline ranks (coarse2fine.mesh). On the data dimension, ddp (a whole model per
    rank) or fsdp (FSDP2's fully_shard per block, DCP checkpoints); tensor > 1 splits every attention and MLP of a
    ViT or VOLO over that many ranks; pipeline > 1 gives each rank a consecutive slice of the blocks."""

    strategy: Literal["ddp", "fsdp"] = "ddp"
    data: int = Field(0, ge=0)  # 0: the ranks left, world size / (tensor x pipeline)
    tensor: int = Field(1, gt=0)
    pipeline: int = Field(1, gt=0)
    schedule: Literal["gpipe", "1f1b"] = "1f1b"  # pipeline > 1: torch.distributed.pipelining's schedule
    # pipeline > 1: each rank's batch is split into this many micro-batches; the idle share of a step (the bubble)
    # is (pipeline - 1) / (microbatches + pipeline - 1) under both schedules (GPipe, arXiv:1811.06965).
    microbatches: int = Field(4, gt=0)


class DigitsSource(Section):
    size: int = Field(32, ge=8)  # side of the written images (load_digits is 8x8, upsampled bicubic)
    val_fraction: float = Field(0.2, gt=0, lt=1)


class PhotosSource(Section):
    size: int = Field(64, ge=16)  # shorter side of the written patches (the longer one follows their aspect)
    train_per_class: int = Field(60, gt=0)
    val_per_class: int = Field(15, gt=0)


class Data(Section):
    source: Literal["digits", "photos", "imagefolder"] = "digits"
    root: str = ""  # imagefolder: a tree with train/<class>/* and val/<class>/*
    digits: DigitsSource = DigitsSource()
    photos: PhotosSource = PhotosSource()
    subset: float = Field(1.0, gt=0, le=1)  # fraction kept per class (stratified, seeded)
    train_shards: int = Field(2, gt=0)
    val_shards: int = Field(1, gt=0)
    jpeg_quality: int = Field(95, ge=1, le=100)  # for images that must be re-encoded (PNG, CMYK, ...)
    convert_workers: int = Field(2, gt=0)  # processes per rank for decoding checks / re-encoding

    @model_validator(mode="after")
    def _root_for_imagefolder(self) -> Data:
        if self.source == "imagefolder" and not self.root:
            raise ValueError("root: required when source is 'imagefolder' (path with train/ and val/)")
        return self


class Loader(Section):
    backend: Literal["auto", "dali", "torch"] = "auto"  # auto: DALI if importable, else torch
    workers: int = Field(2, ge=0)  # DALI threads / torch DataLoader workers per rank
    prefetch: int = Field(2, gt=0)  # batches prepared ahead: torch DataLoader workers, DALI on a GPU
    # DALI's train graph. auto: on a GPU all of it in DALI, on a CPU it stops at the decoded crop and the host
    # finishes the batch (1.7x faster there: data/dali_backend.py). all_dali: the GPU's graph wherever it runs, so
    # a CPU can run, and the suite checks, exactly what a GPU runs.
    dali_graph: Literal["auto", "all_dali"] = "auto"
    # Whether DALI's readers map the record files into memory. auto: mapped on a local file system, read with plain
    # file I/O on a network or FUSE one (NFS, Lustre, GPFS, CIFS, ...), as DALI's documentation advises
    # (data/dali_backend.py, `maps_records`); true / false: always / never mapped. The same bytes either way.
    mmap: Literal["auto", True, False] = "auto"


# timm's RandAugment levels run 0..10 (its _LEVEL_DENOM), which is also its default magnitude.
MAX_RAND_AUGMENT_MAGNITUDE = 10
RAND_AUGMENT_SYNTAX = "rand-m<0..10>-n<ops>-mstd<float>-inc<0|1>"
_RAND_AUGMENT_SECTION = re.compile(r"mstd(?P<mstd>\d+(?:\.\d+)?)|inc(?P<inc>[01])|m(?P<m>\d+)|n(?P<n>\d+)")


@dataclass(frozen=True)
class RandAugmentSpec:
    """A timm-style spec "rand-m9-n2-mstd0.5-inc1", parsed; defaults are timm's."""

    text: str
    num_ops: int = 2
    magnitude: int = MAX_RAND_AUGMENT_MAGNITUDE
    magnitude_std: float = 0.0
    increasing: bool = False


def parse_rand_augment(text: str) -> RandAugmentSpec | None:
    """None for "" (off). Only the options both loader backends honour; anything else is a ValueError."""
    if not text:
        return None
    name, *sections = text.split("-")
    if name != "rand":
        raise _unsupported(name, text)
    values: dict[str, str] = {}
    for section in sections:
        match = _RAND_AUGMENT_SECTION.fullmatch(section)
        if match is None:
            raise _unsupported(section, text)
        values.update((key, value) for key, value in match.groupdict().items() if value is not None)
    spec = RandAugmentSpec(
        text=text,
        num_ops=int(values.get("n", 2)),
        magnitude=int(values.get("m", MAX_RAND_AUGMENT_MAGNITUDE)),
        magnitude_std=float(values.get("mstd", 0.0)),
        increasing=values.get("inc") == "1",
    )
    if spec.magnitude > MAX_RAND_AUGMENT_MAGNITUDE:
        raise ValueError(
            f"magnitude m{spec.magnitude} in {text!r} is above timm's maximum {MAX_RAND_AUGMENT_MAGNITUDE}"
        )
    return spec


def _unsupported(part: str, text: str) -> ValueError:
    return ValueError(f"cannot use {part!r} in {text!r} (supported: {RAND_AUGMENT_SYNTAX})")


def check_crop_range(name: str, bounds: tuple[float, float]) -> None:
    low, high = bounds
    if not 0 < low <= high:
        raise ValueError(f"{name}: must be 0 < low <= high (got [{low}, {high}])")


def check_crop_scale(name: str, bounds: tuple[float, float]) -> None:
    """A random-resized-crop area range: a fraction of the image, so at most 1."""
    check_crop_range(name, bounds)
    if bounds[1] > 1:
        raise ValueError(f"{name}: upper bound must be <= 1 (got {bounds[1]})")


class Augment(Section):
    scale: tuple[float, float] = (0.35, 1.0)  # random-resized-crop area fraction
    ratio: tuple[float, float] = (0.75, 4 / 3)  # random-resized-crop aspect ratio
    hflip: float = Field(0.0, ge=0, le=1)  # digits are not flip-invariant; ImageNet uses 0.5
    rand_augment: str = ""  # timm-style spec, e.g. "rand-m9-mstd0.5-inc1"; "" turns it off
    reprob: float = Field(0.0, ge=0, le=1)  # random erasing probability (pixel mode)
    interpolation: Literal["bilinear", "bicubic"] = "bicubic"
    # rand_augment parsed once, here: the params check then catches what the loaders could not honour.
    _rand_augment_spec: RandAugmentSpec | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _ranges(self) -> Augment:
        check_crop_scale("scale", self.scale)
        check_crop_range("ratio", self.ratio)
        try:
            self._rand_augment_spec = parse_rand_augment(self.rand_augment)
        except ValueError as error:
            raise ValueError(f"rand_augment: {error}") from None
        return self

    @property
    def rand_augment_spec(self) -> RandAugmentSpec | None:
        """`rand_augment` parsed; None when it is off."""
        return self._rand_augment_spec


VOLO_PATCH_SIZES = (4, 8, 16)  # the stem strides timm's VOLO is built for
# The keys that set the tiny VOLO's layout: a named timm model has its own, so they cannot apply to it.
CUSTOM_LAYOUT_KEYS = ("layers", "embed_dims", "num_heads", "mlp_ratio", "patch_size")


class ModelFamily(Section):
    """What every model takes: its name and the training-time regularisation."""

    name: str
    drop_path: float = Field(0.0, ge=0, lt=1)  # stochastic depth (timm's drop_path_rate)

    @property
    def has_token_outputs(self) -> bool:
        return has_token_outputs(self.name)

    @property
    def stride(self) -> int | None:
        """Pixels per token of a VOLO (the image side must be a multiple of it); None for other families."""
        return 16 if self.has_token_outputs else None  # timm's VOLOs: a stride-8 stem pooled by 2

    def token_grid(self, img_size: int) -> int | None:
        """The side of a VOLO's token grid at `img_size` (the token-label size S); None for other families."""
        return img_size // self.stride if self.stride else None


class CustomVolo(ModelFamily):
    """The project's VOLO of any size (timm's VOLO class), for tiny images and tests."""

    name: Literal["volo_custom"] = CUSTOM_MODEL
    layers: tuple[int, ...] = (1, 1, 1, 1)
    embed_dims: tuple[int, ...] = (64, 128, 128, 128)
    num_heads: tuple[int, ...] = (2, 4, 4, 4)
    mlp_ratio: float = Field(3.0, gt=0)
    patch_size: int = Field(8, gt=0)  # stem stride; the token grid is img_size / (2 * patch_size)

    @model_validator(mode="after")
    def _layout(self) -> CustomVolo:
        if self.patch_size not in VOLO_PATCH_SIZES:
            raise ValueError(f"patch_size: {self.patch_size} is not one of VOLO's {', '.join(map(str, VOLO_PATCH_SIZES))}")
        if not len(self.layers) == len(self.embed_dims) == len(self.num_heads):
            raise ValueError("layers, embed_dims and num_heads: must have the same length")
        if any(dim % heads for dim, heads in zip(self.embed_dims, self.num_heads)):
            raise ValueError("embed_dims: each must be divisible by its num_heads")
        return self

    @property
    def stride(self) -> int:
        return 2 * self.patch_size


class TimmModel(ModelFamily):
    """Any timm architecture by name (VOLO volo_d1_224 ..., ViT/DeiT, CNNs resnet*, dm_nfnet_* ...), built to timm's
    own layout: only the training knobs below apply."""

    # Dropout after the embeddings and in the blocks' projections (timm's pos_drop_rate and proj_drop_rate, which
    # timm 0.4's `drop_rate` set together: Colossal-AI's ViT uses 0.1); architectures without them refuse it.
    dropout: float = Field(0.0, ge=0, lt=1)
    # CNNs that support it (timm's output_stride, by dilation): 32 is the usual; 16 or 8 give a finer feature
    # map, i.e. a finer token-label grid from a teacher at the same input size. null: the model's own.
    output_stride: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_name_and_no_custom_layout(cls, raw: Any, info: ValidationInfo) -> Any:
        if not isinstance(raw, dict):
            return raw  # pydantic reports the type
        name = raw.get("name")
        # The name first: a misspelt volo_custom or timm name is a typo, not a request for timm's layout.
        check_names = (info.context or {}).get(CHECK_MODEL_NAMES, True)
        if check_names and isinstance(name, str) and name not in timm_model_names():
            close = difflib.get_close_matches(name, [CUSTOM_MODEL, *sorted(timm_model_names())], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else " (see timm.list_models())"
            raise ValueError(f"name: {name!r} is neither {CUSTOM_MODEL} nor a timm model{hint}")
        given = [key for key in CUSTOM_LAYOUT_KEYS if key in raw]
        if given:
            one = len(given) == 1
            raise ValueError(
                f"{', '.join(given)}: set{'s' if one else ''} the layout of {CUSTOM_MODEL} only; {name!r} is built to "
                f"timm's own layout (remove {'it' if one else 'them'})"
            )
        return raw

    @model_validator(mode="after")
    def _output_stride_of_a_cnn(self) -> TimmModel:
        if self.output_stride is not None and (self.output_stride not in (8, 16, 32) or self.has_token_outputs):
            raise ValueError(f"output_stride: {self.output_stride} is not 8, 16 or 32 of a CNN (null for the model's own)")
        return self


def _model_family(raw: Any) -> str:
    name = raw.get("name", CUSTOM_MODEL) if isinstance(raw, dict) else getattr(raw, "name", None)
    return CUSTOM_MODEL if name == CUSTOM_MODEL else "timm"


# One schema per family, chosen by `name`: a key that cannot apply to the named model is an error naming it.
Model = Annotated[
    Annotated[CustomVolo, Tag(CUSTOM_MODEL)] | Annotated[TimmModel, Tag("timm")], Discriminator(_model_family)
]
MODEL_FAMILY_TAGS = (CUSTOM_MODEL, "timm")
_MODEL_ADAPTER = TypeAdapter(Model)


def parse_model(raw: dict[str, Any], *, strict: bool = True) -> CustomVolo | TimmModel:
    """A `model` section on its own (e.g. a model file's record of it; strict=False turns its lists into tuples)."""
    return _MODEL_ADAPTER.validate_python(raw, strict=strict)


class Optimizer(Section):
    # adamw, lamb, sgd: first-order. kron: timm's PSGD Kron (Xi-Lin Li's preconditioned SGD), the second-order choice:
    # per tensor a Kronecker-factored preconditioner fitted to whiten the (momentum) gradient, about the inverse
    # square root of the empirical Fisher, as Shampoo's; not K-FAC's inverse Fisher. It is an ordinary
    # torch.optim.Optimizer (one backward, no closure), so it enters through the same factory and loop. Not
    # adahessian (timm too): it needs backward(create_graph=True), then torch.autograd.grad through the gradients,
    # which DDP does not support (its docstring); not ASDL's K-FAC: its GradientMaker takes over the forward and
    # backward, with hooks on the model's layers (PyPI asdfghjkl 0.1a5, an alpha; its docs name torch 1.13).
    # docs/guide.md, "Optimizers", has the comparison.
    name: Literal["adamw", "lamb", "sgd", "kron"] = "adamw"
    lr_base: float = Field(1.6e-2, gt=0)  # the peak LR: lr_base x global batch / 1024 (lr_scaling linear)
    # linear: the linear scaling rule (LR = lr_base x global batch / 1024) the reference code lacked; none: lr_base is
    # the LR whatever the batch (the reference fine-tunes at an absolute 8e-6 with any batch).
    lr_scaling: Literal["linear", "none"] = "linear"
    weight_decay: float = Field(0.05, ge=0)
    momentum: float = Field(0.9, ge=0, lt=1)  # sgd; kron: its gradient EMA (timm's Kron default 0.9)
    betas: tuple[float, float] = (0.9, 0.999)  # adamw / lamb

    def peak_lr(self, global_batch: int) -> float:
        return self.lr_base * global_batch / 1024 if self.lr_scaling == "linear" else self.lr_base

    def describe_lr(self, global_batch: int) -> str:
        """How the peak LR was reached, for the start-up line and error messages."""
        lr = f"lr {self.peak_lr(global_batch):.4g}"
        if self.lr_scaling == "none":
            return f"{lr} (lr_base, unscaled)"
        return f"{lr} = lr_base {self.lr_base:g} x global batch {global_batch} / 1024"


class Schedule(Section):
    # cosine: timm's CosineLRScheduler (the VOLO recipe); linear: linear decay from the end of the warm-up to
    # min_lr (Colossal-AI's LinearWarmupLR, min_lr 0).
    name: Literal["cosine", "linear"] = "cosine"
    warmup_epochs: float = Field(1.0, ge=0)
    warmup_lr: float = Field(1e-6, ge=0)
    min_lr: float = Field(1e-5, ge=0)
    # Epochs at min_lr after the decay's `epochs` (timm's --cooldown-epochs, 10 in the reference's main.py).
    cooldown_epochs: int = Field(0, ge=0)


class Ema(Section):
    enabled: bool = False
    decay: float = Field(0.9998, gt=0, lt=1)


class Mixup(Section):
    """timm's Mixup / CutMix of images and (smoothed) ground-truth targets: for ground-truth training only,
    since with token labeling MixToken does the mixing (and its targets are the token labels)."""

    mixup_alpha: float = Field(0.0, ge=0)  # Beta(alpha, alpha) of Mixup; 0 is off
    cutmix_alpha: float = Field(0.0, ge=0)  # of CutMix; 0 is off
    prob: float = Field(1.0, ge=0, le=1)  # per batch (mode batch), pair or sample
    switch_prob: float = Field(0.5, ge=0, le=1)  # CutMix instead of Mixup when both are on
    mode: Literal["batch", "pair", "elem"] = "batch"

    @property
    def enabled(self) -> bool:
        return self.prob > 0 and (self.mixup_alpha > 0 or self.cutmix_alpha > 0)


class Train(Section):
    """A training stage: the teacher's, pre-training's and fine-tuning's sections share these keys."""

    # train: trained here (from init_weights, if given) | import: its model is `weights`, evaluated, not trained.
    mode: Literal["train", "import"] = "train"
    # Local weights files of the stage's model (never downloaded): .safetensors, a torch state dict, or a training
    # checkpoint (timm's or sail-sg/volo's .pth.tar: "state_dict", else "model"). `weights` is the model itself (mode
    # import); `init_weights` where training starts (another class count: a new head; another size: the position
    # embedding resampled).
    weights: str = ""
    init_weights: str = ""
    # Take a training checkpoint's EMA weights ("state_dict_ema", timm's "model_ema") where it has them. Off, as
    # sail-sg/volo's --finetune (load_pretrained_weights(use_ema=args.model_ema), --model-ema off by default) and its
    # validate.py (--use-ema) do.
    weights_ema: bool = False
    img_size: int = Field(32, gt=0)
    epochs: int = Field(10, gt=0)
    batch_size: int = Field(64, gt=0)  # per device
    accum_steps: int = Field(1, gt=0)
    optimizer: Optimizer = Optimizer()
    schedule: Schedule = Schedule()
    label_smoothing: float = Field(0.1, ge=0, lt=1)  # of the ground truth (with Mixup too); token labels: token_label's
    clip_grad: float = Field(0.0, ge=0)  # max grad norm; 0 turns clipping off
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: fp32 on CPU, bf16 on GPU
    ema: Ema = Ema()
    # Which epoch's weights the stage's model file holds: last, or best (the first epoch of the highest val top-1,
    # as timm's and sail-sg/volo's train.py keep model_best.pth.tar). Best chooses on val, so where val is the only
    # held-out set its top-1 is no longer an unbiased estimate: last by default, best in the ImageNet VOLO profiles.
    keep: Literal["last", "best"] = "last"
    mixup: Mixup = Mixup()
    val_crop_pct: float = Field(1.0, gt=0, le=2)
    # This stage's random-resized-crop area range, in place of augment.scale; unset: augment.scale.
    crop_scale: tuple[float, float] | None = None
    compile: bool = False  # torch.compile the training forward (the first steps compile it: minutes on a big model)

    @model_validator(mode="after")
    def _weights_for_the_mode(self) -> Train:
        if self.mode == "import" and not self.weights:
            raise ValueError("weights: required when mode is 'import' (a local .safetensors, .pt or .pth.tar file)")
        if self.mode == "import" and self.init_weights:
            raise ValueError("init_weights: only with mode 'train' (mode 'import' takes its model from weights)")
        return self

    @model_validator(mode="after")
    def _mixup_pairs(self) -> Train:
        if self.mixup.enabled and self.batch_size % 2:
            raise ValueError(f"batch_size: {self.batch_size} is odd; Mixup/CutMix pairs the samples of a batch")
        return self

    @model_validator(mode="after")
    def _crop_scale_range(self) -> Train:
        if self.crop_scale is not None:
            check_crop_scale("crop_scale", self.crop_scale)
        return self

    def train_augment(self, augment: Augment) -> Augment:
        """params.augment as this stage's train loader applies it (its own crop_scale, when set)."""
        return augment if self.crop_scale is None else augment.model_copy(update={"scale": self.crop_scale})

    @property
    def total_epochs(self) -> int:
        """The decay's epochs and the cooldown's at min_lr after them."""
        return self.epochs + self.schedule.cooldown_epochs

    def global_batch(self, world_size: int) -> int:
        return self.batch_size * self.accum_steps * world_size

    def check_lr_decays(self, world_size: int) -> None:
        """A peak LR at or below min_lr makes the "decay" rise (a small batch under lr_scaling linear does it)."""
        global_batch = self.global_batch(world_size)
        if self.optimizer.peak_lr(global_batch) <= self.schedule.min_lr:
            raise ValueError(
                f"optimizer.lr_base: the peak {self.optimizer.describe_lr(global_batch)} ({world_size} ranks) is at "
                f"or below schedule.min_lr {self.schedule.min_lr:g}, so the schedule would rise: raise lr_base, "
                f"lower min_lr, or use lr_scaling none"
            )


class TeacherWeight(Section):
    """w of `ground_truth_mix`: the teacher's share of a target, by whether its top-1 there is the label. The reference
    (sail-sg/volo and TokenLabeling's TokenLabelGTCrossEntropy: `ratio = 0.9 - 0.4 * (label == teacher top-1)`) gives
    0.5 / 0.9, trusting the teacher most where it contradicts the label, although its comment says "rely more on
    ground truth if target_cls is incorrect". From teachers wrong on 8-11 % of their training images the code's
    weights (and the teacher alone) left students 12-21 points below ground truth; the comment's 0.5 / 0.1 on the
    class and token targets, at the defaults' length, never more than 0.62 points below it on average over seeds at
    four teacher qualities (docs/recipe.md, "A teacher that errs")."""

    agrees: float = Field(0.5, ge=0, le=1)
    disagrees: float = Field(0.1, ge=0, le=1)


class TokenLabel(Section):
    """Token labeling in a training stage (sail-sg/volo's weights)."""

    enabled: bool = False
    cls_weight: float = Field(1.0, ge=0)  # soft CE of the class logits against the teacher's crop distribution
    dense_weight: float = Field(0.5, ge=0)  # mean soft CE of every token's logits against its token target
    # MixToken: one box of tokens per batch swapped with the flipped batch; part of token labeling (its targets
    # are the token labels), so off whenever `enabled` is.
    mix_token: bool = False
    # Mix the (smoothed) label into the class target: w x teacher + (1 - w) x label, w by teacher_weight. The
    # reference does it in fine-tuning only; here pre-training does too (docs/recipe.md, "A teacher that errs").
    ground_truth_mix: bool = True
    teacher_weight: TeacherWeight = TeacherWeight()
    # With ground_truth_mix, mix the label into every token's target too, each weighted by its own top-1 (the
    # reference: the class target only, so a teacher's wrong cells were taught as they were).
    ground_truth_tokens: bool = True
    # Smoothing of the targets token labeling trains on (the teacher's, and the labels ground_truth_mix mixes in);
    # `<stage>.label_smoothing` is ground truth's alone. The reference smooths both by its --smoothing 0.1
    # (sail-sg/volo main.py; the profiles keep it). 0 by default: on the photos it gave the student 85.31 % vs
    # 84.81 % at 0.1 and ground truth's 85.06 % (3 seeds; docs/guide.md, "Token labels that help").
    label_smoothing: float = Field(0.0, ge=0, lt=1)

    @property
    def mixes_tokens(self) -> bool:
        """Whether the student is built with MixToken."""
        return self.enabled and self.mix_token


class Pretrain(Train):
    token_label: TokenLabel = TokenLabel()


class Finetune(Pretrain):
    """High-resolution fine-tuning of the pretrained model (the pos-embed resampled to `img_size`)."""


class Teacher(Train):
    """The teacher of token labeling: trained here (`train`, with the Train fields) or imported (`import`)."""

    # img_size (Train's) is the teacher's input size, for training and for generation. A CNN by default: its head at
    # every cell is its classifier (exact dense map); a VOLO trained on labels here only trains its aux head through
    # the max over tokens (timm's forward_head): its map's whole-image targets agreed with its own prediction on
    # 38 % of the photos' train images at 32 px (measured). Built unvalidated: no timm import to read defaults.
    model: Model = TimmModel.model_construct(name="resnet10t", output_stride=8)


class TokenLabels(Section):
    """The token-label store: generated from the teacher, or imported from the reference's published label files."""

    # generate: run the teacher over every train record. import: read the reference's per-image label files
    # (TokenLabeling's generate_label.py layout; NFNet-F6's for ImageNet) from import_dir, no teacher forward.
    mode: Literal["generate", "import"] = "generate"
    import_dir: str = ""  # import: the label root, <class folder>/<image name up to its first dot>.pt per image
    top_k: int = Field(5, gt=0)  # classes kept per grid cell (logits + indices); import: the files' k
    # whole: the whole image resized to the teacher's input size, so the map covers exactly the area crop windows
    # are normalised by. center: resize the shorter side + centre crop (the reference): misaligned for
    # non-square images, for parity runs only.
    teacher_view: Literal["whole", "center"] = "whole"
    batch_size: int = Field(64, gt=0)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # of the teacher's forward; logits stored in fp16

    @model_validator(mode="after")
    def _import_dir_for_import(self) -> TokenLabels:
        if self.mode == "import" and not self.import_dir:
            raise ValueError("import_dir: required when mode is 'import' (the directory of the reference's label files)")
        return self


class ModelEvaluation(Section):
    """How one trained model is evaluated: at its own training resolution (read from its model file)."""

    crop_pct: float = Field(1.0, gt=0, le=2)  # resize to floor(img_size / crop_pct), centre crop
    # Further test resolutions: the model is rebuilt at each (a VOLO's / ViT's position embedding resampled).
    extra_sizes: tuple[int, ...] = ()


class Evaluate(Section):
    # Per device, of every evaluation: the evaluate stage's and each training stage's validation at an epoch's end
    # (and of an imported model), whatever that stage's training batch. 256: sail-sg/volo's and timm's validate.py
    # default (-b). It changes which samples share a forward, so no count, only the float rounding of the mean loss
    # (tests/test_evaluate.py): the training stages do not list it (changing it reruns none of them and keeps their
    # checkpoints resumable, e.g. to lower it after a validation ran out of memory).
    batch_size: int = Field(256, gt=0)
    pretrain: ModelEvaluation = ModelEvaluation()
    finetune: ModelEvaluation = ModelEvaluation()

    @model_validator(mode="after")
    def _positive_sizes(self) -> Evaluate:
        for name in EVALUATED_MODELS:
            if any(size <= 0 for size in getattr(self, name).extra_sizes):
                raise ValueError(f"{name}.extra_sizes: every size must be positive")
        return self


# The trained models the evaluate stage runs on (its DVC foreach items; each a section of `evaluate`).
EVALUATED_MODELS = ("pretrain", "finetune")


# An MLflow registry alias: a letter or underscore, then letters, digits, _ and -.
ALIAS_PATTERN = r"^[A-Za-z_][A-Za-z0-9_-]*$"


class Tracking(Section):
    experiment: str = Field("coarse2fine", min_length=1)
    # The MLflow registry entry of the pipeline's result (the fine-tuned model). The candidate alias moves to every
    # new result; the champion alias only to a result trained on the whole data set that beats the champion's top-1
    # on the same val set, or by `python -m coarse2fine.promote` (tracking.lineage, `champion_verdict`).
    registered_model: str = Field("coarse2fine", min_length=1)
    candidate_alias: str = Field("candidate", pattern=ALIAS_PATTERN)
    champion_alias: str = Field("champion", pattern=ALIAS_PATTERN)
    # Each training stage logs its model as an MLflow model (torch.export: 3-5 s a stage on a CPU) and lineage
    # registers the result; off, models/ holds the only copies (quick sweeps). Changes no output: no stage lists it.
    log_models: bool = True

    @field_validator("candidate_alias", "champion_alias")
    @classmethod
    def _not_reserved(cls, alias: str) -> str:
        if alias.lower() == "latest" or re.fullmatch(r"v\d+", alias.lower()):
            raise ValueError(f"{alias!r} is reserved by MLflow's registry (latest, v<number>); e.g. candidate")
        return alias

    @model_validator(mode="after")
    def _two_aliases(self) -> Tracking:
        if self.candidate_alias == self.champion_alias:
            raise ValueError(f"candidate_alias and champion_alias are both {self.champion_alias!r}: name two aliases")
        return self


class Params(Section):
    seed: int = Field(0, ge=0)
    launch: Launch = Launch()
    parallel: Parallel = Parallel()
    checkpoint: Checkpoint = Checkpoint()
    data: Data = Data()
    loader: Loader = Loader()
    augment: Augment = Augment()
    teacher: Teacher = Teacher()
    token_labels: TokenLabels = TokenLabels()
    model: Model = CustomVolo()
    pretrain: Pretrain = Pretrain()
    finetune: Finetune = Finetune()
    evaluate: Evaluate = Evaluate()
    tracking: Tracking = Tracking()

    @property
    def token_labels_needed(self) -> bool:
        """Whether a student learns from the token labels (pretrain or finetune .token_label.enabled)."""
        return self.pretrain.token_label.enabled or self.finetune.token_label.enabled

    @model_validator(mode="after")
    def _image_sizes_fit_the_token_grid(self) -> Params:
        checks = [
            ("pretrain.img_size", self.pretrain.img_size, self.model),
            ("finetune.img_size", self.finetune.img_size, self.model),
            ("teacher.img_size", self.teacher.img_size, self.teacher.model),
        ]
        checks += [
            (f"evaluate.{name}.extra_sizes", size, self.model)
            for name in EVALUATED_MODELS for size in getattr(self.evaluate, name).extra_sizes
        ]
        for key, size, model in checks:
            if model.stride and size % model.stride:
                raise ValueError(f"{key}: {size} is not divisible by the model's token stride {model.stride} (2 x patch size)")
        return self

    @model_validator(mode="after")
    def _lrs_decay(self) -> Params:
        data_ranks = ParallelDims.of(self.parallel, self.launch.world_size).data  # the global batch's ranks
        for name in self._trained_sections():
            try:
                getattr(self, name).check_lr_decays(data_ranks)
            except ValueError as error:
                raise ValueError(f"{name}.{error}") from None
        return self

    @model_validator(mode="after")
    def _parallel_dims_fill_the_world(self) -> Params:
        dims = ParallelDims.of(self.parallel, self.launch.world_size)
        if self.parallel.strategy == "ddp" and dims.data > 1 and dims.model_parallel:
            # torchtitan refuses it too: DDP replicates plain tensors, not the DTensors of TP or a pipeline's stages.
            raise ValueError(
                f"parallel.strategy: ddp replicates whole models only; with tensor {dims.tensor} x pipeline "
                f"{dims.pipeline} on {dims.data} data ranks use fsdp"
            )
        if dims.pipeline > 1:
            if self.parallel.microbatches < dims.pipeline:  # fewer cannot keep every stage busy once
                raise ValueError(
                    f"parallel.microbatches: {self.parallel.microbatches} is fewer than the pipeline's "
                    f"{dims.pipeline} stages"
                )
            for name in self._trained_sections():
                cfg = getattr(self, name)
                if cfg.batch_size % self.parallel.microbatches:
                    raise ValueError(
                        f"{name}.batch_size: {cfg.batch_size} does not split into parallel.microbatches "
                        f"{self.parallel.microbatches} equal micro-batches"
                    )
                # MixToken's box is drawn where the stem runs (the first stage) and is needed after the head (the
                # last): nothing carries it between stages.
                if isinstance(cfg, Pretrain) and cfg.token_label.mixes_tokens:
                    raise ValueError(f"{name}.token_label.mix_token: not with parallel.pipeline {dims.pipeline}")
                if cfg.compile:
                    raise ValueError(f"{name}.compile: not with parallel.pipeline {dims.pipeline}")
        return self

    def _trained_sections(self) -> tuple[str, ...]:
        return tuple(name for name in ("teacher", "pretrain", "finetune") if getattr(self, name).mode == "train")

    @model_validator(mode="after")
    def _sharded_layouts_train_what_they_can(self) -> Params:
        dims = ParallelDims.of(self.parallel, self.launch.world_size)
        if self.parallel.strategy == "fsdp":
            layout = "parallel.strategy fsdp"
        elif dims.model_parallel:
            layout = f"parallel.tensor {dims.tensor} x pipeline {dims.pipeline}"
        else:
            return self
        for name in self._trained_sections():
            cfg = getattr(self, name)
            # The EMA's copy of a sharded model would need sharding of its own; fp16's loss scaler unscales
            # gradients that are DTensors under FSDP, which nothing here has run. bf16 needs no scaler.
            if cfg.ema.enabled:
                raise ValueError(f"{name}.ema.enabled: not with {layout} (use ddp, or turn the EMA off)")
            if cfg.precision == "fp16":
                raise ValueError(f"{name}.precision: fp16 is not supported with {layout}: use bf16")
            # Kron's preconditioners are plain tensors of the whole parameter's shape: against a DTensor shard
            # its first step fails (mixed torch.Tensor and DTensor).
            if cfg.optimizer.name == "kron":
                raise ValueError(f"{name}.optimizer.name: kron is not supported with {layout}: use ddp")
        return self

    @model_validator(mode="after")
    def _token_labels_need_token_outputs(self) -> Params:
        for name in ("pretrain", "finetune"):
            if getattr(self, name).token_label.enabled and not self.model.has_token_outputs:
                raise ValueError(
                    f"{name}.token_label.enabled: model.name {self.model.name!r} has no per-token outputs; "
                    f"token labeling and MixToken need a VOLO ({CUSTOM_MODEL} or volo_*)"
                )
        return self

    @model_validator(mode="after")
    def _one_way_to_mix(self) -> Params:
        for name in ("pretrain", "finetune"):
            cfg = getattr(self, name)
            if cfg.mixup.enabled and cfg.token_label.enabled:
                raise ValueError(
                    f"{name}.mixup: Mixup/CutMix mixes ground-truth targets, but {name}.token_label.enabled trains on "
                    f"token labels, mixed by MixToken: turn one off"
                )
        return self


KEY_PREFIX = re.compile(r"^[a-z_][a-z0-9_.]*: ")


def _format(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"] if part not in MODEL_FAMILY_TAGS)
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key"
        elif "input" in item and item["type"] != "missing" and not isinstance(item["input"], dict):
            message = f"{message} (got {item['input']!r})"
        # Cross-field validators start their message with the field name: join it onto the section path.
        separator = "." if KEY_PREFIX.match(message) else ": "
        lines.append(f"{path}{separator}{message}" if path else message)
    return "\n".join(lines)


def parse_params(raw: Any, source: str = "params.yaml", *, check_model_names: bool = True) -> Params:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{source}: expected a mapping at the top level, got {type(raw).__name__}")
    try:
        return Params.model_validate(_lists_to_tuples(raw), context={CHECK_MODEL_NAMES: check_model_names})
    except ValidationError as error:
        raise ParamsError("\n".join(f"{source}: {line}" for line in _format(error).splitlines())) from None


def load_params(path: str | Path = "params.yaml", *, check_model_names: bool = True) -> Params:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ParamsError(f"{path}: file not found (run from the project root or pass --params)") from None
    except yaml.YAMLError as error:
        raise ParamsError(f"{path}: not valid YAML: {str(error).splitlines()[0]}") from None
    if raw is None:  # an emptied or truncated file: the schema's defaults are not the shipped params.yaml's
        raise ParamsError(
            f"{path}: empty (no params): restore it (git checkout -- {path}) or write the keys the run should use"
        )
    return parse_params(raw, str(path), check_model_names=check_model_names)


def _lists_to_tuples(value: Any) -> Any:
    # YAML lists arrive as lists; the schema uses tuples (immutable, strict-mode friendly).
    if isinstance(value, dict):
        return {key: _lists_to_tuples(item) for key, item in value.items()}
    if isinstance(value, list):
        return tuple(_lists_to_tuples(item) for item in value)
    return value


def flatten(params: BaseModel, prefix: str = "") -> dict[str, Any]:
    """`{"pretrain.optimizer.lr_base": 0.016, ...}`: the form tracking logs."""
    flat: dict[str, Any] = {}
    for key, value in params:
        name = f"{prefix}{key}"
        if isinstance(value, BaseModel):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = list(value) if isinstance(value, tuple) else value
    return flat
