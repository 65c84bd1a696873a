"""A model's blocks: the parameter-holding members of its own Sequential and ModuleList children, nested containers
flattened. They are the units FSDP shards one by one (strategies) and that a pipeline deals out to its stages
(pipeline_parallel); tensor parallel picks its own by class (tensor_parallel)."""

from __future__ import annotations

from typing import Iterator

from torch import nn


def blocks(model: nn.Module) -> Iterator[nn.Module]:
    """The units FSDP shards one by one: the members holding parameters of the model's own Sequential and
    ModuleList children, nested containers flattened; a block's inner containers stay inside it."""
    return (block for _, block in named_blocks(model))


def named_blocks(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """`blocks`, with their names in the model (also the units a pipeline deals out to its stages)."""
    for name, child in model.named_children():
        if isinstance(child, (nn.Sequential, nn.ModuleList)):
            yield from _members(child, name)


def _members(container: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    for name, member in container.named_children():
        if isinstance(member, (nn.Sequential, nn.ModuleList)):
            yield from _members(member, f"{prefix}.{name}")
        elif any(True for _ in member.parameters()):
            yield f"{prefix}.{name}", member
