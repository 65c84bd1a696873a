"""params `parallel.data/tensor/pipeline`: the mesh's dimensions and their checks, tensor parallelism of ViT and
VOLO blocks, pipeline stages under GPipe and 1F1B, each alone and under FSDP on a data dimension, DCP checkpoints
written under them that a plain model reads, and the Trainer under TP and PP. Real torchrun ranks on gloo.

Run as a script (`torchrun --nproc_per_node=2|4 tests/test_tensor_pipeline.py OUT`), this file is the per-rank
program: for each layout (2 ranks: TP=2, PP=2 with each schedule; 4 ranks: each with FSDP over 2 data ranks) and
model (a small ViT, the tiny VOLO) it trains STEPS SGD steps through the strategy's own forward_backward beside a
plain copy of the model trained on the same micro-batches in the same process, and writes the largest loss and
gradient differences, a DCP checkpoint of the last step and the gathered weights; on 2 ranks, then, the Trainer's
fit() under TP and PP.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch import nn

from coarse2fine import checkpoints, distributed, forward, models
from coarse2fine.config import CustomVolo, Parallel, TimmModel
from coarse2fine.data.transforms import IDENTITY_AFFINE
from coarse2fine.distributed import Runtime
from coarse2fine.errors import UserError
from coarse2fine.labels.targets import moved_rows, token_targets
from coarse2fine.mesh import ParallelDims
from coarse2fine.parallel import pipeline_parallel, strategies, tensor_parallel
from coarse2fine.training import losses, train
from conftest import PROJECT_ROOT, ListLoader, built_once, cpu_runtime, make_params, merge, torchrun_command

BATCH, MICROBATCHES, STEPS, IMG = 8, 4, 3, 32
VIT = TimmModel(name="vit_tiny_patch16_224")  # made small below: embed 32, depth 4, 4 heads, 8 px patches
VOLO = CustomVolo(layers=(1, 1, 1, 1), embed_dims=(32, 64, 64, 64), num_heads=(2, 4, 4, 4))
LAYOUTS = {  # name: params parallel, on 2 ranks
    "tp": Parallel(tensor=2),
    "pp-gpipe": Parallel(pipeline=2, schedule="gpipe", microbatches=MICROBATCHES),
    "pp-1f1b": Parallel(pipeline=2, schedule="1f1b", microbatches=MICROBATCHES),
}
COMPOSED = {  # on 4 ranks: 2 data ranks, each with half the batch
    "tp-fsdp": Parallel(tensor=2, strategy="fsdp"),
    "pp-fsdp": Parallel(pipeline=2, strategy="fsdp", microbatches=MICROBATCHES // 2),
}
SAVED = ("tp", "pp-1f1b", "tp-fsdp", "pp-fsdp")  # the layouts whose DCP checkpoint a plain model reads


def build(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "volo":
        return models.build_model(VOLO, num_classes=10, img_size=IMG)
    import timm

    return timm.create_model(VIT.name, img_size=IMG, patch_size=8, embed_dim=32, depth=4, num_heads=4, num_classes=10)


# ----------------------------------------------------------------------------------------- params and split

def test_the_data_dimension_takes_the_ranks_left_and_a_bad_product_is_one_line():
    assert ParallelDims.of(Parallel(), 8) == ParallelDims(data=8, tensor=1, pipeline=1)
    assert ParallelDims.of(Parallel(tensor=2, pipeline=2), 8) == ParallelDims(data=2, tensor=2, pipeline=2)
    with pytest.raises(ValueError, match=r"^parallel: data 3 x tensor 2 x pipeline 1 does not make the world of 8"):
        ParallelDims.of(Parallel(data=3, tensor=2), 8)
    with pytest.raises(ValueError, match="data auto x tensor 3 x pipeline 1 does not make the world of 8"):
        ParallelDims.of(Parallel(tensor=3), 8)
    # (pipeline, data, tensor), tensor innermost
    dims = ParallelDims(data=2, tensor=2, pipeline=2)
    assert [tuple(dims.coordinates(rank).values()) for rank in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert all(dims.rank_at(*dims.coordinates(rank).values()) == rank for rank in range(8))


def test_params_check_the_layout_against_the_launch_world():
    make_params(launch={"nproc_per_node": 4}, parallel={"tensor": 2, "pipeline": 2})  # data: auto, 1
    with pytest.raises(Exception, match=r"parallel: data 2 x tensor 2 x pipeline 1 does not make the world of 2 "):
        make_params(launch={"nproc_per_node": 2}, parallel={"data": 2, "tensor": 2})
    with pytest.raises(Exception, match="parallel.strategy: ddp replicates whole models only; with tensor 2 x "
                                        "pipeline 1 on 2 data ranks use fsdp"):
        make_params(launch={"nproc_per_node": 4}, parallel={"tensor": 2})
    make_params(launch={"nproc_per_node": 4}, parallel={"tensor": 2, "strategy": "fsdp"})
    with pytest.raises(Exception, match="parallel.microbatches: 1 is fewer than the pipeline's 2 stages"):
        make_params(launch={"nproc_per_node": 2}, parallel={"pipeline": 2, "microbatches": 1})
    with pytest.raises(Exception, match="pretrain.batch_size: 30 does not split into parallel.microbatches 4"):
        make_params(launch={"nproc_per_node": 2}, parallel={"pipeline": 2}, pretrain={"batch_size": 30})
    with pytest.raises(Exception, match="pretrain.token_label.mix_token: not with parallel.pipeline 2"):
        make_params(launch={"nproc_per_node": 2}, parallel={"pipeline": 2},
                    pretrain={"batch_size": 32, "token_label": {"enabled": True, "mix_token": True}})
    with pytest.raises(Exception, match=r"pretrain.ema.enabled: not with parallel.tensor 2 x pipeline 1 \(use ddp"):
        make_params(launch={"nproc_per_node": 2}, parallel={"tensor": 2}, pretrain={"ema": {"enabled": True}})


def test_a_pipeline_deals_the_blocks_out_and_every_weight_has_one_stage():
    for family, expected in (("vit", {"cls_token": 0, "blocks.1": 0, "blocks.2": 1, "head": 1}),
                             # 7 blocks: outlooker, downsample, 3 transformers, 2 class blocks; 4 + 3
                             ("volo", {"patch_embed": 0, "pos_embed": 0, "network.3.0": 0, "network.4.0": 1,
                                       "cls_token": 1, "post_network.1": 1, "aux_head": 1})):
        model = build(family)
        parts = pipeline_parallel.assign(model, 2)
        assert expected.items() <= parts.items()
        keys = {stage: [key for key in model.state_dict() if pipeline_parallel.owner(key, parts) == stage] for stage in (0, 1)}
        for stage in (0, 1):
            kept = build(family)
            pipeline_parallel.keep_stage(kept, stage, parts)
            assert list(kept.state_dict()) == keys[stage]  # the whole model's names, restricted to its stage
    with pytest.raises(UserError, match="parallel.pipeline: 5 stages, but VisionTransformer has 4 blocks"):
        pipeline_parallel.assign(build("vit"), 5)
    resnet = models.build_model(TimmModel(name="resnet10t"), num_classes=10, img_size=32)
    with pytest.raises(UserError, match="parallel.pipeline: 2 splits timm's ViT and VOLO; not ResNet"):
        pipeline_parallel.assign(resnet, 2)


def test_tensor_parallelism_refuses_a_cnn_and_heads_it_cannot_split():
    two, three = SimpleNamespace(size=lambda: 2), SimpleNamespace(size=lambda: 3)  # a mesh as far as the checks go
    resnet = models.build_model(TimmModel(name="resnet10t"), num_classes=10, img_size=32)
    with pytest.raises(UserError, match="parallel.tensor: 2 splits the attention and MLP of timm's ViT and VOLO "
                                        "blocks; ResNet has none"):
        tensor_parallel.parallelize(resnet, two)
    with pytest.raises(UserError, match="parallel.tensor: 3 does not divide blocks.0's 4 attention heads"):
        tensor_parallel.parallelize(build("vit"), three)


def test_clipping_under_a_mesh_clips_as_torch_does_and_reads_no_value_back():
    """Under a mesh the Trainer clips by its own norm (TP's DTensors beside plain tensors, summed over the stages).
    Tensors on the meta device have no values: a host read (`.item()`) raises there, as it would make the GPU wait
    at every update."""
    strategy = strategies.FullyShard(cpu_runtime(), None, ParallelDims(data=1, tensor=2, pipeline=1))
    strategy.mesh = SimpleNamespace()  # a mesh as far as clipping goes: one stage, no sum over stages

    def with_grads(device: str, generator: torch.Generator) -> list[nn.Parameter]:
        parameters = [nn.Parameter(torch.zeros(shape, device=device)) for shape in ((3, 4), (5,))]
        for parameter in parameters:
            parameter.grad = torch.randn(parameter.shape, generator=generator).to(device)
        return parameters

    clipped, reference = (with_grads("cpu", torch.Generator().manual_seed(0)) for _ in range(2))
    strategy.clip_grad_norm_(clipped, 0.5)
    torch.nn.utils.clip_grad_norm_(reference, 0.5)
    assert torch.cat([parameter.grad.flatten() for parameter in reference]).norm() == pytest.approx(0.5)
    torch.testing.assert_close([parameter.grad for parameter in clipped], [parameter.grad for parameter in reference])
    strategy.clip_grad_norm_(with_grads("meta", torch.Generator().manual_seed(0)), 0.5)


def test_a_micro_batch_s_token_targets_are_its_rows_of_the_batch_s_found_without_reading_the_device(monkeypatch):
    """A pipeline's loss sees a micro-batch: its `moved` (row indices into the batch, not a row per sample) is
    its own, a superset of its moved rows of a size the host knows, and its targets are the batch's rows. On the
    meta device (shapes, no values) a host read would raise, as it would stall a GPU's step."""
    inputs = ("token_log_probs", "token_classes", "window", "flip", "affine")
    batch = BATCHES[0]
    expected = token_targets(*(batch[key] for key in inputs), num_classes=10, token_grid=2, smoothing=0.1)
    for rows in torch.arange(TRAIN["batch_size"]).chunk(MICROBATCHES):
        part = train.micro_batch(batch, rows)
        assert set(part["moved"].tolist()) >= set(moved_rows(part["affine"]).tolist())
        got = token_targets(*(part[key] for key in inputs), num_classes=10, token_grid=2, smoothing=0.1,
                            moved=part["moved"])
        torch.testing.assert_close(got.cls, expected.cls[rows], rtol=0, atol=0)
        torch.testing.assert_close(got.tokens, expected.tokens[rows], rtol=0, atol=0)
    part = train.micro_batch({key: value.to("meta") for key, value in batch.items()}, torch.arange(2, device="meta"))
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # none for meta
    output = forward.TrainOutput(torch.zeros(2, 10, device="meta"), torch.zeros(2, 4, 10, device="meta"))
    objective = losses.TokenLabelObjective.from_params(10, make_params(pretrain=TRAIN).pretrain)  # the label mixed in
    assert objective.ground_truth_mix and objective.ground_truth_tokens
    assert objective(output, part).device.type == "meta"


# ------------------------------------------------------------------------------------------- real ranks

def torchrun(nproc: int, out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{out / 'mlflow.db'}"}
    result = subprocess.run(torchrun_command(nproc, __file__, out), cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-5000:]


@pytest.fixture(scope="session")
def ranks_out(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "tensor_pipeline", lambda out: torchrun(2, out))


@pytest.fixture(scope="session")
def composed_out(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "composed", lambda out: torchrun(4, out))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["vit", "volo"])
@pytest.mark.parametrize("layout", [*LAYOUTS, *COMPOSED])
def test_a_layout_trains_as_one_process_does(request, layout, family):
    """Each step's loss and every gradient within 1e-5 of a plain model's on the same micro-batches."""
    out = request.getfixturevalue("composed_out" if layout in COMPOSED else "ranks_out")
    result = json.loads((out / f"{layout}-{family}.json").read_text())
    assert result["steps"] == STEPS and result["gradients"] > 0
    assert result["loss"] < 1e-5 and result["grad"] < 1e-5, result


@pytest.mark.slow
@pytest.mark.parametrize("layout", SAVED)
def test_a_dcp_checkpoint_written_under_a_layout_loads_into_a_plain_model(request, layout):
    import torch.distributed.checkpoint as dcp

    out = request.getfixturevalue("composed_out" if layout in COMPOSED else "ranks_out")
    for family in ("vit", "volo"):
        plain = build(family)
        state = {"model": plain.state_dict()}
        dcp.load(state, checkpoint_id=out / f"{layout}-{family}-dcp" / "shards-3", no_dist=True)
        plain.load_state_dict(state["model"])
        expected = torch.load(out / f"{layout}-{family}-whole.pt", weights_only=True)
        torch.testing.assert_close(plain.state_dict(), expected, rtol=0, atol=0)
        assert any((value - build(family).state_dict()[key]).abs().max() > 1e-4 for key, value in expected.items())


@pytest.mark.slow
def test_the_trainer_trains_under_tp_and_a_pipeline_as_in_one_process(ranks_out, tmp_path, monkeypatch):
    """The one Trainer, through fit(), with the recipe's objective: token labels (targets warped for the samples
    RandAugment moved) and, under TP, MixToken; accumulation, clipping, the epoch's DCP checkpoint, validation and
    the model file. The ranks of a tensor or pipeline group read the same batches, so a world of one with the same
    batches is the reference; a pipeline's, with its micro-batches as batches (BatchNorm's statistics are a
    micro-batch's), and killed after a checkpoint inside the epoch, then resumed. TP runs with torch's fused and
    foreach kernels too, which take a param group's tensors in one call. The model files are plain and agree to
    1e-5, the metrics too, and the images per second count each image once."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    for reference in ("one", "one-micro"):
        _fit(cpu_runtime(), reference, Parallel(), tmp_path)
    for layout, reference in TRAINED.items():
        files = [out / name for out, name in ((ranks_out, layout), (tmp_path, reference))]
        (model, _), (expected_model, _) = (checkpoints.load_model_file(out / "model.pt") for out in files)
        torch.testing.assert_close(model.state_dict(), expected_model.state_dict(), rtol=0, atol=1e-5, msg=layout)
        metrics, expected = (json.loads((out / "metrics" / "metrics.json").read_text()) for out in files)
        assert metrics["val_top1"] == expected["val_top1"]
        for name in ("train_loss", *losses.TARGET_METRICS):
            assert metrics[name] == pytest.approx(expected[name], abs=1e-4), (layout, name)
        images = len(BATCHES) * TRAIN["batch_size"]  # an epoch's, each once: the TP and PP ranks share them
        assert metrics["train_img_per_s"] * metrics["epoch_seconds"] == pytest.approx(images)
        assert not (ranks_out / layout / "ckpt").exists()  # finished: the checkpoint and its shards are gone
    # The pipeline's run was killed after the checkpoint of its first update, inside the epoch: only its last
    # stage's rank computed the objective, and the checkpoint holds its sums (the first two batches' samples).
    killed = json.loads((ranks_out / "pp-1f1b" / "killed.json").read_text())
    assert killed["batches"] == 2 and killed["target_sums"][0] is None
    assert killed["target_sums"][1][-1] == 2 * TRAIN["batch_size"]


# ------------------------------------------------------------------------------------------- the rank program

# The layouts the Trainer runs (2 ranks), each with its reference in a world of one and the kernel its optimizer is
# forced to (None: the CPU's default, a loop over the tensors).
TRAINED = {"tp": "one", "tp-fused": "one", "tp-foreach": "one", "pp-1f1b": "one-micro"}
KERNELS = {"tp-fused": "fused", "tp-foreach": "foreach"}
# Two updates of two micro-batches, clipped (the whole model's norm, over the stages), SGD with momentum, one
# checkpoint inside the epoch (after the first update).
TRAIN = {"epochs": 1, "batch_size": 8, "accum_steps": 2, "clip_grad": 0.5,
         "token_label": {"enabled": True, "mix_token": True, "label_smoothing": 0.1},
         "optimizer": {"name": "sgd", "momentum": 0.9, "lr_base": 0.5}, "schedule": {"warmup_epochs": 0}}
# A pipeline's reference: its micro-batches as batches, as many accumulated; MixToken is refused under a pipeline.
MICRO = {"batch_size": TRAIN["batch_size"] // MICROBATCHES, "accum_steps": TRAIN["accum_steps"] * MICROBATCHES}
NO_MIX_TOKEN = {"token_label": {"mix_token": False}}


def _token_label_batch(seed: int) -> dict[str, torch.Tensor]:
    """A train batch as the loader gives it with token labels: a teacher's top-3 maps of 4 x 4 cells per sample,
    crops, flips, and RandAugment's geometric ops on every other sample (`moved`)."""
    generator = torch.Generator().manual_seed(seed)
    size, top_k, cells = TRAIN["batch_size"], 3, 4
    affine = IDENTITY_AFFINE.repeat(size, 1, 1)
    affine[1::2, 0, 1] = 0.3 * torch.rand(size // 2, generator=generator)  # sheared
    classes = torch.stack([torch.randperm(10, generator=generator)[:top_k] for _ in range(size * cells * cells)])
    return {
        "image": torch.randn(size, 3, IMG, IMG, generator=generator),
        "label": torch.randint(0, 10, (size,), generator=generator),
        "index": torch.arange(size),
        "window": torch.tensor([0.0, 0.0, 1.0, 1.0]) + 0.2 * torch.rand(size, 4, generator=generator) * torch.tensor(
            [1.0, 1.0, -1.0, -1.0]),
        "flip": torch.rand(size, generator=generator) < 0.5,
        "affine": affine,
        "moved": moved_rows(affine),
        "token_log_probs": torch.rand(size, top_k, cells, cells, generator=generator).mul(-3).sub(1).half(),
        "token_classes": classes.view(size, cells, cells, top_k).permute(0, 3, 1, 2).to(torch.int16),
    }


BATCHES = [_token_label_batch(seed) for seed in range(4)]


def _micro_batches(batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Each batch cut into the pipeline's micro-batches, in its order, as a loader would give them."""
    parts = [{key: value[rows] for key, value in batch.items() if key != "moved"}
             for batch in batches for rows in torch.arange(TRAIN["batch_size"]).chunk(MICROBATCHES)]
    return [{**part, "moved": moved_rows(part["affine"])} for part in parts]


def _fit(runtime, layout: str, cfg: Parallel, out: Path) -> None:
    pipelined = layout.startswith("pp") or layout == "one-micro"
    pretrain = merge(merge(copy.deepcopy(TRAIN), MICRO if layout == "one-micro" else {}),
                     NO_MIX_TOKEN if pipelined else {})
    params = make_params(launch={"nproc_per_node": runtime.world_size}, parallel=cfg.model_dump(), pretrain=pretrain,
                         model=VOLO.model_dump(), checkpoint={"every_minutes": 0, "every_updates": 1})
    batches = _micro_batches(BATCHES) if layout == "one-micro" else BATCHES

    def trainer() -> train.Trainer:
        train.seed_everything(params.seed, runtime.data_view(ParallelDims.of(cfg, runtime.world_size)))
        model = models.build_model(params.model, 10, IMG, mix_token=params.pretrain.token_label.mixes_tokens)
        fused = KERNELS.get(layout) == "fused"  # as the Trainer asks on a GPU
        with mock.patch.object(Runtime, "fused_optimizer", True) if fused else contextlib.nullcontext():
            made = train.Trainer(
                stage="pretrain", params=params, cfg=params.pretrain, model=model, classes=[str(i) for i in range(10)],
                train_loader=ListLoader(batches), val_loader=ListLoader(batches), runtime=runtime,
                param_sections=("pretrain",), provenance={"data_digest": "random"},
                paths=train.StagePaths.under(out / layout),
                objective=losses.TokenLabelObjective.from_params(10, params.pretrain),  # the defaults' targets
            )
        if fused:  # SGD: the plain tensors' groups fused, not the DTensors' (torch has no fused SGD for them)
            assert [group["fused"] for group in made.optimizer.param_groups] == [True, False, True, False]
        for group in made.optimizer.param_groups if KERNELS.get(layout) == "foreach" else ():
            group["foreach"] = True  # what torch picks on a GPU when not fused; on the CPU, a loop over the tensors
        return made

    if layout != "pp-1f1b":
        trainer().fit()
        return
    killed = trainer()
    real_backward = killed.backward

    def backward_until_the_second_update(*args, **kwargs):
        if killed.updates == 1:  # after the checkpoint of the first update, inside the epoch
            raise KeyboardInterrupt("killed")
        return real_backward(*args, **kwargs)

    killed.backward = backward_until_the_second_update
    with contextlib.suppress(KeyboardInterrupt):
        killed.fit()
    if runtime.is_main:
        within = torch.load(killed.checkpoint_path, weights_only=True)["within_epoch"]
        sums = [rank["objective"]["target_sums"] for rank in within["ranks"]]
        (out / layout / "killed.json").write_text(json.dumps({
            "batches": within["batches"], "target_sums": [None if rank is None else rank.tolist() for rank in sums]}))
    trainer().fit()


def _loss(output: forward.TrainOutput, labels: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.cross_entropy(output.cls_logits, labels)
    if output.aux_logits is not None:  # VOLO's token logits, as token labeling trains them
        loss = loss + 0.5 * nn.functional.cross_entropy(output.aux_logits.mean(dim=1), labels)
    return loss


def _run(runtime, layout: str, cfg: Parallel, family: str, out: Path) -> None:
    dims = ParallelDims.of(cfg, runtime.world_size)
    model = build(family)
    reference = copy.deepcopy(model)
    strategy = strategies.build(cfg, runtime, None)
    strategy.shard(model)
    train_forward = strategy.wrap(forward.TrainForward(model))
    train_forward.train()
    reference.train()
    # SGD, at a small LR: VOLO's stem BatchNorm, on 8 images, turns 1e-7 float noise between the two models'
    # weights into 3e-5 gradient differences by the third step at lr 0.1.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.02, momentum=0.9)
    worst: dict = {"loss": 0.0, "grad": 0.0, "steps": 0, "gradients": 0}
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        images = torch.randn(BATCH, 3, IMG, IMG, generator=generator)
        labels = torch.randint(0, 10, (BATCH,), generator=generator)
        share = BATCH // dims.data  # this data rank's rows of the batch
        mine = torch.arange(BATCH).tensor_split(dims.data)[dims.coordinates(runtime.rank)["data"]]
        loss = strategy.forward_backward(
            train_forward, images[mine],
            lambda output, rows: _loss(output, labels[mine] if rows is None else labels[mine][rows]),
            contextlib.nullcontext, lambda loss: loss,
        )
        # The reference on every data rank's pipeline micro-batches (BatchNorm's batch statistics are a
        # micro-batch's), its gradient their mean as the data ranks' reduction makes it.
        chunks = cfg.microbatches if dims.pipeline > 1 else 1
        reference_loss = 0.0
        for part in torch.arange(BATCH).tensor_split(dims.data):
            for rows in part.tensor_split(chunks):
                micro = _loss(forward.TrainForward(reference)(images[rows]), labels[rows]) / chunks
                (micro / dims.data).backward()
                reference_loss += micro.item() if torch.equal(part, mine) else 0.0
        assert len(mine) == share
        worst["loss"] = max(worst["loss"], abs(loss.item() - reference_loss))
        reference_grads = {name: parameter.grad for name, parameter in reference.named_parameters()}
        for name, parameter in model.named_parameters():
            grad = parameter.grad.full_tensor() if hasattr(parameter.grad, "full_tensor") else parameter.grad
            difference = (grad - reference_grads[name]).abs().max().item()
            if difference > worst["grad"]:
                worst |= {"grad": difference, "where": f"step {step}: {name}, of magnitude "
                                                       f"{reference_grads[name].abs().max().item():.3g}"}
            worst["gradients"] += 1
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        worst["steps"] += 1
    gathered = distributed.all_gather_objects(worst)
    name = f"{layout}-{family}"
    strategy.average_batchnorm(model)  # as the Trainer does at an epoch's end: the data ranks' VOLO stems agree
    if layout in SAVED:
        strategy.save_state(model, optimizer, out / f"{name}-dcp", tag=STEPS)
    whole = strategy.whole(model).state_dict()
    if runtime.is_main:
        merged = {key: max(result[key] for result in gathered) for key in ("loss", "grad", "steps")}
        merged["where"] = max(gathered, key=lambda result: result["grad"]).get("where")
        merged["gradients"] = sum(result["gradients"] for result in gathered)
        (out / f"{name}.json").write_text(json.dumps(merged))
        torch.save({key: value.clone() for key, value in whole.items()}, out / f"{name}-whole.pt")


def _rank_main(out: str) -> None:
    with distributed.session("cpu") as runtime:
        for layout, cfg in (COMPOSED if runtime.world_size == 4 else LAYOUTS).items():
            for family in ("vit", "volo"):
                (Path(out) / f"{layout}-{family}-dcp").mkdir(parents=True, exist_ok=True)
                _run(runtime, layout, cfg, family, Path(out))
        for layout in TRAINED if runtime.world_size == 2 else ():
            _fit(runtime, layout, LAYOUTS[layout.split("-")[0] if layout in KERNELS else layout], Path(out))


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])
