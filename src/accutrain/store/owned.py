"""The names accutrain owns in a run directory: it writes into a directory only when that is new, empty or marked as
accutrain's (store.mark), and a tracker or plug-in may not take those names, nor replace an existing file
elsewhere."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from accutrain.errors import UserError
from accutrain.store import mark
from accutrain.store.rundir import CHECKPOINTS, LOCK_FILE, RUN_FILES

TRACKERS_FILE = "trackers.json"  # the trackers' run ids, for a resume
# Everything accutrain (and Hydra for it) writes at the top of a run directory.
OWNED = (*RUN_FILES, CHECKPOINTS, "train.log", ".hydra", LOCK_FILE, mark.MARK_FILE, TRACKERS_FILE, "hf")
# The keys of a logger.<name> node that name a file or directory (relative ones are taken inside the run directory).
PATH_KEY = re.compile(r"(^|_)(file|filename|path|dir|folder)$")


def refuse_empty(value: str, key: str) -> None:
    """An empty directory value (`hydra.run.dir=`) would put the run into the working directory: one line."""
    if not value.strip():
        raise UserError(f"{key} is empty: the run would be written into the working directory {Path.cwd()}; name a "
                        f"directory of its own (e.g. {key}=runs/first)")


WRITES = {"run": "config.yaml, train.log, metrics.jsonl and checkpoints/",
          "sweep": "a folder per job, multirun.yaml and summary.md, summary.csv, summary.png"}


def refuse_foreign(directory: Path, key: str, kind: str = "run") -> None:
    """A directory accutrain may write a `kind` (run or sweep) into: new, empty (empty files and folders of
    accutrain's own names aside: what a command checking it left there, as it starts), or one accutrain marked as a
    `kind` directory (store.mark; one made before the mark existed is recognised by accutrain's record of its
    config). Anything else — a project folder with files of its own, `hydra.run.dir=.`, `hydra.sweep.dir=.` — is
    refused in one line before anything is written, whatever the flags."""
    if not directory.is_dir():
        return
    try:
        entries = sorted(p.name for p in directory.iterdir() if not (p.name in OWNED and empty(p)))
    except OSError:
        return  # the writability check says why
    found = mark.owner(directory)
    if not entries or found == kind:
        return
    if found is not None:
        raise UserError(f"{directory} ({key}) is an accutrain {found} directory, not a {kind} directory: choose a new "
                        f"or empty {key}")
    shown = ", ".join(entries[:5]) + (", …" if len(entries) > 5 else "")
    raise UserError(f"{directory} ({key}) is not an accutrain {kind} directory: it holds files of its own ({shown}) "
                    f"and no {mark.MARK_FILE} mark (accutrain marks the directories it creates); accutrain writes "
                    f"{WRITES[kind]} into {key}: choose a new or empty directory")


def empty(path: Path) -> bool:
    """Whether `path` is an empty file or folder."""
    try:
        return not any(path.iterdir()) if path.is_dir() else path.stat().st_size == 0
    except OSError:
        return False


def adopt(run_dir: Path) -> None:
    """A run trained in process (accutrain.runtime.launch.train, not the command line, which claims its directory before
    Hydra writes there): run_dir is accutrain's — marked, or new or empty and marked now — or refused in one line
    before anything is written."""
    refuse_foreign(run_dir, "the run directory")
    if mark.read(run_dir) is None:
        run_dir.mkdir(parents=True, exist_ok=True)
        mark.write_new(run_dir, "run")


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
