"""The DALI backend: train/val pipelines over the TFRecord shards (CPU pipeline without a GPU, `mixed` decoding
with one); `build_loader` in loaders.py is the way in.

Train: peek the JPEG's shape -> random_crop_generator(area, aspect) -> decode only that window
(decoders.image_slice) -> resize S x S -> RandAugment -> crop_mirror_normalize (mirror = the hflip coin) ->
random erasing. The window's anchor/shape, the coin and RandAugment's geometry are pipeline outputs: the crop
and what moved its pixels are known exactly, which the token labels need (fn.random_resized_crop would hide it).
Without a GPU the pipeline stops after RandAugment on the decoded crop, and `HostFinish` resizes (torch's
uint8 antialiased kernels), flips, normalises and erases in the loading thread while DALI's threads decode the
next batches: DALI's CPU resize costs about 2.6 ms of CPU and its crop_mirror_normalize 0.5 ms a 224 px image,
the torch finish about 1.5 ms for both, which makes the loader 1.7x faster on 2 cores (`python bench/loader_profile.py`).
On a GPU all of it stays in DALI, on the device. Without one, RandAugment sees the crop before its resize: the
same result for the pointwise colour ops and translations, sharpness's 3x3 kernel acts at the crop's
resolution, and a rotation or shear of a non-square crop is stretched with it by the resize (the targets follow
either way: the affine is normalised by the size the ops saw).
Val: resize the shorter side to floor(S / crop_pct) -> centre crop S (padded if larger) -> normalise.

EXIF orientation is ignored (`adjust_orientation=False` on every decoder and shape peek; DALI's default applies
it): pixels are taken as stored, the ImageNet convention of PIL, torchvision, timm and the TF reference, and the
frame of the torch backend, of the width/height in the records and of the crop windows the token labels follow.

RandAugment versus timm (the torch backend runs timm's own): the same ops and magnitude levels
(transforms.RAND_AUGMENT_OPS; 11 bins = timm's levels 0..10; inc1 -> DALI's monotonic colour suite, inc0 -> its
non-monotonic one; the geometric ops with timm's maxima and random sign), n ops per image, each applied with
probability 0.5 like timm's default (see `rand_augment_with_geometry`). Approximated: `mstd`. DALI takes one
integer magnitude bin for the whole batch, so the magnitude is not jittered around m (same mean, no spread).
The flip is applied after RandAugment, timm's before it: the colour ops commute with a horizontal flip, and a
geometric op's mirror image is the same op with the other sign, as likely; `with_affine` conjugates each flipped
sample's affine by the mirror, so the batch carries the contract's (flip first) affine. Random erasing on the
host is timm's RandomErasing seeded by (seed, epoch, record index), as on the torch backend.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import warnings
from pathlib import Path
from typing import Iterator, Literal

import torch
import torch.nn.functional as F
from nvidia.dali import Pipeline, fn, pipeline_def, types
from nvidia.dali.data_node import DataNode
from nvidia.dali import tfrecord as tfrec
from nvidia.dali.auto_aug import augmentations, rand_augment
from nvidia.dali.auto_aug.core import augmentation, select, signed_bin
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

from coarse2fine.config import MAX_RAND_AUGMENT_MAGNITUDE, Augment, RandAugmentSpec
from coarse2fine.data.sampling import derive_seed, epoch_permutation, LoaderSettings, seeded_global_rngs
from coarse2fine.data.transforms import (
    IMAGE_MEAN,
    IMAGE_STD,
    MAX_ROTATE_DEGREES,
    MAX_SHEAR,
    MAX_TRANSLATE,
    RAND_AUGMENT_OPS,
    homogeneous,
    normalised_affine,
    normalise_pixels,
    random_erasing,
    resized_short_side,
)

READER_NAME = "records"
TRAIN_OUTPUTS = ("image", "label", "index", "image_hw", "crop_box", "flip", "geometry")
VAL_OUTPUTS = ("image", "label", "index", "image_hw")
INTERPOLATION = {"bilinear": types.INTERP_LINEAR, "bicubic": types.INTERP_CUBIC}
# timm's RandomErasing defaults: erased area 2%..1/3 of the image, aspect ratio 0.3..1/0.3 (log-uniform).
ERASE_AREA = (0.02, 1 / 3)
ERASE_ASPECT = (0.3, 1 / 0.3)
# The train reader's shuffle buffer in records (its initial_fill; DALI's default is 1024): each batch is drawn from it
# as the shards stream through in the epoch's order, so it spans 13 ImageNet shards (1,251 records each). Simulated
# at ImageNet scale on 8 ranks (128 shards a rank), two records that shared a batch share one again the next epoch
# 1.1x as often as under a true permutation (8192: 1.6x; 1024: 25x). Memory: where the files are mapped (`maps_records`:
# a local file system), DALI maps buffered records from the files (page cache) while its mapping reservations fit in
# half of vm.max_map_count (32765 by default: one train buffer fits, two at once do not); otherwise, and always where
# they are read with plain file I/O (a network file system), it copies them, 16384 x ~110 KB ImageNet JPEGs = 1.8 GB
# a rank, read before the first batch (4.4 s against 0.03 s mapped, measured on 2 CPU cores).
SHUFFLE_BUFFER = 16384
# DALI's simple executor: run() computes its batch there and then, on DALI's threads. On a CPU it costs about 20 %
# less CPU per 224 px image than DALI's default asynchronous executor (2.2-2.5 against 2.8-3.2 ms, measured on 2
# cores; 1.1 against 1.8 ms at 32 px with RandAugment's many small ops), and the loading shares the cores with the
# step anyway. On a GPU the default one prepares loader.prefetch batches ahead while the GPU runs the step, which is
# what DALI is for there (`executor`).
SIMPLE_EXECUTOR = dict(exec_pipelined=False, exec_async=False)
FEATURES = {
    "image": tfrec.FixedLenFeature((), tfrec.string, ""),
    "label": tfrec.FixedLenFeature([], tfrec.int64, -1),
    "index": tfrec.FixedLenFeature([], tfrec.int64, -1),
}
# DALI's readers map their files unless given `dont_use_mmap`: "Mapping provides a small performance benefit when
# accessing a local file system, but most network file systems, do not provide optimum performance" (DALI 2.4's
# documentation of fn.readers.tfrecord, dont_use_mmap). These file system types (the kernel's names in the mount table)
# are read with plain file I/O under `loader.mmap: auto`: network and cluster file systems, and FUSE mounts ("fuse",
# "fuse.<program>": s3fs, gcsfuse, sshfs, ceph-fuse, ... mostly remote storage served by a user-space program).
# "fuseblk" (a FUSE driver of a local disk, e.g. ntfs-3g) stays mapped.
NETWORK_FILE_SYSTEMS = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "beegfs", "9p", "afs", "pvfs2",
    "orangefs", "wekafs", "panfs", "fuse",
})
MOUNT_TABLE = Path("/proc/self/mountinfo")  # Linux's mounts as this process sees them (DALI runs on Linux only)


def decoder_device(settings: LoaderSettings) -> str:
    """The one CPU/GPU choice: `mixed` decodes on the GPU (everything after it follows), else all on the CPU."""
    return "cpu" if settings.runtime.device_id is None else "mixed"


def executor(settings: LoaderSettings) -> dict[str, bool]:
    """DALI's default pipelined, asynchronous executor on a GPU (batches prefetched while the step runs); the
    simple one on a CPU (SIMPLE_EXECUTOR: less work per image where loading and the step share the cores)."""
    return SIMPLE_EXECUTOR if decoder_device(settings) == "cpu" else {}


def finishes_on_host(settings: LoaderSettings) -> bool:
    """Train batches leave DALI as decoded crops, finished by `HostFinish` (see the module docstring): on a CPU,
    unless `loader.dali_graph: all_dali` asks for the GPU's graph there."""
    return settings.split == "train" and decoder_device(settings) == "cpu" and settings.loader_cfg.dali_graph == "auto"


