"""The names accutrain owns in a run directory: it writes into a directory only when that is new, empty or an
earlier accutrain run's, and a tracker or plug-in may not take those names, nor replace an existing file elsewhere."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from accutrain.errors import UserError
from accutrain.store.rundir import CHECKPOINTS, LOCK_FILE, RUN_FILES
from accutrain.store.status import STATUS_FILE

TRACKERS_FILE = "trackers.json"  # the trackers' run ids, for a resume
# Everything accutrain (and Hydra for it) writes at the top of a run directory.
OWNED = (*RUN_FILES, CHECKPOINTS, "train.log", ".hydra", LOCK_FILE, TRACKERS_FILE, "hf")
# The keys of a logger.<name> node that name a file or directory (relative ones are taken inside the run directory).
PATH_KEY = re.compile(r"(^|_)(file|filename|path|dir|folder)$")


def is_run_dir(directory: Path) -> bool:
    """Whether `directory` holds accutrain's own record of a run: its status.json, Hydra's .hydra/ of a job whose
    config has accutrain's trainer node, or (a run trained in process, which writes no status.json) its config.yaml
    beside accutrain's checkpoints."""
    if (directory / STATUS_FILE).is_file():
        return True
    for config in (directory / ".hydra" / "config.yaml", directory / "config.yaml"):
        try:
            text = config.read_text(errors="replace")
        except OSError:
            continue
        ours = re.search(r"^trainer:", text, re.M) is not None and re.search(r"^micro_batch:", text, re.M) is not None
        if ours and (config.parent.name == ".hydra" or any((directory / "checkpoints").glob("step-*"))
                     or (directory / "checkpoints" / "last.pt").exists()):
            return True
    return False


def refuse_empty(value: str, key: str) -> None:
    """An empty directory value (`hydra.run.dir=`) would put the run into the working directory: one line."""
    if not value.strip():
        raise UserError(f"{key} is empty: the run would be written into the working directory {Path.cwd()}; name a "
                        f"directory of its own (e.g. {key}=runs/first)")


def refuse_foreign(directory: Path, key: str) -> None:
    """A directory accutrain may write a run into: new, empty, or an earlier accutrain run's; anything else (a project
    folder with files of its own, `hydra.run.dir=.`) is refused in one line before anything is written."""
    if not directory.is_dir():
        return
    try:
        entries = sorted(p.name for p in directory.iterdir())
    except OSError:
        return  # the writability check says why
    if not entries or is_run_dir(directory) or (".lock" in entries and set(entries) <= {".lock", "train.log"}):
        return  # (a run stopped during start-up leaves its lock file and log alone)
    shown = ", ".join(entries[:5]) + (", …" if len(entries) > 5 else "")
    raise UserError(f"{directory} ({key}) is not an accutrain run directory: it holds files of its own ({shown}) and "
                    f"no status.json; accutrain writes config.yaml, train.log, metrics.jsonl and checkpoints/ into "
                    f"{key}: choose a new or empty directory")


def path_values(node: Any, prefix: str) -> Iterator[tuple[str, str]]:
    """(key, value) for each non-empty string under `node` (a mapping) whose key names a file or directory
    (PATH_KEY)."""
    if not isinstance(node, Mapping):
        return
    for name, value in node.items():
        key = f"{prefix}.{name}"
        if isinstance(value, Mapping):
            yield from path_values(value, key)
        elif isinstance(value, str) and value.strip() and PATH_KEY.search(str(name)):
            yield key, value


def saved_paths(run_dir: Path, name: str) -> set[Path]:
    """The paths tracker `name` recorded in trackers.json in an earlier session of this run directory."""
    try:
        saved = json.loads((run_dir / TRACKERS_FILE).read_text()).get(name) or {}
    except (OSError, ValueError, AttributeError):
        return set()
    return {Path(v).resolve() for v in saved.values() if isinstance(v, str) and os.sep in v}


def check_tracker_paths(run_dir: Path, loggers: Mapping[str, Mapping[str, Any]], resume: Optional[str]) -> None:
    """Refuse (one line, naming the key) a logger.<name> file or directory that is one of accutrain's own names in the
    run directory, or that is a file outside it which exists already (it would be replaced) — unless this is a
    resume of the run that wrote it there."""
    root = run_dir.resolve()
    for name, node in loggers.items():
        for key, value in path_values(node, f"logger.{name}"):
            target = (run_dir / os.path.expanduser(value)).resolve()
            if target.is_relative_to(root):
                parts = target.relative_to(root).parts
                if parts and parts[0] in OWNED:
                    raise UserError(f"{key}={value}: {parts[0]} is accutrain's own in the run directory "
                                    f"({', '.join(OWNED)}): choose another name")
            elif target.is_file() and not (resume is not None and target in saved_paths(run_dir, name)):
                raise UserError(f"{key}={value}: {target} exists already, outside the run directory, and would be "
                                "replaced: choose another name, or move that file away")
