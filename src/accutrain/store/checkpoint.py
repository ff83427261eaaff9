"""Checkpoints: written atomically at optimizer-step boundaries, kept in rotation, loaded with weights_only=True.

A checkpoint holds the model, optimizer, scheduler (and AMP scaler), where the run is (optimizer steps, epoch,
next window of that epoch) and every RNG state (Python, NumPy, torch, CUDA; one set per rank). The sampler's
state is (seed, epoch, window): the order of an epoch is a pure function of the seed and the epoch number.
It is one file (`step-NNNNNNNN.pt`), or with strategy.checkpoint=sharded a directory (`step-NNNNNNNN/`: each
rank's shards of the model, optimizer and EMA beside `state.pt`, the rest; accutrain.parallel.state_dicts writes it).
"""
from __future__ import annotations

import errno
import logging
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch

from accutrain.errors import UserError
from accutrain.store.files import write_atomic

log = logging.getLogger("accutrain")

FORMAT = 2  # 2: the optimizer state keyed by parameter name; 1 (still read): numbered, as torch.optim numbers it
READABLE = (1, 2)
STEP_FILE = re.compile(r"^step-(\d{8})(\.pt)?$")  # a file, or a sharded checkpoint's directory
# A step file's name for its user, a hard link beside it: epoch3-step180.pt; best.pt's: best-epoch3-step180-val_acc0.9666.pt
NAMED_FILE = re.compile(r"^(best-)?epoch\d+-step(\d+)(-.+)?\.pt$")
STATE_FILE = "state.pt"  # in a sharded checkpoint's directory: everything but the shards, written by rank 0
ZIP_MAGIC = b"PK\x03\x04"
REQUIRED = ("progress", "plan", "scheduler")  # besides the model (or shards): what resuming reads
ABANDONED = "abandoned-"  # checkpoints/abandoned-<time>/: the later checkpoints of a branch a resume left


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """torch.save `state` to `path` atomically and durably: a crash leaves the old file intact. A write that fails
    (a full disk, a file-size limit, an I/O error) raises OSError, whatever torch.save's writer made of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_atomic(path, lambda f: torch.save(state, f), durable=True)
    except RuntimeError as e:  # torch's zip writer reports a failed write as `[enforce fail …] unexpected pos …`
        raise write_error(e) from None


def write_error(error: RuntimeError) -> BaseException:
    """The OSError behind torch.save's RuntimeError (its writer calls the file's write, whose error it chains), or
    an OSError(EIO) for a writer error without one; any other RuntimeError is left as it is."""
    seen: set[int] = set()
    cause: Optional[BaseException] = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    text = str(error)
    if "inline_container" in text or "PytorchStreamWriter" in text or "unexpected pos" in text:
        first = (text.strip().splitlines() or ["write failed"])[0]
        return OSError(errno.EIO, f"torch.save could not write the file: {first[:160]}")
    return error


def load(path: Path, mmap: bool = False, evaluation: bool = False) -> dict[str, Any]:
    """Load a checkpoint without ever executing pickled code; a file that is not one is one clear line. A sharded
    checkpoint's directory gives its state.pt, marked `sharded` (the shards are read by the strategy). mmap: the
    tensors are mapped from the file, read as they are used (every rank of a run can load it at little cost).
    evaluation: the weights are what is wanted, so best.pt (no optimizer state) is accepted."""
    if path.is_dir():
        if not (path / ".metadata").is_file() or not (path / STATE_FILE).is_file():
            raise UserError(f"{path} is not a checkpoint: a sharded checkpoint is a directory holding .metadata and "
                            f"{STATE_FILE}")
        state = load(path / STATE_FILE, evaluation=evaluation)
        if problem := shards_problem(path):
            raise UserError(f"{path} is not whole: {problem}")
        return state
    if not path.is_file():
        raise UserError(f"no checkpoint at {path}")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != ZIP_MAGIC:  # torch.save writes zip archives; a cut one still starts like one
        raise UserError(f"{path} is not a checkpoint: " + ("it is empty" if not head else
                        "torch.save writes zip archives and this file is not one (expected a .pt file from a run's "
                        "checkpoints/)"))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0]
        if any(mark in str(e) for mark in ("Unsupported global", "Unsupported class", "GLOBAL")):
            raise UserError(f"refusing to load {path}: it holds pickled code or objects, not only tensors and "
                            f"plain values ({first[:160]})") from None
        raise UserError(f"{path} is corrupt: {first[:160]}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{path} is truncated or corrupt: {first[:160]}") from None
    if (not isinstance(state, dict) or state.get("format") not in READABLE
            or "model" not in state and not state.get("sharded")):
        raise UserError(f"{path} is not an accutrain checkpoint")
    if evaluation:
        return state
    if "optimizer" not in state and not state.get("sharded"):
        raise UserError(f"{path} holds the weights for evaluation only (best.pt keeps no optimizer state): resume "
                        "from last.pt or a step-*.pt of the same run")
    if missing := [key for key in REQUIRED if key not in state]:
        raise UserError(f"{path} is not a whole accutrain checkpoint: it holds no {', '.join(missing)}")
    return state


def shards_problem(directory: Path) -> Optional[str]:
    """What is wrong with a sharded checkpoint's DCP files, as its .metadata lists them (a shard missing or shorter
    than the bytes it should hold), or None. Reading .metadata unpickles it, as DCP's own load does."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as e:  # a cut or garbled pickle: any of pickle's many errors
        return f"its .metadata cannot be read ({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:120]})"
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = directory / name
        if not shard.is_file():
            return f"its shard {name} is missing"
        if shard.stat().st_size < size:
            return f"its shard {name} is truncated ({shard.stat().st_size} of {size} bytes)"
    return None


