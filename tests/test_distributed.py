"""The process group's backends, the device choice (launch.device), the GPU defaults, and the rule that every
collective goes through coarse2fine.distributed.

The group is checked against torch's own parser of backend strings and the GPU node's choices against a torch
that reports 8 GPUs (no GPU needed); the collectives themselves run in the 2-process gloo tests of the stages
(test_generate, test_train, test_loaders, test_convert).
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.distributed_c10d import Backend, BackendConfig

from coarse2fine import distributed, models
from coarse2fine.config import CUSTOM_MODEL, CustomVolo, TimmModel
from coarse2fine.distributed import Runtime
from coarse2fine.errors import UserError
from conftest import cpu_runtime

ROOT = Path(__file__).resolve().parents[1]
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "scatter_object_list", "monitored_barrier", "send", "recv", "isend", "irecv",
}


@pytest.mark.parametrize("device", [torch.device("cuda", 3), torch.device("cpu")], ids=str)
def test_the_group_has_a_backend_for_every_tensor_device_the_collectives_carry(device):
    """CPU tensors (token_labels' timing sums, pickled objects) on every machine, nccl for CUDA tensors on GPUs."""
    backends = BackendConfig(Backend(distributed.group_backend(device))).get_device_backend_map()
    assert str(backends["cpu"]) == "gloo"
    if device.type == "cuda":
        assert str(backends["cuda"]) == "nccl"


def test_no_module_calls_a_torch_distributed_collective_but_the_distributed_module():
    """A raw collective elsewhere would bypass the device the group needs for it."""
    offenders = []
    for path in sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "stages").glob("*.py")]):
        if path == ROOT / "src" / "coarse2fine" / "distributed.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
                owner = ast.unparse(node.value)
                if owner in ("dist", "torch.distributed", "c10d"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {owner}.{node.attr}")
    assert not offenders, offenders


@pytest.fixture
def gpu_node(monkeypatch):
    """torch as it is on a node with 8 GPUs, for the device and group choices (nothing touches a GPU): the calls
    init makes of torch.cuda and torch.distributed are recorded."""
    calls: dict[str, list] = {"set_device": [], "init_process_group": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", calls["set_device"].append)
    monkeypatch.setattr(distributed, "use_gpu_defaults", lambda: calls.setdefault("gpu_defaults", []).append(True))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **group: calls["init_process_group"].append(group))
    return calls


def torchrun_env(monkeypatch, *, local_rank: int, local_world_size: int) -> None:
    """What torchrun sets for one worker of a single-node run."""
    for name, value in {"RANK": local_rank, "WORLD_SIZE": local_world_size, "LOCAL_RANK": local_rank,
                        "LOCAL_WORLD_SIZE": local_world_size}.items():
        monkeypatch.setenv(name, str(value))


@pytest.mark.parametrize("requested", ["auto", "cuda"])
def test_each_local_rank_gets_its_own_gpu_and_an_nccl_group_with_the_gpu_defaults(requested, gpu_node, monkeypatch):
    torchrun_env(monkeypatch, local_rank=5, local_world_size=8)
    runtime = distributed.init(requested)
    assert runtime.device == torch.device("cuda", 5) and gpu_node["set_device"] == [torch.device("cuda", 5)]
    assert gpu_node["gpu_defaults"] == [True]
    assert gpu_node["init_process_group"] == [{"backend": "cpu:gloo,cuda:nccl", "device_id": torch.device("cuda", 5)}]


@pytest.mark.parametrize("requested", ["auto", "cuda"])
def test_more_local_ranks_than_gpus_is_a_user_error_not_shared_gpus(requested, gpu_node, monkeypatch):
    torchrun_env(monkeypatch, local_rank=0, local_world_size=16)
    with pytest.raises(UserError) as error:
        distributed.init(requested)
    message = str(error.value)
    assert message.startswith(f"launch.device: {requested}: 16 ranks on this node") and "\n" not in message
    assert "8 GPU(s)" in message and "would share GPUs" in message and "launch.nproc_per_node to 8" in message
    assert gpu_node["init_process_group"] == []


def test_cpu_on_a_gpu_node_is_the_cpu_with_a_gloo_group_and_no_gpu_defaults(gpu_node, monkeypatch):
    torchrun_env(monkeypatch, local_rank=1, local_world_size=2)
    assert distributed.init("cpu").device == torch.device("cpu")
    assert gpu_node["init_process_group"] == [{"backend": "gloo", "device_id": None}]
    assert gpu_node["set_device"] == [] and "gpu_defaults" not in gpu_node


def test_convert_asks_for_the_cpu_so_a_gpu_node_gives_it_gloo_not_nccl():
    """convert does no GPU work: its session is the `cpu` one above (gloo, no NCCL set-up) whatever the node."""
    tree = ast.parse((ROOT / "stages" / "convert.py").read_text(encoding="utf-8"))
    calls = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Call)]
    assert [call for call in calls if call.startswith("distributed.session(")] == ["distributed.session('cpu')"]