def file_system_type(path: str, mount_table: str) -> str:
    """The type of the file system holding `path` (absolute, links resolved) by the text of /proc/self/mountinfo:
    the mount with the longest mount point above `path`, the later of two at one point (it hides the earlier).
    A line: id, parent, major:minor, root, mount point, options, optional fields, "-", type, source, options."""
    found, found_length = "", -1
    for line in mount_table.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        # Spaces, tabs, newlines and backslashes in the mount point are written as octal escapes (\040, ...).
        mount_point = re.sub(r"\\([0-7]{3})", lambda escape: chr(int(escape.group(1), 8)), fields[4])
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= found_length:
            found, found_length = fields[fields.index("-", 6) + 1], len(mount_point)
    return found


def is_network_file_system(fs_type: str) -> bool:
    return fs_type in NETWORK_FILE_SYSTEMS or fs_type.startswith("fuse.")


def maps_records(setting: Literal["auto", True, False], files: list[str]) -> bool:
    """Whether DALI maps the record `files`, by `loader.mmap`: true / false as given; auto: unless one of them (links
    resolved: DVC may link them from a cache elsewhere) lies on a network or FUSE file system (NETWORK_FILE_SYSTEMS).
    Mapped where the mount table cannot be read, as DALI does by default."""
    if setting != "auto":
        return setting
    try:
        table = MOUNT_TABLE.read_text(encoding="utf-8", errors="surrogateescape")
    except OSError:
        return True
    return not any(is_network_file_system(file_system_type(os.path.realpath(file), table)) for file in files)


