"""Import the reference's published token labels into the label store (token_labels.mode: import).

The reference's format, as zihangJiang/TokenLabeling's generate_label.py writes it (at commit
bd50ea5ad20f27842d7b3860139c11545ceb9bd8; the NFNet-F6 labels for ImageNet that the repository's README offers
were made by it):
- one file per train image, `torch.save` of a float16 tensor [2, k, s, s]: row 0 the teacher's top-k scores per cell,
  best first, row 1 their class indices stored as floats;
- the scores are logits: its TokenLabelHead is the classifier run as a 1 x 1 convolution over the final feature
  map, with no softmax after it;
- the grid is that NCHW map's, [s rows top to bottom, s columns left to right], the order of this store's arrays
  (generate.py's maps), so no transpose;
- the image `<data root>/train/<class>/<name>.JPEG` has its labels in `<label root>/<class>/<name>.pt`: the last
  two parts of the image's path, cut at their first dot, plus ".pt";
- class indices are timm's ImageFolder labels, the class folder's position in timm's natural sort; for ImageNet's
  folder names (n + 8 digits) that is the plain sort convert gives the records' labels, so an index needs no mapping;
- the teacher saw timm's eval view (shorter side resized, centre crop), as `token_labels.teacher_view: center`
  does: the header records it.

Faithful conversion to log-probabilities: the files keep only the top k logits z, and the reference trains on the
softmax of its map with every other class at logit 0 (TokenLabeling's tlt/data/mixup.py: get_featuremaps
scatters the top k into zeros, get_label roi-aligns the map over the crop and takes the softmax; read in the copy
indigopyj/MosaicToken@31c7cf82ffe8ebf1843b8fb3bb8ed322ee46db96, tlt/data/mixup.py). Under that reading a cell's
log-probabilities are z_i - log(sum_j exp(z_j) + (C - k)), which is what is stored; this store's rule (the C - k
other classes share what the top k leave) then gives each of them exp(0) / Z, so the targets built from an imported
store are the reference's own (to float16 rounding: the per-cell normaliser is the same for every class and cancels
through roi_align's averaging and the softmax). The teacher's logits of the other classes are not in the files:
nothing closer to the teacher can be recovered from them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import time
from pathlib import Path, PurePosixPath
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from coarse2fine import checkpoints, distributed
from coarse2fine.data import records
from coarse2fine.distributed import Runtime
from coarse2fine.errors import UserError
from coarse2fine.files import file_sha256
from coarse2fine.labels import store, targets
from coarse2fine.labels.generate import STATISTICS, Generation, label_statistics, statistics_dict
from coarse2fine.progress import progress

# float16 holds every integer up to 2048 exactly; past it the reference's class indices are rounded (to even).
MAX_FLOAT16_CLASSES = 2049
# What a store imported from the reference records about its teacher (generate_label.py's view; see above).
REFERENCE_VIEW = "center"


def label_file(import_dir: Path, record_path: str) -> Path:
    """The reference's file for the train image at `record_path` (relative to the data root, as records keep it)."""
    relative = "/".join(PurePosixPath(record_path).parts[-2:])
    return import_dir / f"{relative.partition('.')[0]}.pt"


def read_label_file(path: Path, image: str, *, num_classes: int, top_k: int, grid: int | None) -> torch.Tensor:
    """The [2, k, s, s] float16 tensor of `path` (the labels of train image `image`), checked: k = top_k, s = grid
    (when given), finite scores, integral class indices in [0, num_classes), no class twice in a cell."""
    tensor = checkpoints.load_file(path, f"label file of train image {image}")
    expected = f"[2, {top_k}, {grid or 's'}, {grid or 's'}]"
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float16:
        kind = f"a {tensor.dtype} tensor" if isinstance(tensor, torch.Tensor) else f"a {type(tensor).__name__}"
        raise UserError(f"{path}: {kind}, not the reference's float16 {expected} token labels")
    shape = tuple(tensor.shape)
    if len(shape) != 4 or shape[0] != 2 or shape[2] != shape[3] or (grid is not None and shape[2] != grid):
        raise UserError(f"{path}: token labels of shape {list(shape)}, expected {expected}")
    if shape[1] != top_k:
        raise UserError(
            f"{path}: the top {shape[1]} classes per cell, token_labels.top_k is {top_k}: set it to {shape[1]}"
        )
    scores, classes = tensor.float()
    if not scores.isfinite().all():
        raise UserError(f"{path}: scores that are not finite")
    bad = (classes != classes.round()) | (classes < 0) | (classes >= num_classes)
    if bad.any():
        index = classes[bad][0].item()
        raise UserError(f"{path}: class index {index:g} is not one of the records' {num_classes} classes")
    if (classes.sort(dim=0).values.diff(dim=0) == 0).any():
        raise UserError(f"{path}: a class appears twice in one cell's top {top_k}")
    return tensor


