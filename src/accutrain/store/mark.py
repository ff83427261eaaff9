"""accutrain's own mark on a directory it made: `.accutrain`, holding the run's (or the sweep's) id, written when a
command creates (or first takes over) a run or sweep directory. A directory is accutrain's — written into,
overwritten, pruned — only when it carries that mark, never because a file with a common name (status.json,
config.yaml) is there. Runs and sweeps made before the mark existed are recognised by accutrain's own record of
their config (Hydra's .hydra/config.yaml or multirun.yaml of an accutrain job, or config.yaml beside checkpoints),
and are marked when a command takes them over."""
from __future__ import annotations

import json
import os
import re
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from accutrain.errors import UserError

MARK_FILE = ".accutrain"
KINDS = ("run", "sweep", "report")  # report: a folder accutrain-report wrote a summary into (multirun/, say)
# What a run stopped during start-up before the mark existed left: its lock and its log.
STARTUP_LEFTOVERS = {".lock", "train.log"}


def read(directory: Path) -> Optional[dict[str, Any]]:
    """The mark's record ({"accutrain": kind, "id": …, "created": …}), or None when there is none or it is not
    accutrain's."""
    try:
        record = json.loads((directory / MARK_FILE).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(record, dict) and record.get("accutrain") in KINDS and isinstance(record.get("id"), str):
        return record
    return None


def text(kind: str) -> bytes:
    """A new mark of `kind` with a new id."""
    record = dict(accutrain=kind, id=uuid.uuid4().hex, created=datetime.now().astimezone().isoformat(
        timespec="seconds"))
    return (json.dumps(record) + "\n").encode()


def write_new(directory: Path, kind: str) -> Optional[bytes]:
    """Mark `directory` as accutrain's `kind`, unless something is at the mark's name already (created exclusively:
    of two commands, one marks). The bytes written, or None when there was a mark already."""
    content = text(kind)
    try:
        fd = os.open(directory / MARK_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return None
    try:
        os.write(fd, content)
        os.fsync(fd)
    except OSError:
        os.close(fd)
        (directory / MARK_FILE).unlink(missing_ok=True)
        raise
    os.close(fd)
    return content


def accutrain_config(path: Path) -> bool:
    """Whether `path` is a config accutrain wrote (or Hydra wrote for an accutrain job): top-level `trainer:` and
    `micro_batch:` keys."""
    try:
        config = path.read_text(errors="replace")
    except OSError:
        return False
    return re.search(r"^trainer:", config, re.M) is not None and re.search(r"^micro_batch:", config, re.M) is not None


def legacy_run(directory: Path) -> bool:
    """A run directory accutrain made before the mark existed: Hydra's .hydra/config.yaml of an accutrain job, or
    config.yaml of an accutrain run beside its checkpoints (trained in process); or the lock and log a run stopped
    during start-up left."""
    if accutrain_config(directory / ".hydra" / "config.yaml"):
        return True
    checkpoints = directory / "checkpoints"
    if accutrain_config(directory / "config.yaml") and ((checkpoints / "last.pt").is_file()
                                                        or any(checkpoints.glob("step-*"))):
        return True
    try:
        entries = {p.name for p in directory.iterdir()}
    except OSError:
        return False
    return ".lock" in entries and entries <= STARTUP_LEFTOVERS


def legacy_sweep(directory: Path) -> bool:
    """A sweep directory accutrain made before the mark existed: Hydra's multirun.yaml of an accutrain sweep."""
    return accutrain_config(directory / "multirun.yaml")


def owner(directory: Path) -> Optional[str]:
    """Whose `directory` is: the kind its mark says, "run" or "sweep" for one accutrain made before the mark
    existed, None when it is not accutrain's."""
    record = read(directory)
    if record is not None:
        return record["accutrain"]
    if legacy_run(directory):
        return "run"
    if legacy_sweep(directory):
        return "sweep"
    return None


def require(directory: Path, kind: str, what: str) -> None:
    """Refuse (UserError) to `what` (delete an earlier run's files, prune checkpoints, …) in a directory that is not
    accutrain's `kind`."""
    found = owner(directory)
    if found != kind:
        raise UserError(f"refusing to {what} in {directory}: it is not an accutrain {kind} directory ("
                        + (f"its {MARK_FILE} marks a {found} directory" if found else f"no {MARK_FILE} mark")
                        + ")")