def read_records(
    files: list[str], index_files: list[str], shard_id: int, num_shards: int, shuffle: bool, use_mmap: bool = True
):
    # pad_last_batch: a rank's last batch is filled up with its last record (which the iterator drops), not with
    # the next rank's records. The shuffle draws from a buffer of SHUFFLE_BUFFER records (ignored without it).
    # use_mmap: `maps_records` (DALI's own default: mapped).
    return fn.readers.tfrecord(
        path=files,
        index_path=index_files,
        features=FEATURES,
        shard_id=shard_id,
        num_shards=num_shards,
        random_shuffle=shuffle,
        initial_fill=SHUFFLE_BUFFER,
        pad_last_batch=True,
        dont_use_mmap=not use_mmap,
        name=READER_NAME,
    )


def stored_shape(encoded):
    """(height, width) of the image as stored, EXIF orientation ignored like the decoders here."""
    return fn.peek_image_shape(encoded, adjust_orientation=False)[0:2]


def normalise(image, img_size: int, mirror=0):
    """uint8 HWC -> float CHW normalised with timm's ImageNet mean/std; crops centrally to S x S, padding black
    like torchvision's CenterCrop (the fill is in output units: black normalised)."""
    return fn.crop_mirror_normalize(
        image,
        crop=(img_size, img_size),
        out_of_bounds_policy="pad",
        fill_values=[-mean / std for mean, std in zip(IMAGE_MEAN, IMAGE_STD)],
        mirror=mirror,
        mean=[255 * value for value in IMAGE_MEAN],
        std=[255 * value for value in IMAGE_STD],
        dtype=types.FLOAT,
        output_layout="CHW",
    )


def rotate_pixels(image, angle, shape):
    step = fn.transforms.rotation(angle=angle, center=shape[::-1] * 0.5)  # shape (h, w); centre (x, y)
    return warp(image, step), step


def shear_pixels(image, shear):
    step = fn.transforms.shear(shear=shear)
    return warp(image, step), step


def translate_pixels(image, share, shape):
    step = fn.transforms.translation(offset=share * shape[::-1])
    return warp(image, step), step


def warp(image, step):
    # timm's fill for what moves in from outside: its img_mean default, grey (128, 128, 128).
    return fn.warp_affine(image, matrix=step, fill_value=128, inverse_map=False)