def reference_log_probs(scores: torch.Tensor, num_classes: int) -> torch.Tensor:
    """[..., k, s, s] top-k logits -> their log-probabilities when the other C - k classes have logit 0 (see above)."""
    scores = scores.float()
    others = torch.tensor(float(num_classes - scores.shape[-3])).log()  # -inf when the top k are every class
    return scores - torch.logaddexp(scores.logsumexp(dim=-3, keepdim=True), others)


def import_labels(
    records_dir: str | Path,
    import_dir: str | Path,
    *,
    out_dir: str | Path,
    top_k: int,
    batch_size: int,
    runtime: Runtime,
    header: Mapping[str, Any],
) -> Generation:
    """Fill the store in `out_dir` from the reference's label files under `import_dir`, one per train record,
    matched by the record's path. Ranks split the train shards and write their rows in place; rank 0 writes the
    header last (with the arrays' digest, what identifies an imported store), so a killed import leaves no store."""
    records_dir, import_dir, out_dir = Path(records_dir), Path(import_dir), Path(out_dir)
    num_classes = len(records.read_classes(records_dir))
    if num_classes > MAX_FLOAT16_CLASSES:
        raise UserError(
            f"token_labels.mode: import: the reference stores class indices in float16, exact for at most "
            f"{MAX_FLOAT16_CLASSES} classes; the records have {num_classes}"
        )
    shards = records.shard_files(records_dir, "train")
    shard_infos = records.read_manifest(records_dir)["splits"]["train"]["shards"]  # in the same order
    first = next(records.read_shard(shards[0][0]))
    grid = read_label_file(
        label_file(import_dir, first["path"]), first["path"], num_classes=num_classes, top_k=top_k, grid=None
    ).shape[-1]
    if runtime.is_main:
        shutil.rmtree(out_dir, ignore_errors=True)
        store.allocate_arrays(out_dir, sum(info["count"] for info in shard_infos), top_k, grid, num_classes)
    distributed.barrier()
    arrays = store.open_arrays(out_dir)

    runtime.synchronize()  # GPU timings wait for the queued work, at both ends
    start_time = time.perf_counter()
    sums = torch.zeros(len(STATISTICS), dtype=torch.float64, device=runtime.device)
    mine = shards[runtime.rank :: runtime.world_size]
    total = sum(info["count"] for info in shard_infos[runtime.rank :: runtime.world_size])
    mine_records = (record for tfrecord, _ in mine for record in records.read_shard(tfrecord))
    with progress(total=total, desc="token_labels import", unit="img", disable=not runtime.is_main) as bar:
        for batch in _batches(mine_records, batch_size):
            files = [
                read_label_file(
                    label_file(import_dir, record["path"]), record["path"],
                    num_classes=num_classes, top_k=top_k, grid=grid,
                )
                for record in batch
            ]
            scores, classes = torch.stack(files).float().unbind(dim=1)
            log_probs, classes = reference_log_probs(scores, num_classes), classes.long()
            arrays.write(np.array([record["index"] for record in batch]), log_probs.half().numpy(), classes.numpy())
            labels = torch.tensor([record["label"] for record in batch], device=runtime.device)
            log_probs, classes = log_probs.to(runtime.device), classes.to(runtime.device)
            maps = targets.dense_maps(log_probs, classes, num_classes)  # the reference's map, up to a per-cell shift
            sums += label_statistics(maps, log_probs, classes, labels)
            bar.update(len(batch))
    arrays.flush()
    runtime.synchronize()
    seconds = time.perf_counter() - start_time

    # Also the barrier: every rank's rows are written. A rank without a shard (more ranks than shards) adds zeros.
    totals = distributed.all_reduce_sum(torch.cat([sums, sums.new_tensor([seconds])]))
    if runtime.is_main:
        content = {name: file_sha256(out_dir / name) for name in (store.LOG_PROBS_FILE, store.CLASSES_FILE)}
        digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
        store.write_header(out_dir, arrays, num_classes, **header, content_sha256=digest)
    distributed.barrier()
    return Generation(
        sums=statistics_dict(totals[:-1]),
        generated=len(arrays.log_probs),
        seconds=float(totals[-1]) / runtime.world_size,  # ranks run side by side: their mean wall time
        bytes_per_image=arrays.log_probs[0].nbytes + arrays.classes[0].nbytes,
    )


def _batches(items: Iterator[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    while batch := list(itertools.islice(items, size)):
        yield batch
