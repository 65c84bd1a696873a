"""GPU smoke tests (marker `gpu`): what only a GPU runs, each in one tiny step. On a machine without a usable CUDA
GPU every test here is skipped, the reason printed in pytest's summary (`-ra`). On a GPU node:
`.venv/bin/python -m pytest -m gpu -ra` (a minute or two; the nccl test wants 2 GPUs).

- the all-DALI train graph (`mixed` decoding, RandAugment, random erasing) and the val graph give CUDA batches;
- a bf16 token-label step of the Trainer on the GPU (fused AdamW, DALI's GPU loader with the store's rows);
- every stage of the pipeline through real DVC with `launch.device: cuda` (one epoch each);
- the `cpu:gloo,cuda:nccl` group: CUDA and CPU tensors all-reduced across 2 GPUs by real torchrun.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PROJECT_ROOT, Project, make_params

from coarse2fine import models
from coarse2fine.data.loaders import build_loader
from coarse2fine.distributed import Runtime
from coarse2fine.labels.store import TokenLabelStore, write_store
from coarse2fine.training import losses, train

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NO_GPU = (
    f"no usable CUDA GPU (torch {torch.__version__}, CUDA build {torch.version.cuda}): "
    "the GPU smoke tests run on a GPU node (pytest -m gpu)"
)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason=NO_GPU)]

IMG_SIZE = 32
RECIPE_AUGMENT = {"rand_augment": "rand-m9-mstd0.5-inc1", "reprob": 0.25, "hflip": 0.5}


def gpu_runtime() -> Runtime:
    return Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))


def dali_loader(records_dir: Path, split: str, token_labels: TokenLabelStore | None = None):
    params = make_params(loader={"backend": "dali", "workers": 2}, augment=RECIPE_AUGMENT)
    return build_loader(
        split, records_dir, img_size=IMG_SIZE, batch_size=16, runtime=gpu_runtime(), loader_cfg=params.loader,
        augment_cfg=params.augment, crop_pct=1.0, seed=0, token_labels=token_labels,
    )


def random_store(directory: Path, records: int, num_classes: int = 10, top_k: int = 3, grid: int = 2):
    scores = torch.randn(records, num_classes, grid, grid, generator=torch.Generator().manual_seed(0))
    log_probs, classes = scores.log_softmax(dim=1).topk(top_k, dim=1)
    write_store(directory, log_probs.numpy().astype(np.float16), classes.numpy(), num_classes=num_classes)
    return TokenLabelStore(directory, records=records, num_classes=num_classes)


@pytest.mark.parametrize("split", ["train", "val"])
def test_the_dali_gpu_graphs_give_cuda_batches(digits_records, split):
    loader = dali_loader(digits_records, split)
    batch = next(iter(loader))
    assert loader.backend == "dali"
    assert batch["image"].device.type == "cuda" and batch["image"].shape == (16, 3, IMG_SIZE, IMG_SIZE)
    assert batch["image"].isfinite().all() and batch["image"].abs().max() < 10  # normalised
    assert batch["image"].is_contiguous(memory_format=torch.channels_last)  # cuDNN's NHWC convolutions
    assert all(value.device.type == "cuda" for value in batch.values())


def test_a_bf16_token_label_step_on_the_gpu(digits_records, tmp_path):
    records = 434  # digits_records' train split
    store = random_store(tmp_path / "labels", records)
    params = make_params(pretrain={"batch_size": 16, "precision": "bf16"})
    loader = dali_loader(digits_records, "train", token_labels=store)
    model = models.build_model(params.model, num_classes=10, img_size=IMG_SIZE, mix_token=True)
    trainer = train.Trainer(
        stage="pretrain", params=params, cfg=params.pretrain, model=model, classes=[str(i) for i in range(10)],
        train_loader=loader, val_loader=dali_loader(digits_records, "val"), runtime=gpu_runtime(),
        param_sections=("pretrain",), provenance={}, paths=train.StagePaths.under(tmp_path),
        objective=losses.TokenLabelObjective.from_params(10, params.pretrain),  # the defaults' targets
    )
    assert trainer.optimizer.defaults.get("fused") is True
    before = [parameter.detach().clone() for parameter in model.parameters()]
    batch = next(iter(loader))
    assert batch["token_log_probs"].dtype == torch.float16 and batch["token_log_probs"].device.type == "cuda"
    loss = trainer.backward(batch, micro_steps=1, sync=True)
    trainer.optimizer_step()
    assert torch.isfinite(loss)
    assert sum(not torch.equal(old, new) for old, new in zip(before, model.parameters())) > len(before) // 2


@pytest.mark.slow
def test_every_stage_runs_on_the_gpu(tmp_path):
    project = Project(tmp_path / "project")
    project.edit_params({
        "launch": {"device": "cuda"},
        "data": {"subset": 0.3},
        "teacher": {"epochs": 1},
        "pretrain": {"epochs": 1},
        "finetune": {"epochs": 1},
    })
    project.commit("gpu params")
    result = project.run("dvc", "repro")
    for stage in ("teacher", "token_labels", "pretrain", "finetune"):
        assert f"{stage}: device cuda:0 x1" in result.stdout, result.stdout[-3000:]
    assert "pretrain: device cuda:0 x1, backend none (a world of one), precision bf16, loader dali (gpu graph)" in (
        result.stdout
    )
    assert 0 <= project.metrics("evaluate/finetune")["top1"] <= 100


@pytest.mark.skipif(GPUS < 2, reason=f"{GPUS} GPU(s): the nccl test needs 2")
def test_the_group_all_reduces_cuda_tensors_over_nccl_and_cpu_tensors_over_gloo(tmp_path):
    script = tmp_path / "all_reduce.py"
    script.write_text(textwrap.dedent("""
        import torch
        from coarse2fine import distributed
        with distributed.session("cuda") as runtime:
            on_gpu = distributed.all_reduce_sum(torch.ones(3, device=runtime.device) * (runtime.rank + 1))
            on_cpu = distributed.all_reduce_sum(torch.ones(3) * (runtime.rank + 1))
            assert on_gpu.tolist() == on_cpu.tolist() == [3.0, 3.0, 3.0], (on_gpu, on_cpu)
            print("ok", runtime.rank, runtime.device, flush=True)
    """))
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT / "src")}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("ok")) == [
        "ok 0 cuda:0", "ok 1 cuda:1"
    ]