# transforms.RAND_AUGMENT_GEOMETRIC_OPS as DALI augmentations that return (image, the forward pixel map applied) with
# timm's magnitudes: level m is m / 10 of the maximum, with a random sign.
GEOMETRIC_AUGMENTATIONS = {
    "rotate": augmentation(rotate_pixels, mag_range=(0, MAX_ROTATE_DEGREES), randomly_negate=True),
    "shear_x": augmentation(
        shear_pixels, mag_range=(0, MAX_SHEAR), randomly_negate=True, mag_to_param=augmentations.warp_x_param
    ),
    "shear_y": augmentation(
        shear_pixels, mag_range=(0, MAX_SHEAR), randomly_negate=True, mag_to_param=augmentations.warp_y_param
    ),
    "translate_x": augmentation(
        translate_pixels, mag_range=(0, MAX_TRANSLATE), randomly_negate=True, mag_to_param=augmentations.warp_x_param
    ),
    "translate_y": augmentation(
        translate_pixels, mag_range=(0, MAX_TRANSLATE), randomly_negate=True, mag_to_param=augmentations.warp_y_param
    ),
}


def colour_op(op):
    def apply(image, geometry, **op_kwargs):
        return op(image, **op_kwargs), geometry

    return apply


def geometric_op(op):
    def apply(image, geometry, **op_kwargs):
        image, step = op(image, **op_kwargs)
        return image, fn.transforms.combine(geometry, step)  # `step` after the ops so far

    return apply


def unchanged(image, geometry, **op_kwargs):
    return image, geometry


def rand_augment_ops(spec: RandAugmentSpec) -> dict:
    """transforms.RAND_AUGMENT_OPS as DALI ops (name -> op), each `op(image, geometry, magnitude_bin=...,
    num_magnitude_bins=..., shape=...) -> (image, geometry)`, the geometry composed with its pixel map."""
    if spec.increasing:
        suite = rand_augment.get_rand_augment_suite()
    else:
        suite = rand_augment.get_rand_augment_non_monotonic_suite()
    # invert and solarize_add are in timm's set but not in DALI's default suite; DALI provides both ops.
    colour = {op.name: op for op in [*suite, augmentations.invert, augmentations.solarize_add]}
    return {
        name: geometric_op(GEOMETRIC_AUGMENTATIONS[name]) if name in GEOMETRIC_AUGMENTATIONS
        else colour_op(colour[name])
        for name in RAND_AUGMENT_OPS
    }


def rand_augment_with_geometry(image, spec: RandAugmentSpec, shape: DataNode):
    """timm's RandAugment over transforms.RAND_AUGMENT_OPS on `image` (its size (h, w) in `shape`) -> (image, the
    forward pixel map its geometric ops composed to). DALI's apply_rand_augment cannot return that map, so the
    selection is done here with DALI's own `select`, carrying (image, map) through every op.

    The rule for what `select` (or any `if` on a DataNode) passes to the ops: per-sample data only, i.e. DataNodes
    (an op's output or a `types.Constant(..., device="cpu")`). DALI's conditionals split DataNodes by the branch
    each sample takes; a Python or numpy value becomes an argument of the whole batch that no split reaches, and
    the op fails on the first batch a branch does not take whole ("ArgumentInput has to have the same batch size
    as an input": the GPU graph's crash of 2026-11-27, its `shape` a numpy array)."""
    if not isinstance(shape, DataNode):
        raise TypeError(f"shape must be a DataNode (per-sample data under select), not {type(shape).__name__}")
    ops = list(rand_augment_ops(spec).values())
    # timm applies each drawn op with probability 0.5: the last entry, unchanged, is drawn as often as all ops.
    choices = list(range(len(ops))) + [len(ops)] * len(ops)
    ops.append(unchanged)
    geometry = fn.transforms.translation(offset=[0.0, 0.0])  # the identity, one per sample
    for _ in range(spec.num_ops):
        drawn = fn.random.uniform(values=choices, dtype=types.INT32)
        image, geometry = select(
            ops, drawn, image, geometry,
            # DALI's bins run 0..bins-1 over each op's range: 11 bins put magnitude m where timm's level m / 10 is.
            magnitude_bin=signed_bin(spec.magnitude), num_magnitude_bins=MAX_RAND_AUGMENT_MAGNITUDE + 1, shape=shape,
        )
    return image, geometry


