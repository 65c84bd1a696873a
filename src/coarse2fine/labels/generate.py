"""Token-label generation: the teacher's dense class scores for every train record, into the label store.

The dense head is the teacher's own classifier applied at every position of its last feature map:
- a CNN (global pooling + classifier): each position's feature vector goes through the model's own
  `forward_head` as a 1 x 1 map, so the pooling is the identity and the head (norm, linear...) is applied as it
  was trained; for an average-pool + linear head the map's mean is exactly the model's logits;
- a VOLO: its aux head on the patch tokens (its trained per-token classifier), laid back on their grid;
- a ViT/DeiT: the class/distillation tokens dropped, the head on each patch token, laid back on the grid.

The teacher sees the whole image resized to its input size (aspect ratio not kept), so the score grid covers
exactly the area the loaders normalise their crop windows by; `center` (resize the shorter side, centre crop:
the reference's view) misaligns map and windows on non-square images and exists for parity runs only.

Resumable and rank-independent: the train records are cut into chunks of CHUNK_BATCHES batches, each a fixed
set of rows; ranks share the chunks still to do, and each chunk's rows go whole into a file of their own
(`done/chunk-NNNNNN.npz`, atomically), then its marker (`done/chunk-NNNNNN.json`). No two ranks ever write one
file. Ranks on several nodes writing neighbouring rows of one shared file would each write back whole pages
(an NFS client does for a mapping; a page is 4 KiB, 64 KiB or a 2 MiB folio), one node's rows lost where a page
holds both; and chunks cannot be cut on such a unit instead: numpy's 128-byte header and rows of k x s x s x 2
(or 4) bytes put the boundaries mid-page, and np.load refuses headers padded past 10,000 bytes. A rerun with
the same inputs (fingerprint in `inputs.json`, with the rows per chunk) skips the marked chunks; batches never
depend on the rank count, so 1 or N ranks, killed or not, write the same bytes. When every chunk is done,
rank 0 alone copies the chunks' rows into the store's arrays (allocated at the start, so that a disk too small
for them is said before any forward; the chunk files take as much again until the end), hard-links the
arrays into the output directory, writes the header last and deletes the work directory: a finished store is
DVC's to keep (its run cache restores it for the same inputs, say after token labeling was off everywhere and
back on).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from PIL import Image
from timm.models.volo import VOLO
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as F

from coarse2fine import distributed
from coarse2fine.data import records
from coarse2fine.data.transforms import IMAGE_MEAN, IMAGE_STD
from coarse2fine.distributed import Runtime
from coarse2fine.errors import UserError
from coarse2fine.files import atomic_path, write_json
from coarse2fine.labels import store, targets
from coarse2fine.progress import progress

CHUNK_BATCHES = 16  # batches per resumable unit of work
INPUTS_FILE = "inputs.json"
DONE_DIR = "done"
IMAGENET_TRAIN_IMAGES = 1_281_167
REFERENCE_IMAGENET_BYTES = 9.2e9  # the reference's store: [2, 5, 18, 18] fp16 per image, one file each

# The token_labels stage warns when the teacher's dense top-1 on its own training images is below this. With the
# reference's targets, teachers right on 88.9-93.2 % of them cost the student 11-21 points (docs/recipe.md, "A
# teacher that errs": the issue's harder photos, bench/teacher_quality.py's 3-epoch teachers, the guard test),
# one right on 100 % nothing; 98 % (wrong on more than 1 image in 50) warns well before that range.
RELIABLE_DENSE_TOP1 = 98.0
RELIABILITY_DOC = "docs/recipe.md#a-teacher-that-errs"
WARNING_WIDTH = 200  # the printed line, "token_labels: " included: one line of a terminal or a cluster log

DenseHead = Callable[[torch.Tensor], torch.Tensor]  # normalised images [B, 3, S, S] -> scores [B, C, h, w]


def dense_head(model: nn.Module) -> DenseHead:
    """The teacher's classifier at every position of its final feature map (see the module docstring)."""
    if isinstance(model, VOLO):
        return lambda images: _tokens_to_map(model.aux_head(model.forward_features(images)[:, 1:]))
    if hasattr(model, "num_prefix_tokens") and hasattr(model, "patch_embed"):  # timm's ViT family
        return lambda images: _tokens_to_map(_vit_token_logits(model, images))
    return lambda images: _cnn_dense_logits(model, images)


def _tokens_to_map(tokens: torch.Tensor) -> torch.Tensor:
    """[B, N, C] row-major tokens of a square grid -> [B, C, s, s]."""
    batch, count, classes = tokens.shape
    side = int(round(count**0.5))
    if side * side != count:
        raise UserError(f"the teacher's {count} tokens do not form a square grid: use a square input size")
    return tokens.transpose(1, 2).reshape(batch, classes, side, side)


