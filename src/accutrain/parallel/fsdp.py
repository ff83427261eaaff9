"""`strategy=fsdp`: PyTorch FSDP2 (`fully_shard`), with the window's gradient exactly the big batch's.

Each unit (`strategy.wrap`: by default the model's repeated blocks; the root is always one) holds 1/devices of its
parameters, gradients and optimizer state; it all-gathers its parameters for its forward (and, after
reshard_after_forward, again for its backward) and reduce-scatters its gradients. Exactness is DDP's: each rank
backpropagates its summed loss × world / |W| and FSDP averages over the ranks (its default AVG reduction, no
custom divide factor, which gloo would refuse), so the sum over the window's micro-batches and ranks is
∇(mean loss over W), with uneven windows and empty micro-batches alike. `strategy.sync=each` reduce-scatters after
every micro-batch (gradients accumulate in their shards); `last` only after the window's last, keeping each
rank's unsharded gradients in between. FSDP communicates in every forward and backward, so every rank runs every
micro-batch and every evaluation batch, empty ones included.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from accutrain.config.train import CheckpointFormat, Sync
from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.models.ema import EMA
from accutrain.models.norms import batchnorm_layers
from accutrain.parallel import state_dicts
from accutrain.parallel.fsdp_units import gathered, owned_parameters, shard_of, units_to_shard
from accutrain.parallel.strategy import EvenBatches, Strategy

log = logging.getLogger("accutrain")

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered whole, on rank 0 only (others: {})


class Reductions:
    """What FSDP's gradient reduce-scatters sent, counted by a hook on every unit that owns parameters: one call
    per unit per reducing backward, with the reduced shard (padded, in the reduce dtype)."""

    def __init__(self, units: int, world: int) -> None:
        self.units, self.world, self.calls, self.bytes = units, world, 0, 0

    def __call__(self, shard: torch.Tensor) -> None:
        self.calls += 1
        self.bytes += shard.numel() * shard.element_size() * self.world  # this rank's reduce-scatter input

    def take(self) -> tuple[int, int]:
        """(backward passes whose gradients were reduced, bytes) since the last call."""
        out = (self.calls // self.units, self.bytes)
        self.calls = self.bytes = 0
        return out


class FSDP(Strategy):
    name = "fsdp"
    lockstep = True

    def __init__(self, cfg: Any, world: World, device: torch.device, precision: Any) -> None:
        super().__init__(world, device)
        self.cfg, self.precision = cfg, precision
        self.sharded_checkpoints = cfg.checkpoint is CheckpointFormat.sharded
        self.model: Optional[nn.Module] = None
        self.own_group, self.lines = False, []

    # --- sharding -------------------------------------------------------------------------------------------
    def check_model(self, model: nn.Module, batchnorm_convert: Any) -> None:
        if self.world.size > 1 and (layers := batchnorm_layers(model, training_only=True)):
            raise UserError(f"strategy=fsdp with batchnorm.convert={batchnorm_convert.name}: the model has "
                            f"{len(layers)} BatchNorm layers in training mode, whose running statistics FSDP leaves "
                            "different on every rank (DDP broadcasts rank 0's); use batchnorm.convert=group "
                            "(GroupNorm) or batchnorm.convert=frozen, or strategy=ddp")

    def model_device(self, device: torch.device) -> Optional[torch.device]:
        return None  # made in CPU memory: fully_shard moves each rank's shards to the device

    def prepare(self, model: nn.Module) -> nn.Module:
        units = units_to_shard(model, self.cfg.wrap)
        owners = [m for m in [*units, model] if owned_parameters(m, units)]
        kinds = sorted({type(u).__name__ for u in units})  # before fully_shard renames them FSDP<Name>
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the mesh's device: where fully_shard moves the shards
        if not torch_dist.is_initialized():  # one device: FSDP still needs a process group (of one)
            backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
            torch_dist.init_process_group(backend, store=torch_dist.HashStore(), rank=0, world_size=1)
            self.own_group = True
        self.mesh = init_device_mesh(self.device.type, (self.world.size,))
        options = dict(mesh=self.mesh, reshard_after_forward=self.cfg.reshard_after_forward,
                       mp_policy=self.mixed_precision(), offload_policy=self.offload())
        for unit in reversed(units):  # innermost first
            fully_shard(unit, **options)
        # The root's own parameters (embeddings, final norm, head) stay gathered from its forward to its backward, as
        # FSDP advises (backward needs them first): a causal LM's head is then whole when the loss reads it
        # (model.logits=chunked, models/heads.py), after the model's forward.
        fully_shard(model, **{**options, "reshard_after_forward": False})
        if hasattr(model, "set_reduce_scatter_unused_params"):  # a parameter one rank leaves unused still reduces
            model.set_reduce_scatter_unused_params(True)
        if self.world.size > 1:
            self.comm = Reductions(len(owners), self.world.size)
            for unit in owners:
                unit.set_all_reduce_hook(self.comm)
        self.model = model
        self.lines.insert(0, self.describe_units(model, kinds, len(units), len(owners)))
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        return model  # sharded in prepare: FSDP2 is the model itself

    def mixed_precision(self) -> MixedPrecisionPolicy:
        """bf16-mixed: parameters all-gathered and computed in bf16, gradients reduced and accumulated in float32."""
        if self.precision.name == "bf16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def offload(self) -> OffloadPolicy:
        if not self.cfg.cpu_offload:
            return OffloadPolicy()
        if self.device.type == "cpu":
            self.lines.append("strategy.cpu_offload=true does nothing on the CPU: the weights, gradients and "
                              "optimizer state already live in CPU memory")
            return OffloadPolicy()
        self.lines.append("strategy.cpu_offload=true: the sharded weights, gradients and optimizer state live in "
                          "pinned host memory; the optimizer step runs on the CPU, each unit's forward and backward "
                          f"on {self.device}")
        return CPUOffloadPolicy()

    def describe_units(self, model: nn.Module, kinds: list[str], units: int, owners: int) -> str:
        grads = sum(p.numel() for p in model.parameters()) * 4  # float32 gradients (bf16-mixed reduces in float32)
        each, last = grads / self.world.size / 2**20, grads / 2**20
        trade = (f"strategy.sync=each: gradients are reduce-scattered after every micro-batch (accum reductions per "
                 f"step); between micro-batches each rank keeps only its gradient shards (about {each:.3g} MiB)"
                 if self.cfg.sync is Sync.each else
                 f"strategy.sync=last: gradients are reduce-scattered once per optimizer step, after the window's last "
                 f"micro-batch; between micro-batches each rank keeps the whole model's unsharded gradients (about "
                 f"{last:.3g} MiB, against {each:.3g} MiB of shards with sync=each)")
        where = (f"in {units + 1} units ({f'{units} × {kinds[0]}' if len(kinds) == 1 else ', '.join(kinds)} and "
                 f"the root, {owners} of them holding parameters)" if units else
                 "as one unit, all-gathered whole for its forward and backward (the model has no repeated blocks: "
                 "strategy.wrap=[ClassName] shards modules of that class as units of their own)")
        return (f"strategy=fsdp: the model is sharded over {self.world.size} rank(s) {where}; each rank holds "
                f"1/{self.world.size} of the parameters, gradients and optimizer state. {trade}")

    def describe(self) -> list[str]:
        return self.lines

    # --- each window ------------------------------------------------------------------------------------------
    def no_sync(self) -> ContextManager:
        return self._gradient_sync_off() if self.cfg.sync is Sync.last else nullcontext()

    @contextmanager
    def _gradient_sync_off(self) -> Iterator[None]:
        self.model.set_requires_gradient_sync(False)  # recursive: every unit keeps its unsharded gradients
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def explain(self, error: BaseException) -> None:
        if isinstance(error, AssertionError) and "uniform gradient dtype" in str(error):
            raise UserError("strategy.sync=last with trainer.precision=bf16-mixed: a parameter got its first "
                            "gradient of the window on the last micro-batch, which PyTorch's FSDP cannot reduce "
                            "(pytorch issue 196996); use strategy.sync=each") from None

    def eval_batches(self, loader: Any, empty: Callable[[], Any]) -> Any:
        """Every rank runs as many evaluation forwards (each all-gathers): a shorter share ends with empty batches."""
        return EvenBatches(loader, self.world, empty)

    # --- checkpoints ----------------------------------------------------------------------------------------
    def state(self, model: nn.Module, optimizer: torch.optim.Optimizer, ema: Optional[EMA]
              ) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
        if self.sharded_checkpoints:
            shards = {"model": state_dicts.model_state(model), "optimizer": state_dicts.optimizer_state(model, optimizer)}
            if ema is not None:
                shards["ema"] = {"weights": ema.weights}  # DTensors: DCP writes each rank's shard
            return dict(sharded=True, ema=ema.state_dict(weights=False) if ema is not None else None), shards
        state = dict(model=state_dicts.model_state(model, FULL),  # every rank gathers, rank 0 keeps
                     optimizer=state_dicts.optimizer_state(model, optimizer, FULL), ema=None)
        if ema is not None:
            whole = {key: gathered(value, self.world) for key, value in ema.weights.items()}
            state["ema"] = {**ema.state_dict(weights=False), "weights": whole}
        return state, None

    def load_weights(self, model: nn.Module, ema: Optional[EMA], state: dict[str, Any], path: Path) -> None:
        if state.get("sharded"):
            has_ema = ema is not None and state.get("ema") is not None
            shards = state_dicts.read_sharded(path, {"model": state_dicts.model_state(model),
                                                     **({"ema": {"weights": ema.weights}} if has_ema else {})})
            state_dicts.set_model_state(model, shards["model"])
            if has_ema:
                ema.load_state_dict({**state["ema"], **shards["ema"]})
            return
        state_dicts.set_model_state(model, state["model"], StateDictOptions(full_state_dict=True))
        if ema is not None and state.get("ema") is not None:
            ema.load_state_dict({**state["ema"], "weights": {key: shard_of(state["ema"]["weights"][key], value)
                                                             for key, value in ema.weights.items()}})

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, ema: Optional[EMA], state: dict[str, Any],
             path: Path) -> None:
        has_ema = ema is not None and state.get("ema") is not None
        try:
            if state.get("sharded"):
                templates = {"model": state_dicts.model_state(model),
                             "optimizer": state_dicts.optimizer_state(model, optimizer),
                             **({"ema": {"weights": ema.weights}} if has_ema else {})}
                shards = state_dicts.read_sharded(path, templates)  # reshards when written by another world
                state_dicts.set_model_state(model, shards["model"])
                state_dicts.set_optimizer_state(model, optimizer, shards["optimizer"])
                if has_ema:
                    ema.load_state_dict({**state["ema"], **shards["ema"]})
                return
            # A full checkpoint: every rank holds the whole file (memory-mapped), each takes its shard.
            whole = StateDictOptions(full_state_dict=True)
            state_dicts.set_model_state(model, state["model"], whole)
            named = state_dicts.by_name(state["optimizer"], state_dicts.optimizer_names(model, optimizer))
            state_dicts.set_optimizer_state(model, optimizer, named, whole)
            if has_ema:
                weights = {key: shard_of(state["ema"]["weights"][key], value)
                           for key, value in ema.weights.items()}
                ema.load_state_dict({**state["ema"], "weights": weights})
        except (KeyError, ValueError) as e:
            raise RuntimeError(f"{type(e).__name__}: {e}") from None

    def close(self) -> None:
        if self.own_group and torch_dist.is_initialized():
            torch_dist.destroy_process_group()
        self.own_group = False