def test_without_a_gpu_auto_is_the_cpu_and_cuda_is_one_line_naming_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.select_device("auto", local_rank=0, local_world_size=2) == torch.device("cpu")
    with pytest.raises(UserError) as error:
        distributed.select_device("cuda", local_rank=0, local_world_size=1)
    message = str(error.value)
    assert message.startswith("launch.device: cuda, but torch") and "finds no usable GPU" in message
    assert "\n" not in message and "launch.device: cpu" in message


def test_gpu_defaults_are_cudnn_autotuning_and_tf32_matmuls_set_without_a_warning():
    """Set through torch's legacy call, so the legacy getters inductor still calls keep working (the new
    per-backend setter alone makes them raise)."""
    saved = torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            distributed.use_gpu_defaults()
            assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
        assert torch.backends.cudnn.benchmark
        assert torch.backends.cuda.matmul.fp32_precision == torch.backends.cudnn.conv.fp32_precision == "tf32"
    finally:
        torch.backends.cudnn.benchmark = saved[0]
        torch.set_float32_matmul_precision(saved[1])


@pytest.mark.parametrize("name", ["resnet10t", CUSTOM_MODEL, "vit_tiny_patch16_224"])
def test_a_placed_model_keeps_contiguous_parameters_and_computes_the_same_on_channels_last_images(name):
    """A GPU's images are channels-last (cuDNN's fast convolutions); the parameters stay as built, which FSDP2
    needs (it shards contiguous parameters only)."""
    model_cfg = CustomVolo() if name == CUSTOM_MODEL else TimmModel(name=name)
    torch.manual_seed(0)
    model = cpu_runtime().place(models.build_model(model_cfg, num_classes=10, img_size=32).eval())
    assert all(parameter.is_contiguous() for parameter in model.parameters())
    images = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(model(images.contiguous(memory_format=torch.channels_last)), model(images))


def test_images_are_channels_last_on_a_gpu_and_contiguous_on_a_cpu():
    gpu = Runtime(rank=0, world_size=8, local_rank=0, device=torch.device("cuda", 0))
    assert gpu.image_memory_format is torch.channels_last
    assert cpu_runtime().image_memory_format is torch.contiguous_format


def test_the_startup_line_says_device_backend_precision_and_loader_graph():
    assert cpu_runtime().describe("auto", loader="dali") == (
        "device cpu x1, backend none (a world of one), precision fp32, loader dali (cpu graph)"
    )
    assert cpu_runtime().describe() == "device cpu x1, backend none (a world of one)"
    gpu = Runtime(rank=0, world_size=8, local_rank=0, device=torch.device("cuda", 0))
    assert gpu.precision("auto") == "bf16" and gpu.fused_optimizer and not cpu_runtime().fused_optimizer
    assert [distributed.loader_graph(name, gpu) for name in ("dali", "torch")] == ["gpu graph", "cpu workers"]
