"""The process group's backends and the rule that every collective goes through coarse2fine.distributed.

The group is checked against torch's own parser of backend strings (no GPU needed); the collectives themselves run
in the 2-process gloo tests of the stages (test_generate, test_train, test_loaders, test_convert).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch.distributed.distributed_c10d import Backend, BackendConfig

from coarse2fine import distributed

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