def random_erase(image, probability: float, img_size: int):
    """timm's RandomErasing, pixel mode: with `probability`, one box filled with per-pixel N(0, 1) noise (in
    normalised units). The box is drawn by random_crop_generator, which samples area and log-aspect like timm."""
    box_anchor, box_shape = fn.random_crop_generator(
        types.Constant([img_size, img_size], dtype=types.INT64, device="cpu"),
        random_area=ERASE_AREA,
        random_aspect_ratio=ERASE_ASPECT,
    )
    if fn.random.coin_flip(probability=probability, dtype=types.BOOL):
        # Only operators DALI registers for the GPU too (fn.ones_like is CPU-only): the image with the box zeroed,
        # plus the noise with everything but the box zeroed.
        box = dict(
            anchor=fn.cast(box_anchor, dtype=types.FLOAT),  # erase takes float coordinates
            shape=fn.cast(box_shape, dtype=types.FLOAT),
            axis_names="HW",
            fill_value=0,
        )
        noise = fn.reshape(fn.random.normal(image), layout="CHW")  # erase finds H and W by the layout
        image = fn.erase(image, **box) + (noise - fn.erase(noise, **box))
    return image


def train_pipeline(augment: Augment, rand_spec: RandAugmentSpec | None, finish_on_host: bool, **arguments) -> Pipeline:
    """The train graph (`_train_graph`'s arguments, and the Pipeline's). An `if` on a DataNode (random erasing's
    draw, RandAugment's select) needs DALI's conditionals, whose AutoGraph rewrite of the graph's source costs every
    process 0.4-0.6 s on its first train loader: they are on only when the graph has one."""
    conditionals = rand_spec is not None or (augment.reprob > 0 and not finish_on_host)
    return _train_graph(
        augment=augment, rand_spec=rand_spec, finish_on_host=finish_on_host, enable_conditionals=conditionals,
        **arguments,
    )


@pipeline_def
def _train_graph(
    files, index_files, shard_id, num_shards, img_size, augment: Augment, rand_spec: RandAugmentSpec | None, device,
    finish_on_host: bool, use_mmap: bool = True,
):
    record = read_records(files, index_files, shard_id, num_shards, shuffle=True, use_mmap=use_mmap)
    image_hw = stored_shape(record["image"])
    crop_anchor, crop_shape = fn.random_crop_generator(
        image_hw, random_area=augment.scale, random_aspect_ratio=augment.ratio
    )
    crop_box = fn.cat(fn.cast(crop_anchor, dtype=types.INT64), fn.cast(crop_shape, dtype=types.INT64))
    image = fn.decoders.image_slice(
        record["image"], start=crop_anchor, shape=crop_shape, axis_names="HW", device=device, output_type=types.RGB,
        adjust_orientation=False,
    )
    flip = fn.random.coin_flip(probability=augment.hflip)
    if finish_on_host:
        shape = fn.cast(crop_shape, dtype=types.FLOAT)  # RandAugment acts on the decoded crop
    else:
        image = fn.resize(image, size=(img_size, img_size), interp_type=INTERPOLATION[augment.interpolation])
        shape = types.Constant([img_size, img_size], dtype=types.FLOAT, device="cpu")  # a DataNode: see select's rule
    if rand_spec is not None:
        image, geometry = rand_augment_with_geometry(image, rand_spec, shape)
    else:
        geometry = fn.transforms.translation(offset=[0.0, 0.0])
    if not finish_on_host:
        image = normalise(image, img_size, mirror=flip)
        if augment.reprob > 0:
            image = random_erase(image, augment.reprob, img_size)
    return image, record["label"], record["index"], image_hw, crop_box, flip, geometry


