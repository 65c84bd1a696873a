"""The Trainer's GPU options, checked on a CPU: fused optimizer kernels (what `Runtime.fused_optimizer` turns on for
a GPU), `train.compile` on the training forward, and throughput timed with the device synchronised."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch
from conftest import ListLoader, cpu_runtime, make_params
from timm.models.volo import VOLO
from torch._dynamo.eval_frame import OptimizedModule
from torch._dynamo.testing import CompileCounter

from coarse2fine import config, forward, models
from coarse2fine.distributed import Runtime
from coarse2fine.training import train

NUM_CLASSES = 10


def batch(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "image": torch.randn(4, 3, 32, 32, generator=generator),
        "label": torch.randint(0, NUM_CLASSES, (4,), generator=generator),
    }


def ground_truth_trainer(tmp_path: Path, runtime: Runtime | None = None, **pretrain) -> train.Trainer:
    params = make_params(pretrain={"batch_size": 4, "token_label": {"enabled": False}, **pretrain})
    torch.manual_seed(0)
    model = models.build_model(params.model, NUM_CLASSES, params.pretrain.img_size)
    loader = ListLoader([batch(1), batch(2)])
    return train.Trainer(
        stage="pretrain", params=params, cfg=params.pretrain, model=model, classes=[str(i) for i in range(NUM_CLASSES)],
        train_loader=loader, val_loader=loader, runtime=runtime or cpu_runtime(), param_sections=("pretrain",),
        provenance={}, paths=train.StagePaths.under(tmp_path),
    )


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_fused_optimizer_takes_the_same_step_as_the_default_one(name):
    """torch's fused AdamW/SGD kernels run on CPUs too: the same update, so turning them on for GPUs is safe."""
    cfg = config.Optimizer(name=name, lr_base=0.1)
    steps = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        optimizer = train.build_optimizer(model, cfg, lr=0.1, fused=fused)
        assert optimizer.defaults.get("fused") is (True if fused else None)
        model(torch.ones(2, 8)).square().sum().backward()
        optimizer.step()
        steps[fused] = torch.cat([parameter.detach().flatten() for parameter in model.parameters()])
    torch.testing.assert_close(steps[True], steps[False])


def test_lamb_has_no_fused_kernel_to_ask_for():
    optimizer = train.build_optimizer(torch.nn.Linear(2, 2), config.Optimizer(name="lamb"), lr=0.1, fused=True)
    assert "fused" not in optimizer.defaults


def test_the_trainer_fuses_the_optimizer_on_a_gpu_only(tmp_path):
    assert cpu_runtime().fused_optimizer is False
    assert ground_truth_trainer(tmp_path).optimizer.defaults.get("fused") is None


def test_compile_compiles_a_volos_stages_for_training_and_leaves_the_model_eager(tmp_path):
    eager = ground_truth_trainer(tmp_path / "eager")
    compiled = ground_truth_trainer(tmp_path / "compiled", compile=True)
    assert eager.train_forward.model is eager.model
    trained = compiled.train_forward.model
    assert isinstance(trained, VOLO) and trained is not compiled.model
    stages = [trained.patch_embed, *trained.network, *trained.post_network]
    assert len(stages) > 3 and all(isinstance(stage, OptimizedModule) for stage in stages)
    assert [id(parameter) for parameter in trained.parameters()] == [id(p) for p in compiled.model.parameters()]
    assert not any(isinstance(module, OptimizedModule) for module in compiled.model.modules())
    assert compiled.eval_model is compiled.model


@pytest.fixture
def fresh_dynamo():
    """dynamo caches compiled frames per code object: the stages' (nn.Sequential's) must not carry over."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_mix_token_boxes_compile_once(monkeypatch, fresh_dynamo):
    """MixToken's box (drawn with `.item()`, then slicing the token grid) stays out of the compiled stages: new
    boxes compile nothing more. A whole-model compile recompiled at each new box shape (a frame per step here)."""
    counter = CompileCounter()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counter))
    params = make_params(model={"embed_dims": [16, 32, 32, 32], "num_heads": [1, 2, 2, 2]})
    torch.manual_seed(0)
    model = models.build_model(params.model, NUM_CLASSES, 32, mix_token=True)
    train_forward = forward.compiled_train_forward(model).train()
    boxes, frames = set(), []
    for seed in range(6):
        output = train_forward(batch(seed)["image"])
        (output.cls_logits.sum() + output.aux_logits.sum()).backward()
        boxes.add(output.mix_box)
        frames.append(counter.frame_count)
    assert len(boxes) >= 3, boxes
    assert frames[0] > 0 and frames == frames[:1] * len(frames), frames


@pytest.mark.slow
def test_a_compiled_step_computes_what_the_eager_step_does(tmp_path):
    """One tiny step through inductor (about 45 s on 2 CPU cores to compile the VOLO's five stage graphs; seconds
    once inductor's cache holds them): the same loss and update."""
    results = []
    for compile_forward in (False, True):
        trainer = ground_truth_trainer(tmp_path / str(compile_forward), compile=compile_forward)
        loss = trainer.backward(batch(1), micro_steps=1, sync=True)
        trainer.optimizer_step()
        results.append((loss, torch.cat([parameter.detach().flatten() for parameter in trainer.model.parameters()])))
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-5)


def test_the_epoch_is_timed_with_the_device_synchronised(tmp_path, monkeypatch):
    """On a GPU the steps are queued: each clock reading of the throughput follows a synchronize."""
    events = []

    @dataclasses.dataclass(frozen=True)
    class RecordingRuntime(Runtime):
        def synchronize(self) -> None:
            events.append("synchronize")

    clock = train.time.perf_counter
    monkeypatch.setattr(train.time, "perf_counter", lambda: events.append("clock") or clock())
    trainer = ground_truth_trainer(tmp_path, runtime=RecordingRuntime(0, 1, 0, torch.device("cpu")))
    events.clear()
    trainer.train_epoch(0)
    clock_reads = [index for index, event in enumerate(events) if event == "clock"]
    assert len(clock_reads) == 2 and all(events[index - 1] == "synchronize" for index in clock_reads)
