"""trainer.overwrite=true: delete everything an earlier run owned in its run directory — its checkpoints of every
kind (step files and sharded directories, last, best, their names, abandoned branches), its run files, its exports
and its trackers' ids — and empty train.log, naming every file deleted. Nothing is written, truncated or deleted
through a link among those names: a link is removed itself, whatever it leads to (but checkpoints/, which a run
writes its checkpoints into wherever it leads, is searched for accutrain's names as it is)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from accutrain.store import mark
from accutrain.store.logfile import reopen_log_files
from accutrain.store.run_files import CHECKPOINTS, RUN_FILES

# Besides RUN_FILES: the trackers' run ids (store.owned.TRACKERS_FILE) and the exports (trainer.export).
OWNED_FILES = ("trackers.json", "model.safetensors", "hf")
LOG_FILE = "train.log"


def owned_checkpoints(folder: Path) -> list[Path]:
    """What accutrain names in checkpoints/: step files and directories, last(.pt), best(.pt), their names for a user
    (epoch<E>-step<S>.pt, best-….pt), temporary files, the abandoned branches; a user's own file there stays."""
    from accutrain.store.checkpoint import ABANDONED, NAMED_FILE, STEP_FILE  # (imports torch: not for --help)

    if not folder.is_dir():  # (a checkpoints/ linked to another disk is the run's: it writes its checkpoints there)
        return []
    return sorted(p for p in folder.iterdir() if STEP_FILE.match(p.name) or NAMED_FILE.match(p.name)
                  or p.name in ("last.pt", "last", "best.pt", "best") or p.name.startswith(ABANDONED)
                  or (p.name.startswith(".") and p.name.endswith(".tmp")))


def remove(path: Path, run_dir: Path) -> list[str]:
    """Delete `path` (a file, a link, or a directory with all in it, its links as links), the names removed."""
    name = path.relative_to(run_dir).as_posix()
    if path.is_symlink():
        target = os.readlink(path)
        path.unlink()
        return [f"{name} (a link to {target}: the link removed, not what it leads to)"]
    if path.is_dir():
        inside = sorted(Path(root, f).relative_to(run_dir).as_posix() for root, _, files in os.walk(path)
                        for f in files)
        shutil.rmtree(path)
        return [f"{name}/", *inside]
    if path.exists():
        path.unlink()
        return [name]
    return []


def clear_run(run_dir: Path) -> list[str]:
    """Delete what an earlier run owned in run_dir and empty its train.log (which Hydra already holds open: a link
    there is removed and the log reopened as a file of the run directory's own); every name removed. Only in a
    directory accutrain marked as a run's (UserError otherwise)."""
    mark.require(run_dir, "run", "delete an earlier run's files (trainer.overwrite=true)")
    removed: list[str] = []
    for path in [*owned_checkpoints(run_dir / CHECKPOINTS), *(run_dir / n for n in (*RUN_FILES, *OWNED_FILES))]:
        removed += remove(path, run_dir)
    log = run_dir / LOG_FILE
    if log.is_symlink():  # emptied through the link, the file it leads to would be lost: the link goes instead
        target = os.readlink(log)
        log.unlink()
        reopen_log_files(log)
        removed.append(f"{LOG_FILE} (a link to {target}: the link removed, {target} untouched)")
    elif log.is_file() and log.stat().st_size:
        os.truncate(log, 0)
        removed.append(f"{LOG_FILE} (emptied)")
    return removed
