"""How the ranks share the model (`strategy=`): what the loop calls, the context of the micro-batches that do not
synchronise, what the gradient reductions sent, and the model/optimizer/EMA state as checkpoints hold it.

`strategy=ddp` (this module, the default): every rank holds the whole model, gradients and optimizer state; DDP
all-reduces the gradients once per window (`no_sync` on every other micro-batch). One device needs no wrapper.
`strategy=fsdp` (accutrain.parallel.fsdp): PyTorch FSDP2 shards parameters, gradients and optimizer state across
the ranks.
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator, Optional

import torch
from torch import nn

from accutrain import dist
from accutrain.dist import World
from accutrain.models.ema import EMA
from accutrain.parallel import state_dicts


class Strategy:
    """DDP on several devices, the bare model on one."""

    name = "ddp"
    sharded_checkpoints = False  # True: a checkpoint is a directory each rank writes its shard into
    lockstep = False  # True: every rank must run every forward (FSDP's collectives are in forward and backward)

    def __init__(self, world: World, device: torch.device) -> None:
        self.world, self.device = world, device
        self.comm: Optional[dist.CommStats] = None  # what the gradient reductions sent (several devices)
        self._no_sync: Callable[[], ContextManager] = nullcontext

    def check_model(self, model: nn.Module, batchnorm_convert: Any) -> None:
        """Refuse, in one line, a model the strategy cannot train exactly."""

    def model_device(self, device: torch.device) -> Optional[torch.device]:
        """Where build_model puts the model: on the device (None: where it was made, in CPU memory)."""
        return device

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model, before the optimizer sees its parameters (FSDP shards it here)."""
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        """What the loop calls (after micro_batch=auto's trial steps): the DDP wrapper on several devices."""
        if self.world.size == 1:
            return model
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            gradient_as_bucket_view=True)
        self.comm = dist.CommStats(process_group=None)
        ddp.register_comm_hook(self.comm, dist.counting_allreduce_hook)
        self._no_sync = ddp.no_sync
        return ddp

    def no_sync(self) -> ContextManager:
        """The context of every micro-batch but the window's last: no gradient reduction in its backward."""
        return self._no_sync()

    def explain(self, error: BaseException) -> None:
        """Raise a UserError in place of `error` when it is a known limitation of the strategy."""

    def eval_batches(self, loader: Iterable[Any], empty: Callable[[], Any]) -> Iterable[Any]:
        """This rank's share of the held-out split, batch by batch (`empty` makes a zero-sample batch)."""
        return loader

    def state(self, model: nn.Module, optimizer: torch.optim.Optimizer, ema: Optional[EMA]
              ) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
        """(the model, optimizer and EMA state rank 0's checkpoint file holds, the tensors each rank writes as its
        shards — None: a single file). Every rank calls it."""
        names = state_dicts.optimizer_names(model, optimizer)
        return dict(model=model.state_dict(), optimizer=state_dicts.by_name(optimizer.state_dict(), names),
                    ema=ema.state_dict() if ema is not None else None), None

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, ema: Optional[EMA], state: dict[str, Any],
             path: Path) -> None:
        """Load what `state` (checkpoint.load's) holds of the model, optimizer and EMA; from the shards of a
        sharded checkpoint directory `path` too. Every rank calls it. A mismatched model raises RuntimeError."""
        if state.get("sharded"):
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

            shards = state_dicts.read_sharded(path, {
                "model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer),
                **({"ema": {"weights": ema.weights}} if ema is not None and state.get("ema") else {})})
            model.load_state_dict(shards["model"])
            set_optimizer_state_dict(model, optimizer, shards["optimizer"])
            if ema is not None and state.get("ema"):
                ema.load_state_dict({**state["ema"], **shards["ema"]})
            return
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state_dicts.by_index(state["optimizer"],
                                                       state_dicts.optimizer_names(model, optimizer)))
        if ema is not None and state.get("ema"):
            ema.load_state_dict(state["ema"])

    def load_weights(self, model: nn.Module, ema: Optional[EMA], state: dict[str, Any], path: Path) -> None:
        """Load the weights (and their average) of a checkpoint for evaluation — best.pt, or a sharded best/ — into
        the model; the optimizer is left as it is. Every rank calls it."""
        if state.get("sharded"):
            shards = state_dicts.read_sharded(path, {"model": model.state_dict(), **(
                {"ema": {"weights": ema.weights}} if ema is not None and state.get("ema") else {})})
            state = {**state, "model": shards["model"],
                     "ema": {**state["ema"], **shards["ema"]} if "ema" in shards else None}
        model.load_state_dict(state["model"])
        if ema is not None and state.get("ema"):
            ema.load_state_dict(state["ema"])

    def close(self) -> None:
        """Release what the strategy set up for the run."""

    def describe(self) -> list[str]:
        return []


class EvenBatches:
    """A loader's batches, then empty ones until every rank has run as many (the same number on every rank)."""

    def __init__(self, loader: Any, world: World, empty: Callable[[], Any]) -> None:
        self.loader, self.empty = loader, empty
        self.total = int(dist.all_reduce_max(torch.tensor(len(loader)), world).item())

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Iterator[Any]:
        count = 0
        for batch in self.loader:
            count += 1
            yield batch
        for _ in range(self.total - count):
            yield self.empty()
