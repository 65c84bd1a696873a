"""Tensor parallelism (params `parallel.tensor`) for the transformer blocks of timm's ViT and VOLO, with
torch.distributed.tensor.parallel: Megatron-LM's split (arXiv:1909.08053, section 3) of each block over the
ranks of the mesh's tensor dimension.

- Attention: the projection to queries, keys and values column-wise (each rank computes its 1/tp of the heads),
  the output projection row-wise (its partial sums all-reduced in the forward). The module's head count becomes
  heads / tp, the count its `reshape` splits the local projection into.
- MLP: fc1 column-wise, fc2 row-wise (one all-reduce in the forward, one in the backward per MLP).

Blocks: ViT's `Block`s; VOLO's `Transformer` and `ClassBlock`s. VOLO's Outlookers, its Downsample, the patch
embedding, norms and heads stay replicated: an Outlooker's attention is a per-position 3x3 window (its weights
are `k^4 x heads` logits per token, no head-major matrix product to split), and they hold a small share of the
parameters (the tiny VOLO's outlookers: 6 %; VOLO-D5's: 8 %). The residual stream between blocks is replicated:
sequence parallelism (sharding the LayerNorms' tokens) would save activation memory only, and ViT's 197 tokens do
not split evenly; not done.

timm fuses the projections (ViT's `qkv`, ClassAttention's `kv`): a plain column split would give rank 0 all the
queries and some keys. Their weight is sharded as `_StridedShard(0, split_factor=parts)` (each of the q/k/v parts
split over the ranks, then concatenated: rank r holds q_r, k_r, v_r), the placement FSDP2 + TP uses; DCP cannot
write it (its chunks overlap), so checkpoints gather those tensors (strategies).
"""

from __future__ import annotations

from typing import Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard
from timm.models import volo
from timm.models.vision_transformer import Attention, Block

from coarse2fine.errors import UserError


class FusedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a projection that concatenates `parts` equal outputs (q, k, v): each part of the weight
    split over the ranks, so that each rank's output is its share of every part, in order. The bias (3 x width
    numbers) stays replicated, sliced locally by DTensor: FSDP2 shards a 1-D `_StridedShard` wrongly (torch
    2.14: its gradient's full tensor comes out permuted), and a replicated one it shards plainly."""

    def __init__(self, parts: int):
        super().__init__(output_layouts=_StridedShard(-1, split_factor=parts))
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        for name, param in module.named_parameters():
            placement = _StridedShard(0, split_factor=self.parts) if name == "weight" else Replicate()
            sharded = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def fsdp_placement(parameter: nn.Parameter) -> Shard | None:
    """FSDP2's `shard_placement_fn`: a weight split q/k/v apart by TP is sharded on its input dimension. On its
    output dimension (FSDP2's default, dim 0) torch 2.14 composes the two placements wrongly: the full tensor comes
    out permuted (0.1 off on a ViT's qkv weight, tests/test_tensor_pipeline.py)."""
    strided = isinstance(parameter, DTensor) and any(isinstance(p, _StridedShard) for p in parameter.placements)
    return Shard(1) if strided else None


class LocalHeadsAttention(volo.Attention):
    """timm's VOLO Attention, reshaping by its own head count and head size where timm's takes the input's width
    (`C // self.num_heads`, `reshape(B, H, W, C)`): under TP the local projections are 1/tp as wide as the input."""

    def forward(self, x):
        batch, height, width, _ = x.shape
        qkv = self.qkv(x).reshape(batch, height * width, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.)
        x = x.transpose(1, 2).reshape(batch, height, width, self.num_heads * self.head_dim)
        return self.proj_drop(self.proj(x))


def parallelize(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split `model`'s transformer blocks over `mesh` (1-D, the tensor dimension), in place. A UserError for a
    model with no such blocks or a head count the tensor size does not divide."""
    size = mesh.size()
    blocks = list(_blocks(model))
    if not blocks:
        raise UserError(
            f"parallel.tensor: {size} splits the attention and MLP of timm's ViT and VOLO blocks; "
            f"{type(model).__name__} has none (parallel applies to every training stage: import the teacher, "
            f"teacher.mode: import, or train it in a run with tensor: 1)"
        )
    for name, block in blocks:
        attention = block.attn
        heads = attention.num_heads
        if heads % size or block.mlp.fc1.out_features % size:
            raise UserError(
                f"parallel.tensor: {size} does not divide {name}'s {heads} attention heads and "
                f"{block.mlp.fc1.out_features} MLP features"
            )
        if isinstance(attention, volo.ClassAttention):
            plan = {"attn.kv": FusedColwiseParallel(2), "attn.q": ColwiseParallel()}
        else:
            plan = {"attn.qkv": FusedColwiseParallel(3)}
        plan |= {"attn.proj": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
        parallelize_module(block, mesh, plan)
        attention.num_heads = heads // size
        if isinstance(attention, volo.Attention):
            attention.head_dim = attention.qkv.weight.shape[0] // 3 // heads
            attention.__class__ = LocalHeadsAttention
        if isinstance(attention, Attention):
            attention.attn_dim //= size


def _blocks(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if isinstance(module, (volo.Transformer, volo.ClassBlock)):
            yield name, module
        elif isinstance(module, Block):
            if not isinstance(module.attn, Attention) or not isinstance(module.attn.norm, nn.Identity):
                # a normed attention output (scale_norm) would normalise over the split width
                raise UserError(f"parallel.tensor: {name}'s attention ({type(module.attn).__name__}) is not split")
            yield name, module
