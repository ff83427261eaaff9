"""The model, optimizer and EMA tensors as checkpoints hold them, whatever the strategy.

The optimizer state is keyed by parameter NAME (checkpoint format 2), as PyTorch's distributed state dicts key it:
a checkpoint then moves between one device, DDP and FSDP. torch.optim numbers parameters instead (format 1 holds
that); both directions are converted here. A numbered state given to FSDP's set_optimizer_state_dict would load
nothing, silently, so FSDP only ever sees names.

A sharded checkpoint is a directory: PyTorch Distributed Checkpoint (DCP) files, one per rank plus `.metadata`,
beside `state.pt`, rank 0's file of everything else (progress, scheduler, RNG states, plan, config). It is written
into a temporary directory and renamed into place once whole, so a killed run never leaves half of one.
"""
from __future__ import annotations

import errno
import pickle
import shutil
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

if TYPE_CHECKING:  # PyTorch's distributed state dicts load DTensor and DCP (~0.8 s): only FSDP's checkpoints need them
    from torch.distributed.checkpoint.state_dict import StateDictOptions

from accutrain.dist import World, broadcast_from_main
from accutrain.errors import CorruptCheckpoint, UserError
from accutrain.store.checkpoint import STATE_FILE, save_atomic
from accutrain.store.files import fsync_dir


def optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the optimizer's parameters, in the order torch.optim numbers them (param_groups in turn)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def keyed(model: nn.Module) -> tuple[nn.Module, str]:
    """The module whose own names are the checkpoint's keys, and its prefix among `model`'s names. A model whose
    state_dict renames its keys (models/hf.py's adapter, which drops `model.`) names that module `keyed_module`:
    PyTorch's distributed state dicts walk each key attribute by attribute, so they are given that module."""
    inner = getattr(model, "keyed_module", None)
    if not isinstance(inner, nn.Module):
        return model, ""
    return inner, next(name for name, m in model.named_modules() if m is inner) + "."


def model_state(model: nn.Module, options: Optional[StateDictOptions] = None) -> dict[str, Any]:
    """get_model_state_dict under the checkpoint's keys."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(keyed(model)[0], options=options)


def set_model_state(model: nn.Module, state: dict[str, Any], options: Optional[StateDictOptions] = None) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(keyed(model)[0], state, options=options)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, options: Optional[StateDictOptions] = None
                    ) -> dict[str, Any]:
    """get_optimizer_state_dict keyed by the parameters' names in `model` (as optimizer_names gives them)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    inner, prefix = keyed(model)
    return renamed(get_optimizer_state_dict(inner, optimizer, options=options), lambda name: prefix + name)


def set_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                        options: Optional[StateDictOptions] = None) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    inner, prefix = keyed(model)
    set_optimizer_state_dict(inner, optimizer, renamed(state, lambda name: name.removeprefix(prefix)),
                             options=options)


def renamed(state: dict[str, Any], rename: Any) -> dict[str, Any]:
    """A name-keyed optimizer state with every parameter name passed through `rename` (an empty state: as it is)."""
    if not state or numbered(state):
        return state
    return {"state": {rename(name): s for name, s in state["state"].items()},
            "param_groups": [{**group, "params": [rename(p) for p in group["params"]]}
                             for group in state["param_groups"]]}


def numbered(state: dict[str, Any]) -> bool:
    return all(isinstance(p, int) for group in state["param_groups"] for p in group["params"])


def by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """torch.optim's state_dict, whose parameters are numbered, keyed by parameter name instead."""
    if not numbered(state):
        return state
    return {"state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                             for group in state["param_groups"]]}


def by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A name-keyed optimizer state numbered as this optimizer numbers its parameters, for load_state_dict."""
    if numbered(state):
        return state
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted({p for group in state["param_groups"] for p in group["params"]} - index.keys())
    if unknown:
        raise UserError(f"the checkpoint's optimizer state names parameters this model does not have "
                        f"({', '.join(unknown[:3])}{', …' if len(unknown) > 3 else ''}): it was written for "
                        "another model")
    return {"state": {index[name]: s for name, s in state["state"].items()},
            "param_groups": [{**group, "params": [index[p] for p in group["params"]]}
                             for group in state["param_groups"]]}


def unreadable(error: BaseException) -> bool:
    """Whether reading a shard failed on its bytes (garbled or cut: torch.load's errors), not on a mismatch."""
    return (isinstance(error, (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, OSError))
            or isinstance(error, RuntimeError) and "PytorchStreamReader" in str(error))


def write_sharded(directory: Path, shards: dict[str, Any], state: dict[str, Any], world: World) -> Path:
    """Every rank writes its `shards` (DCP) and rank 0 `state` into checkpoints/<name>/, made as .<name>.tmp/ and
    renamed into place once whole (an older one of the same name is replaced). Collective: every rank calls it. A
    write that fails on any rank (a full disk, an I/O error) raises the same OSError on every rank, the temporary
    directory removed: the previous checkpoint stays whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    tmp = directory.with_name(f".{directory.name}.tmp")
    error: Optional[OSError] = None
    if world.main:
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed run left
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            error = e
    error = broadcast_from_main(error, world)
    if error is None:
        try:
            dcp.save(shards, checkpoint_id=tmp)  # every rank its own file; rank 0 the metadata once all are written
        except CheckpointException as e:  # DCP gathers every rank's failure: raised the same on every rank
            error = write_failure(e)
    if error is None and world.main:
        try:
            save_atomic(state, tmp / STATE_FILE)
            fsync_dir(tmp)
            old = directory.with_name(f".{directory.name}.old")
            if directory.exists():
                shutil.rmtree(old, ignore_errors=True)
                directory.rename(old)
            tmp.rename(directory)
            fsync_dir(directory.parent)
            shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            error = e
    error = broadcast_from_main(error, world)  # rank 0's outcome, the same on every rank
    if error is not None:
        if world.main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error
    return directory


def write_failure(error: BaseException) -> OSError:
    """The OSError behind a failed DCP write (any rank's), or one of EIO naming what failed."""
    causes = [failure[0] for failure in error.failures.values()] if hasattr(error, "failures") else [error]
    found = next((c for c in causes if isinstance(c, OSError)), None)
    if found is not None:
        return OSError(found.errno, found.strerror or str(found))
    first = (str(causes[0] if causes else error).strip().splitlines() or [type(error).__name__])[0]
    return OSError(errno.EIO, f"the sharded checkpoint could not be written: {first[:160]}")


def read_sharded(directory: Path, templates: dict[str, Any]) -> dict[str, Any]:
    """Fill `templates` (state dicts with this run's tensors: its shards under FSDP, whole tensors otherwise) from a
    sharded checkpoint, resharding when it was written by another number of ranks. Collective under a process
    group: every rank calls it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:  # without a process group (one plain process) every tensor is read whole
        dcp.load(templates, checkpoint_id=directory, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # DCP gathers every rank's failure into a CheckpointException,
        # a BaseException: raised the same on every rank
        causes = [failure[0] for failure in e.failures.values()] if isinstance(e, CheckpointException) else [e]
        cause = next((c for c in causes if unreadable(c)), causes[0] if causes else e)
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        if unreadable(cause):
            detail = "" if isinstance(cause, pickle.UnpicklingError) else f": {first[:160]}"  # (torch's is long)
            raise CorruptCheckpoint(f"{directory} is corrupt: a shard cannot be read ({type(cause).__name__}"
                                    f"{detail})") from None
        raise UserError(f"{directory} does not fit this run (another model or optimizer?): {first[:200]}") from None
    return templates