# x -> 1 - x in normalised coordinates: the horizontal flip, its own inverse.
MIRROR = torch.tensor([[-1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)


def with_affine(batch: dict[str, torch.Tensor], size_hw: torch.Tensor) -> dict[str, torch.Tensor]:
    """Replaces the graph's `geometry` (forward pixel maps of RandAugment's geometric ops, on images of `size_hw`)
    by the batch contract's `affine` (loaders.py): inverted, normalised, and for flipped samples conjugated by
    the mirror, since DALI flips after RandAugment where the contract (and timm) flips before it."""
    to_input = torch.linalg.inv(homogeneous(batch.pop("geometry").to(torch.float64)))
    affine = homogeneous(normalised_affine(to_input[:, :2], size_hw).to(torch.float64))
    flip = batch["flip"].to(torch.bool).cpu()
    mirrored = MIRROR @ affine @ MIRROR
    affine = torch.where(flip.view(-1, 1, 1), mirrored, affine)
    return {**batch, "affine": affine[:, :2].to(torch.float32)}


def owned_on_host(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with its host tensors (on a GPU: label, index, crop box, ...: bytes, not images) copied into torch's
    memory. Under DALI's default executor, a GPU's, DALIGenericIterator hands out zero-copy views of DALI's own output
    buffers (torch.from_dlpack), which DALI may reuse once the view is dropped; `Loader` sends host tensors to the
    GPU with non_blocking, so a view in pinned memory could be read after the next batch overwrote it. Whether
    DALI's host buffers are pinned and reused that soon is not visible from a CPU: the copy costs nothing that shows
    and removes the question."""
    return {key: value.clone() if value.device.type == "cpu" else value for key, value in batch.items()}


class HostFinish:
    """A CPU train pipeline's batch of decoded crops (uint8 HWC, each its own size) -> the raw batch: each crop
    resized to S x S (torch uint8 kernels, antialiased), flipped by its coin, normalised, randomly erased."""

    def __init__(self, settings: LoaderSettings):
        augment = settings.augment_cfg
        self.size = (settings.img_size, settings.img_size)
        self.mode = augment.interpolation  # "bilinear" | "bicubic": F.interpolate's names too
        self.erase = random_erasing(augment)
        self.seed = settings.seed

    def __call__(self, outputs: tuple, epoch: int) -> dict[str, torch.Tensor]:
        crops, *rest = outputs  # TensorListCPU each, in TRAIN_OUTPUTS order
        batch = {name: torch.from_numpy(values.as_array()) for name, values in zip(TRAIN_OUTPUTS[1:], rest)}
        images = []
        for position, flip in enumerate(batch["flip"].tolist()):
            pixels = torch.from_numpy(crops.at(position)).permute(2, 0, 1)[None]  # HWC -> a channels-last view
            pixels = F.interpolate(pixels, size=self.size, mode=self.mode, antialias=True)[0]
            image = normalise_pixels(pixels.flip(-1) if flip else pixels)
            if self.erase is not None:
                with seeded_global_rngs(derive_seed(self.seed, epoch, int(batch["index"][position]))):
                    image = self.erase(image)
            images.append(image)
        batch["image"] = torch.stack(images)
        return with_affine(batch, batch["crop_box"][:, 2:])


@pipeline_def
def val_pipeline(
    files, index_files, shard_id, num_shards, img_size, crop_pct, interpolation, device, use_mmap: bool = True
):
    record = read_records(files, index_files, shard_id, num_shards, shuffle=False, use_mmap=use_mmap)
    image_hw = stored_shape(record["image"])
    image = fn.decoders.image(record["image"], device=device, output_type=types.RGB, adjust_orientation=False)
    image = fn.resize(
        image, resize_shorter=resized_short_side(img_size, crop_pct), interp_type=INTERPOLATION[interpolation]
    )
    return normalise(image, img_size), record["label"], record["index"], image_hw


class DaliBackend:
    """Per epoch, a fresh pipeline seeded by (seed, epoch, rank); train reads the shards in the epoch's order (see
    loaders.py for why and what it costs)."""

    def __init__(self, shards: list[tuple[Path, Path]], settings: LoaderSettings):
        self._settings = settings
        self._shards = shards
        self._host_finish = HostFinish(settings) if finishes_on_host(settings) else None
        self.maps_records = maps_records(settings.loader_cfg.mmap, [str(tfrecord) for tfrecord, _ in shards])

    def batches(self, epoch: int, start_batch: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """From batch `start_batch` on: the pipeline runs through the batches before it (its readers and random
        draws are streams), which are not finished or handed out."""
        settings = self._settings
        training = settings.split == "train"
        shards = self._shards
        if training:
            shards = [shards[position] for position in epoch_permutation(len(shards), settings.seed, epoch).tolist()]
        pipeline = self._define(shards, seed=derive_seed(settings.seed, epoch, settings.runtime.rank))
        if self._host_finish is not None:
            # Crops differ in size, which DALIGenericIterator cannot batch: run the pipeline directly. `Loader`
            # stops after the batches every rank can fill, before the reader's end; the StopIteration is only a
            # guard.
            pipeline.build()
            for produced in itertools.count():
                try:
                    crops_and_rest = pipeline.run()
                except StopIteration:
                    return
                if produced >= start_batch:
                    yield self._host_finish(crops_and_rest, epoch)
        outputs = TRAIN_OUTPUTS if training else VAL_OUTPUTS
        # DROP: a rank's partial last batch would be extra steps the other ranks do not take.
        policy = LastBatchPolicy.DROP if training else LastBatchPolicy.PARTIAL
        size_hw = torch.tensor([[settings.img_size, settings.img_size]])
        iterator = DALIGenericIterator(pipeline, list(outputs), reader_name=READER_NAME, last_batch_policy=policy)
        for (batch,) in itertools.islice(iterator, start_batch, None):
            if pipeline.exec_dynamic:  # the iterator's outputs are views of DALI's buffers, not copies
                batch = owned_on_host(batch)
            yield with_affine(batch, size_hw.expand(len(batch["flip"]), 2)) if training else batch

    def _define(self, shards: list[tuple[Path, Path]], seed: int) -> Pipeline:
        """The pipeline over `shards` in that order, which DALI splits into world_size contiguous record ranges:
        this rank reads the rank-th."""
        settings = self._settings
        common = dict(
            batch_size=settings.batch_size,
            num_threads=max(1, settings.loader_cfg.workers),
            device_id=settings.runtime.device_id,
            prefetch_queue_depth=settings.loader_cfg.prefetch,
            **executor(settings),
            seed=seed,
            files=[str(tfrecord) for tfrecord, _ in shards],
            index_files=[str(index) for _, index in shards],
            shard_id=settings.runtime.rank,
            num_shards=settings.runtime.world_size,
            use_mmap=self.maps_records,
            img_size=settings.img_size,
            device=decoder_device(settings),
        )
        with _without_dali_alias_warnings():
            if settings.split == "train":
                return train_pipeline(
                    augment=settings.augment_cfg, rand_spec=settings.augment_cfg.rand_augment_spec,
                    finish_on_host=finishes_on_host(settings), **common,
                )
            return val_pipeline(crop_pct=settings.crop_pct, interpolation=settings.augment_cfg.interpolation, **common)


@contextlib.contextmanager
def _without_dali_alias_warnings() -> Iterator[None]:
    """DALI's own auto_aug calls deprecated `fn.experimental.*` aliases and forces those warnings on
    (simplefilter("default") inside its warn); catch them while defining a graph, re-emit any other warning."""
    with warnings.catch_warnings(record=True) as caught:
        yield
    for warning in caught:
        if "nvidia.dali.fn.experimental" not in str(warning.message):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
