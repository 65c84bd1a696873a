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

import pytest
import torch
from torch import nn

from coarse2fine import distributed, models, parallel, pipeline, tensor_parallel, train
from coarse2fine.config import CustomVolo, Parallel, TimmModel
from coarse2fine.errors import UserError
from coarse2fine.mesh import ParallelDims
from conftest import PROJECT_ROOT, ListLoader, cpu_runtime, make_params

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
        parts = pipeline.assign(model, 2)
        assert expected.items() <= parts.items()
        keys = {stage: [key for key in model.state_dict() if pipeline.owner(key, parts) == stage] for stage in (0, 1)}
        for stage in (0, 1):
            kept = build(family)
            pipeline.keep_stage(kept, stage, parts)
            assert list(kept.state_dict()) == keys[stage]  # the whole model's names, restricted to its stage
    with pytest.raises(UserError, match="parallel.pipeline: 5 stages, but VisionTransformer has 4 blocks"):
        pipeline.assign(build("vit"), 5)
    resnet = models.build_model(TimmModel(name="resnet10t"), num_classes=10, img_size=32)
    with pytest.raises(UserError, match="parallel.pipeline: 2 splits timm's ViT and VOLO; not ResNet"):
        pipeline.assign(resnet, 2)


def test_tensor_parallelism_refuses_a_cnn_and_heads_it_cannot_split():
    two, three = SimpleNamespace(size=lambda: 2), SimpleNamespace(size=lambda: 3)  # a mesh as far as the checks go
    resnet = models.build_model(TimmModel(name="resnet10t"), num_classes=10, img_size=32)
    with pytest.raises(UserError, match="parallel.tensor: 2 splits the attention and MLP of timm's ViT and VOLO "
                                        "blocks; ResNet has none"):
        tensor_parallel.parallelize(resnet, two)
    with pytest.raises(UserError, match="parallel.tensor: 3 does not divide blocks.0's 4 attention heads"):
        tensor_parallel.parallelize(build("vit"), three)


# ------------------------------------------------------------------------------------------- real ranks

def torchrun(nproc: int, out: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__,
               str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{out / 'mlflow.db'}"}
    result = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-5000:]


@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tensor_pipeline")
    torchrun(2, out)
    return out


@pytest.fixture(scope="module")
def composed_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("composed")
    torchrun(4, out)
    return out


@pytest.mark.parametrize("family", ["vit", "volo"])
@pytest.mark.parametrize("layout", [*LAYOUTS, *COMPOSED])
def test_a_layout_trains_as_one_process_does(request, layout, family):
    """Each step's loss and every gradient within 1e-5 of a plain model's on the same micro-batches."""
    out = request.getfixturevalue("composed_out" if layout in COMPOSED else "ranks_out")
    result = json.loads((out / f"{layout}-{family}.json").read_text())
    assert result["steps"] == STEPS and result["gradients"] > 0
    assert result["loss"] < 1e-5 and result["grad"] < 1e-5, result


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


def test_the_trainer_trains_under_tp_and_a_pipeline_as_in_one_process(ranks_out, tmp_path, monkeypatch):
    """The one Trainer, through fit(): accumulation, clipping, the epoch's DCP checkpoint, validation and the model
    file; the ranks of a tensor or pipeline group read the same batches, so the world of one with the same
    batches is the reference. The model files are plain and agree to 1e-5."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    _fit(cpu_runtime(), "one", Parallel(), tmp_path)
    reference = models.load_model_file(tmp_path / "one" / "model.pt")[0].state_dict()
    for layout in TRAINED:
        model, _ = models.load_model_file(ranks_out / layout / "model.pt")
        torch.testing.assert_close(model.state_dict(), reference, rtol=0, atol=1e-5)
        metrics = json.loads((ranks_out / layout / "metrics" / "metrics.json").read_text())
        expected = json.loads((tmp_path / "one" / "metrics" / "metrics.json").read_text())
        assert metrics["train_loss"] == pytest.approx(expected["train_loss"], abs=1e-5)
        assert metrics["val_top1"] == expected["val_top1"]
        assert not (ranks_out / layout / "ckpt").exists()  # finished: the checkpoint and its shards are gone


# ------------------------------------------------------------------------------------------- the rank program

TRAINED = ("tp", "pp-1f1b")  # the layouts the Trainer runs (2 ranks)
# Two updates of two micro-batches, clipped (the whole model's norm, over the stages), SGD with momentum.
TRAIN = {"epochs": 1, "batch_size": 8, "accum_steps": 2, "clip_grad": 0.5, "token_label": {"enabled": False},
         "optimizer": {"name": "sgd", "momentum": 0.9, "lr_base": 0.5}, "schedule": {"warmup_epochs": 0}}


def _fit(runtime, layout: str, cfg: Parallel, out: Path) -> None:
    # timm's test ViT (embed 64, 6 blocks, 2 heads): VOLO's ground-truth loss goes through a max over tokens,
    # whose choice float noise can flip (the component tests above cover VOLO)
    params = make_params(launch={"nproc_per_node": runtime.world_size}, parallel=cfg.model_dump(), pretrain=TRAIN,
                         model={"name": "test_vit"})
    train.seed_everything(params.seed, runtime.data_view(ParallelDims.of(cfg, runtime.world_size)))
    model = models.build_model(params.model, 10, IMG)
    generator = torch.Generator().manual_seed(0)
    batches = [{"image": torch.randn(8, 3, IMG, IMG, generator=generator),
                "label": torch.randint(0, 10, (8,), generator=generator)} for _ in range(4)]
    train.Trainer(
        stage="pretrain", params=params, cfg=params.pretrain, model=model, classes=[str(i) for i in range(10)],
        train_loader=ListLoader(batches), val_loader=ListLoader(batches), runtime=runtime,
        param_sections=("pretrain",), provenance={"data_digest": "random"}, checkpoint_dir=out / layout / "ckpt",
        model_file=out / layout / "model.pt", metrics_dir=out / layout / "metrics",
    ).fit()


def _loss(output: models.TrainOutput, labels: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.cross_entropy(output.cls_logits, labels)
    if output.aux_logits is not None:  # VOLO's token logits, as token labeling trains them
        loss = loss + 0.5 * nn.functional.cross_entropy(output.aux_logits.mean(dim=1), labels)
    return loss


def _run(runtime, layout: str, cfg: Parallel, family: str, out: Path) -> None:
    dims = ParallelDims.of(cfg, runtime.world_size)
    model = build(family)
    reference = copy.deepcopy(model)
    strategy = parallel.build(cfg, runtime, None)
    strategy.shard(model)
    train_forward = strategy.wrap(models.TrainForward(model))
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
                micro = _loss(models.TrainForward(reference)(images[rows]), labels[rows]) / chunks
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
            _fit(runtime, layout, LAYOUTS[layout], Path(out))


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])
