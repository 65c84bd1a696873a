"""`parallel.strategy: fsdp`: FSDP2 per block in the one Trainer, DCP checkpoints that load at another world size,
and a model file that needs no FSDP. Real torchrun ranks on gloo.

Run as a script (`torchrun --nproc_per_node=N tests/test_fsdp.py save|resume DIR`), this file is the per-rank
program of the DCP test: `save` trains two SGD-with-momentum steps on fixed batches, writes the DCP checkpoint,
takes a third step and dumps the gathered weights; `resume` loads the checkpoint at its own world size and takes
the same third step (the same global batch, split over its ranks)."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from coarse2fine import checkpoints, distributed, forward, models
from coarse2fine.config import CustomVolo, TimmModel
from coarse2fine.parallel import model_blocks, strategies
from coarse2fine.training import train
from conftest import PROJECT_ROOT, launch_command, make_params, torchrun_command
from test_scale_out import SGD, finish, one_node_two_ranks, outcome, start_stage  # one_node_two_ranks: a fixture

GLOBAL_BATCH = 8


def test_blocks_are_the_members_of_the_model_s_containers():
    volo = models.build_model(CustomVolo(), num_classes=10, img_size=32)
    assert [type(block).__name__ for block in model_blocks.blocks(volo)] == [
        "Outlooker", "Downsample", "Transformer", "Transformer", "Transformer", "ClassBlock", "ClassBlock",
    ]
    resnet = models.build_model(TimmModel(name="resnet10t"), num_classes=10, img_size=32)
    residual = [block for name in ("layer1", "layer2", "layer3", "layer4") for block in getattr(resnet, name)]
    assert [block for block in model_blocks.blocks(resnet) if type(block).__name__ == "BasicBlock"] == residual
    vit = models.build_model(TimmModel(name="vit_tiny_patch16_224"), num_classes=10, img_size=32)
    assert [type(block).__name__ for block in model_blocks.blocks(vit)] == ["Block"] * 12


def test_fsdp_refuses_what_it_cannot_shard():
    with pytest.raises(Exception, match="pretrain.ema.enabled: not with parallel.strategy fsdp"):
        make_params(parallel={"strategy": "fsdp"}, pretrain={"ema": {"enabled": True}})
    with pytest.raises(Exception, match="finetune.precision: fp16 is not supported with parallel.strategy fsdp"):
        make_params(parallel={"strategy": "fsdp"}, finetune={"precision": "fp16"})


# ------------------------------------------------------------------------------------------ real runs (slow)

@pytest.fixture(scope="module")
def fsdp_run(digits_records, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    finish(start_stage(out, digits_records, {"nproc_per_node": 2}, {"parallel": {"strategy": "fsdp"}, "pretrain": SGD}))
    return out


@pytest.mark.slow
def test_fsdp_trains_the_pretrain_stage_as_ddp_does(fsdp_run, one_node_two_ranks, digits_records, tmp_path):
    """Against test_scale_out's DDP reference, with the same SGD (both strategies agree to 1e-7 on the gradients;
    AdamW would turn that into 1e-3 on a few weights whose gradient is noise)."""
    (ddp_weights, ddp_metrics) = outcome(one_node_two_ranks)
    (fsdp_weights, fsdp_metrics) = outcome(fsdp_run)
    assert ddp_weights.keys() == fsdp_weights.keys()  # a plain state dict: no FSDP or DTensor names
    torch.testing.assert_close(fsdp_weights, ddp_weights, rtol=0, atol=1e-5)
    assert fsdp_metrics["val_top1"] == ddp_metrics["val_top1"]
    assert not (fsdp_run / "ckpt").exists()  # finished: the checkpoint and its shards are gone

    # The model file is a plain one: loaded without FSDP, it evaluates to the stage's own top-1.
    model, card = checkpoints.load_model_file(fsdp_run / "model" / "model.pt")
    assert all(type(tensor) is torch.Tensor for tensor in model.state_dict().values())
    evaluation = subprocess.run(
        launch_command("stages/evaluate.py", "--model", fsdp_run / "model" / "model.pt", "--settings", "pretrain",
                       "--records", digits_records, "--out", tmp_path / "evaluate", "--params", fsdp_run / "params.yaml"),
        cwd=PROJECT_ROOT, env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'eval.db'}"},
        capture_output=True, text=True, timeout=300,
    )
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    assert json.loads((tmp_path / "evaluate" / "metrics.json").read_text())["top1"] == fsdp_metrics["val_top1"]


@pytest.mark.slow
def test_a_killed_fsdp_stage_resumes_from_its_dcp_checkpoint_to_the_uninterrupted_result(fsdp_run, digits_records,
                                                                                        tmp_path):
    process = start_stage(tmp_path, digits_records, {"nproc_per_node": 2},
                             {"parallel": {"strategy": "fsdp"}, "pretrain": SGD})
    checkpoint = tmp_path / "ckpt" / train.CHECKPOINT_FILE
    deadline = time.monotonic() + 600
    while not checkpoint.exists():  # epoch 1 is saved: kill the stage, launcher and ranks, while epoch 2 trains
        assert process.poll() is None, process.communicate(timeout=60)[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint after 600 s"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    killed_at = torch.load(checkpoint, weights_only=True)
    # Named by the update count (every checkpoint of a run has its own, inside an epoch or at its end).
    assert killed_at["epoch"] == 1 and killed_at["sharded"] == f"shards-{killed_at['updates']}"
    assert (tmp_path / "ckpt" / killed_at["sharded"]).is_dir()

    stdout = finish(start_stage(tmp_path, digits_records, {"nproc_per_node": 2},
                                   {"parallel": {"strategy": "fsdp"}, "pretrain": SGD}))
    assert "resumed from epoch 1" in stdout
    (weights, metrics), (reference_weights, reference_metrics) = outcome(tmp_path), outcome(fsdp_run)
    torch.testing.assert_close(weights, reference_weights, rtol=0, atol=0)
    assert metrics == reference_metrics


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_dcp_checkpoint_resumes_at_another_world_size_and_continues_identically(world, tmp_path_factory, tmp_path):
    saved = tmp_path_factory.getbasetemp() / "dcp_saved"
    if not (saved / "after_step_3.pt").exists():
        torchrun(2, "save", saved)
    torchrun(world, "resume", saved, tmp_path)
    expected = torch.load(saved / "after_step_3.pt", weights_only=True)
    resumed = torch.load(tmp_path / "after_step_3.pt", weights_only=True)
    torch.testing.assert_close(resumed, expected, rtol=0, atol=1e-6)
    assert any((resumed[name] - before).abs().max() > 1e-4  # the third step moved the weights
               for name, before in torch.load(saved / "after_step_2.pt", weights_only=True).items())


@pytest.mark.slow
def test_fsdp_trains_in_bf16_on_the_cpu(tmp_path):
    """FSDP2 gathers the parameters in bf16 but BatchNorm's (VOLO's stem), whose CPU kernel takes no bf16 weights
    beside its fp32 running statistics: the step's loss and gradient are a plain model's under bf16 autocast, to
    bf16's precision."""
    torchrun(2, "bf16", tmp_path)
    result = json.loads((tmp_path / "bf16.json").read_text())
    assert result["loss"] == pytest.approx(result["reference_loss"], rel=2e-2)
    assert result["gradient_error"] < 3e-2, result  # relative, of the whole gradient


