"""What strategy=fsdp shards and gathers: the units (the model's repeated blocks, or the classes strategy.wrap names)
and the parameters each owns, a sharded tensor gathered whole on rank 0, a whole tensor's shard for this rank."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.models.checkpointing import repeated_blocks


def units_to_shard(model: nn.Module, wrap: Optional[list[str]]) -> list[nn.Module]:
    """The modules `strategy.wrap` names by class (`Name` or `module.Name`), or, when it is null, the model's
    repeated blocks (those activation checkpointing finds); an unknown name is one clear line."""
    if wrap is None:
        return repeated_blocks(model)
    wanted, found, classes = set(wrap), [], set()
    for name, module in model.named_modules():
        kind = type(module)
        if next(module.parameters(), None) is None:
            continue
        classes.add(kind.__name__)
        if name and wanted & {kind.__name__, f"{kind.__module__}.{kind.__qualname__}"}:
            found.append(module)
    matched = {n for m in found for n in (type(m).__name__, f"{type(m).__module__}.{type(m).__qualname__}")}
    if missing := sorted(wanted - matched):
        raise UserError(f"strategy.wrap={list(wrap)}: this model has no {', '.join(missing)} module with parameters "
                        f"(its classes with parameters: {', '.join(sorted(classes))})")
    return found


def owned_parameters(unit: nn.Module, units: list[nn.Module]) -> int:
    """How many parameters `unit` shards itself: its own, less those of the units nested in it."""
    nested = {id(p) for other in units if other is not unit and is_inside(other, unit) for p in other.parameters()}
    return sum(1 for p in unit.parameters() if id(p) not in nested)


def is_inside(inner: nn.Module, outer: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def gathered(value: torch.Tensor, world: World) -> Optional[torch.Tensor]:
    """The whole of a sharded tensor on rank 0 (None elsewhere); every rank calls it."""
    whole = value.full_tensor() if isinstance(value, DTensor) else value
    return whole.detach().cpu() if world.main else None


def shard_of(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `whole` (which every rank holds), placed as `like` is."""
    if not isinstance(like, DTensor):
        return whole
    return distribute_tensor(whole.to(like.device, like.dtype), like.device_mesh, like.placements,
                             src_data_rank=None)