def _vit_token_logits(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    tokens = model.forward_features(images)[:, model.num_prefix_tokens :]
    tokens = model.fc_norm(tokens)
    logits = model.head(tokens)
    if getattr(model, "head_dist", None) is not None:  # DeiT distilled: inference averages both heads
        logits = (logits + model.head_dist(tokens)) / 2
    return logits


def _cnn_dense_logits(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    features = model.forward_features(images)
    if features.ndim != 4:
        raise UserError(
            f"{type(model).__name__}: no dense head for features of shape {tuple(features.shape)} "
            "(supported: CNNs with NCHW features, VOLO, ViT/DeiT)"
        )
    batch, channels, height, width = features.shape
    cells = features.permute(0, 2, 3, 1).reshape(batch * height * width, channels, 1, 1)
    logits = model.forward_head(cells)  # pooling a 1 x 1 map is the identity
    return logits.reshape(batch, height, width, -1).permute(0, 3, 1, 2)


@dataclass(frozen=True)
class View:
    """How the teacher sees an image: `whole` (resized to size x size) or `center` (shorter side, centre crop)."""

    kind: str
    size: int
    interpolation: str

    def __call__(self, image: Image.Image) -> torch.Tensor:
        mode = InterpolationMode(self.interpolation)
        if self.kind == "whole":
            image = F.resize(image, [self.size, self.size], interpolation=mode)
        else:
            image = F.center_crop(F.resize(image, self.size, interpolation=mode), self.size)
        return F.pil_to_tensor(image)


class TrainRecords(Dataset):
    """The train split by position in shard order: (uint8 image in the teacher's view, label, record index)."""

    def __init__(self, records_dir: str | Path, view: View):
        self.reader = records.ShardReader(records.shard_files(records_dir, "train"))
        self.view = view

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, position: int) -> tuple[torch.Tensor, int, int]:
        record = self.reader.read_position(position)
        image = Image.open(io.BytesIO(record["image"])).convert("RGB")
        return self.view(image), int(record["label"][0]), int(record["index"][0])


# What `label_statistics` sums, in its order (Generation.metrics turns them into means).
STATISTICS = (
    "images", "dense_correct", "cells_correct", "teacher_entropy", "target_entropy", "target_correct", "outside_top_k"
)


def label_statistics(
    scores: torch.Tensor, log_probs: torch.Tensor, classes: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Sums over a batch (a float64 vector in `STATISTICS` order, on the batch's device: added up there, read
    once per chunk) of what the store keeps against what the teacher said: `scores` [B, C, s, s] are the
    teacher's dense logits, `log_probs`/`classes` [B, k, s, s] their top k log-probabilities as the store keeps
    them (before the float16 rounding), `labels` [B].
    - teacher_*: the teacher's own prediction for the whole image (the softmax of its mean logits) and its cells';
    - target_*: the class target the student would get for the whole image from the store (smoothing aside);
    - outside_top_k: the probability per cell the teacher gave the classes the store does not name."""
    teacher = scores.float().mean(dim=(2, 3)).softmax(dim=1)
    whole = torch.tensor([[0.0, 0.0, 1.0, 1.0]], device=scores.device).expand(len(scores), 4)
    no_flip = torch.zeros(len(scores), dtype=torch.bool, device=scores.device)
    identity = torch.eye(2, 3, device=scores.device).expand(len(scores), 2, 3)
    nothing_moved = torch.zeros(0, dtype=torch.int64, device=scores.device)
    target = targets.token_targets(
        log_probs, classes, whole, no_flip, identity, num_classes=scores.shape[1], token_grid=1, smoothing=0.0,
        moved=nothing_moved,
    ).cls
    return torch.stack([
        torch.tensor(float(len(scores)), device=scores.device),
        (teacher.argmax(dim=1) == labels).sum(),
        (scores.argmax(dim=1) == labels.view(-1, 1, 1)).float().mean(dim=(1, 2)).sum(),
        targets.entropy(teacher).sum(),
        targets.entropy(target).sum(),
        (target.argmax(dim=1) == labels).sum(),
        (1 - log_probs.exp().sum(dim=1)).mean(dim=(1, 2)).sum(),
    ]).double()


def statistics_dict(sums: torch.Tensor) -> dict[str, float]:
    return dict(zip(STATISTICS, sums.tolist()))


@dataclass(frozen=True)
class Generation:
    """What one run of `generate` did, summed over ranks and chunks (also over the chunks of a killed run)."""

    sums: dict[str, float]  # label_statistics' sums over every image
    generated: int  # images this run generated (the rest came from a killed run's chunks)
    seconds: float
    bytes_per_image: int

    def metrics(self) -> dict[str, float | int]:
        images = self.sums["images"]
        imagenet_bytes = self.bytes_per_image * IMAGENET_TRAIN_IMAGES
        return {
            "images": int(images),
            "dense_top1": 100.0 * self.sums["dense_correct"] / images,
            "cell_top1": 100.0 * self.sums["cells_correct"] / images,
            "teacher_entropy": self.sums["teacher_entropy"] / images,
            "target_entropy": self.sums["target_entropy"] / images,
            "target_top1": 100.0 * self.sums["target_correct"] / images,
            "outside_top_k": self.sums["outside_top_k"] / images,
            "bytes_per_image": self.bytes_per_image,
            "img_per_s": self.generated / self.seconds if self.seconds > 0 else 0.0,
            "imagenet_gb": imagenet_bytes / 1e9,
            "imagenet_vs_reference": imagenet_bytes / REFERENCE_IMAGENET_BYTES,
        }


def unreliable_teacher_warning(metrics: Mapping[str, float]) -> str | None:
    """One line for the user (at most WARNING_WIDTH characters as the stage prints it) when the teacher misreads more
    of its own training images than RELIABLE_DENSE_TOP1 allows (`metrics`: Generation.metrics()), else None. What to
    do is in it; why is in RELIABILITY_DOC."""
    if metrics["dense_top1"] >= RELIABLE_DENSE_TOP1:
        return None
    return (
        f"WARNING: teacher wrong on {100 - metrics['dense_top1']:.1f}% of its train images (cells "
        f"{100 - metrics['cell_top1']:.1f}%): compare with <student>.token_label.enabled false or raise teacher.epochs "
        f"({RELIABILITY_DOC})"
    )


def generate(
    head: DenseHead,
    records_dir: str | Path,
    *,
    out_dir: str | Path,
    work_dir: str | Path,
    view: View,
    top_k: int,
    batch_size: int,
    workers: int,
    runtime: Runtime,
    autocast_dtype: torch.dtype | None,
    inputs: Mapping[str, Any],
    header: Mapping[str, Any],
) -> Generation:
    """Fill the store in `out_dir` (header + `header` fields) with the scores of `head` (`dense_head(teacher)`
    of a teacher in eval mode on the device), resuming the chunks a killed run with the same `inputs` finished
    in `work_dir`."""
    out_dir, work_dir = Path(out_dir), Path(work_dir)
    records.require_open_file_limit(workers, "loader.workers")
    dataset = TrainRecords(records_dir, view)
    num_classes = len(records.read_classes(records_dir))
    if top_k > num_classes:
        raise UserError(f"token_labels.top_k: {top_k} is more than the {num_classes} classes")
    grid = _grid(head, view.size, runtime.device)
    chunk = CHUNK_BATCHES * batch_size
    num_chunks = -(-len(dataset) // chunk)

    if runtime.is_main:
        # The rows per chunk are part of what a work dir was made with: its chunk files are cut by them.
        made_with = {**inputs, "chunk_rows": chunk}
        resumed = _prepare_work_dir(work_dir, made_with, (len(dataset), top_k, grid, num_classes))
        if resumed:
            print(f"token_labels: resuming, {resumed} of {num_chunks} chunks done ({work_dir})", flush=True)
    distributed.barrier()
    pending = [index for index in range(num_chunks) if not _marker(work_dir, index).exists()]
    mine = pending[runtime.rank :: runtime.world_size]

    batches = [
        list(range(start, min(start + batch_size, (index + 1) * chunk, len(dataset))))
        for index in mine
        for start in range(index * chunk, min((index + 1) * chunk, len(dataset)), batch_size)
    ]
    loader = DataLoader(dataset, batch_sampler=batches, num_workers=workers, pin_memory=runtime.is_cuda)
    mean = torch.tensor(IMAGE_MEAN, device=runtime.device).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGE_STD, device=runtime.device).view(1, 3, 1, 1) * 255
    runtime.synchronize()  # GPU timings wait for the queued work, at both ends
    start_time = time.perf_counter()
    chunk_sums = torch.zeros(len(STATISTICS), dtype=torch.float64, device=runtime.device)
    generated = 0
    bar = progress(loader, total=len(batches), desc="token_labels", disable=not runtime.is_main)
    for (images, labels, indices), positions in zip(bar, batches):  # the bar first: it closes when exhausted
        index = positions[0] // chunk
        first, end = index * chunk, min((index + 1) * chunk, len(dataset))
        if positions[0] == first:  # the chunk's first batch: its rows gather in memory, saved whole at its last
            rows = store.StoreArrays(
                np.empty((end - first, top_k, grid, grid), np.float16),
                np.empty((end - first, top_k, grid, grid), store.class_dtype(num_classes)),
            )
        images = images.to(runtime.device, non_blocking=True).contiguous(memory_format=runtime.image_memory_format)
        images = (images.float() - mean) / std
        autocast = torch.autocast(runtime.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
        with torch.inference_mode(), autocast:
            scores = head(images).float()
        log_probs, classes = scores.log_softmax(dim=1).topk(top_k, dim=1)
        rows.write(indices.numpy() - first, log_probs.to(torch.float16).cpu().numpy(), classes.cpu().numpy())
        chunk_sums += label_statistics(scores, log_probs, classes, labels.to(scores.device))
        generated += len(indices)
        if positions[-1] + 1 == end:  # the chunk's last batch
            _save_rows(_rows_file(work_dir, index), rows)
            write_json(_marker(work_dir, index), statistics_dict(chunk_sums))
            chunk_sums.zero_()
    runtime.synchronize()
    seconds = time.perf_counter() - start_time

    totals = distributed.all_reduce_sum(torch.tensor([float(generated), seconds]))
    distributed.barrier()  # every rank's markers are written
    markers = [_marker(work_dir, index) for index in range(num_chunks)]
    stats = [json.loads(marker.read_text()) for marker in markers if marker.exists()]
    if len(stats) != num_chunks:
        raise RuntimeError(f"{work_dir}: {num_chunks - len(stats)} chunks without a marker after every rank finished")
    cell_bytes = np.dtype(np.float16).itemsize + store.class_dtype(num_classes).itemsize
    result = Generation(
        sums={name: sum(item[name] for item in stats) for name in stats[0]},
        generated=int(totals[0]),
        seconds=float(totals[1]) / runtime.world_size,  # ranks run side by side: their mean wall time
        bytes_per_image=top_k * grid * grid * cell_bytes,
    )
    if runtime.is_main:
        arrays = store.open_arrays(work_dir)
        _assemble(work_dir, arrays, num_chunks, chunk)
        _publish(work_dir, out_dir, arrays, num_classes, header)
        shutil.rmtree(work_dir)  # the store's arrays are links of their own: nothing is copied or lost
    distributed.barrier()
    return result


def _grid(head: DenseHead, size: int, device: torch.device) -> int:
    with torch.inference_mode():
        height, width = head(torch.zeros(1, 3, size, size, device=device)).shape[2:]
    if height != width:
        raise UserError(f"the teacher's score map at {size} px is {height} x {width}, not square")
    return int(height)


def _marker(work_dir: Path, chunk: int) -> Path:
    return work_dir / DONE_DIR / f"chunk-{chunk:06d}.json"


def _rows_file(work_dir: Path, chunk: int) -> Path:
    return work_dir / DONE_DIR / f"chunk-{chunk:06d}.npz"


def _save_rows(path: Path, rows: store.StoreArrays) -> None:
    with atomic_path(path) as temporary, open(temporary, "wb") as file:  # np.savez would add .npz to a name
        np.savez(file, log_probs=rows.log_probs, classes=rows.classes)


def _assemble(work_dir: Path, arrays: store.StoreArrays, num_chunks: int, chunk: int) -> None:
    """Copy every chunk's rows into `arrays`, in order: rank 0 alone, once every rank is done, so that no other
    process writes the arrays. A run killed here assembles again from the chunk files, which stay till the end."""
    for index in range(num_chunks):
        with np.load(_rows_file(work_dir, index)) as rows:
            log_probs, classes = rows["log_probs"], rows["classes"]
        arrays.write(np.arange(index * chunk, index * chunk + len(log_probs)), log_probs, classes)
    arrays.flush()


def _prepare_work_dir(work_dir: Path, inputs: dict[str, Any], shape: tuple[int, int, int, int]) -> int:
    """Keep a killed run's work when it was made from the same inputs (returns its finished chunks), else start
    afresh: allocate the arrays and record the inputs (last, so a half-made work dir never matches)."""
    inputs_file = work_dir / INPUTS_FILE
    try:
        if json.loads(inputs_file.read_text()) == inputs:
            arrays = store.open_arrays(work_dir, mode="r")
            if arrays.log_probs.shape == arrays.classes.shape == shape[:2] + (shape[2], shape[2]):
                return len(list((work_dir / DONE_DIR).glob("chunk-*.json")))
    except (OSError, ValueError):
        pass
    shutil.rmtree(work_dir, ignore_errors=True)
    records_count, top_k, grid, num_classes = shape
    store.allocate_arrays(work_dir, records_count, top_k, grid, num_classes)
    (work_dir / DONE_DIR).mkdir()
    write_json(inputs_file, inputs)
    return 0


def _publish(
    work_dir: Path, out_dir: Path, arrays: store.StoreArrays, num_classes: int, header: Mapping[str, Any]
) -> None:
    """Hard-link the finished arrays into `out_dir`, header last."""
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    for name in (store.LOG_PROBS_FILE, store.CLASSES_FILE):
        os.link(work_dir / name, out_dir / name)
    store.write_header(out_dir, arrays, num_classes, **header)