def torchrun(nproc: int, *args) -> None:
    result = subprocess.run(torchrun_command(nproc, __file__, *args), cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch (the same for every world size), this rank's share of it."""
    generator = torch.Generator().manual_seed(step)
    images = torch.randn(GLOBAL_BATCH, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (GLOBAL_BATCH,), generator=generator)
    share = GLOBAL_BATCH // world
    return images[rank * share:(rank + 1) * share], labels[rank * share:(rank + 1) * share]


def _bf16_step(runtime, out_dir: Path) -> None:
    """One bf16 forward and backward of a VOLO under FSDP2 beside a plain copy on every rank's half of the batch."""
    torch.manual_seed(0)
    model = models.build_model(CustomVolo(), num_classes=10, img_size=32)
    reference = copy.deepcopy(model)
    strategy = strategies.FullyShard(runtime, torch.bfloat16)
    strategy.shard(model)
    world = torch.distributed.get_world_size()

    def loss_of(module: nn.Module, rank: int) -> torch.Tensor:
        images, labels = _batch(1, rank, world)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return nn.functional.cross_entropy(forward.TrainForward(module)(images).merged().float(), labels)

    loss = loss_of(model, runtime.rank)
    loss.backward()
    reference_losses = [loss_of(reference, rank) for rank in range(world)]
    (sum(reference_losses) / world).backward()  # the data ranks' mean, as FSDP reduces the gradients
    gradient = torch.cat([parameter.grad.full_tensor().flatten() for parameter in model.parameters()])
    expected = torch.cat([parameter.grad.flatten() for parameter in reference.parameters()])
    losses = distributed.all_gather_objects(loss.item())
    if runtime.rank == 0:
        (out_dir / "bf16.json").write_text(json.dumps({
            "loss": sum(losses) / world, "reference_loss": sum(loss.item() for loss in reference_losses) / world,
            "gradient_error": ((gradient - expected).norm() / expected.norm()).item(),
        }))


def _rank_main(mode: str, saved: str, out: str | None = None) -> None:
    saved_dir, out_dir = Path(saved), Path(out or saved)
    with distributed.session("cpu") as runtime:
        if mode == "bf16":
            _bf16_step(runtime, out_dir)
            return
        torch.manual_seed(0)
        model = models.build_model(CustomVolo(), num_classes=10, img_size=32)
        model.eval()  # BatchNorm on running statistics: a step must not depend on how the batch is split
        strategy = strategies.FullyShard(runtime, None)
        strategy.shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        world = torch.distributed.get_world_size()

        def step(number: int) -> None:
            images, labels = _batch(number, runtime.rank, world)
            nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
            optimizer.zero_grad()

        def dump(name: str) -> None:
            weights = strategy.whole(model).state_dict()
            if runtime.rank == 0:
                torch.save({key: value.clone() for key, value in weights.items()}, out_dir / name)

        if mode == "save":
            saved_dir.mkdir(parents=True, exist_ok=True)
            step(1)
            step(2)
            state = strategy.save_state(model, optimizer, saved_dir, tag=2)
            dump("after_step_2.pt")
            if runtime.rank == 0:
                (saved_dir / "state.yaml").write_text(yaml.safe_dump(state))
        else:
            strategy.load_state(model, optimizer, yaml.safe_load((saved_dir / "state.yaml").read_text()), saved_dir)
        step(3)
        dump("after_step_3.pt")


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])
