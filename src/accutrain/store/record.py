"""A run's record as a command found it, to put back when the command turns out to change nothing: one continuing
an earlier run that is refused (another seed, a checkpoint of another model, the directory in use) or that has
nothing left to train. Hydra writes its .hydra/ record (the composed config, the overrides) into the run directory
before the job runs, and the job marks status.json `running` as it starts; both are put back byte for byte."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from accutrain.store.files import write_atomic

Files = dict[Path, Optional[bytes]]  # each file's bytes, None where there was none


def snapshot(directory: Path, names: tuple[str, ...] = ()) -> Files:
    """The files directly inside `directory`, and those `names` (present or not), as they are now."""
    found: Files = {directory / name: None for name in names}
    if directory.is_dir():
        for path in directory.iterdir():
            if path.is_file() and not path.name.startswith("."):  # (a dot-file: a temporary one)
                found[path] = path.read_bytes()
    return found


def put_back(files: Files) -> None:
    """Write each file back as it was (atomically), remove those that were not there, and a folder left empty
    that the snapshot found empty or absent. Never raises: a file that cannot be put back is left as it is."""
    for path, content in files.items():
        try:
            if content is None:
                path.unlink(missing_ok=True)
            elif not path.is_file() or path.read_bytes() != content:
                write_atomic(path, content)
        except OSError:
            continue
    for folder in {path.parent for path, content in files.items()}:
        if all(files.get(p) is None for p in files if p.parent == folder):
            try:
                os.rmdir(folder)  # only when empty
            except OSError:
                pass


def hydra_record(run_dir: Path, subdir: Optional[str]) -> Files:
    """Hydra's record of a run (run_dir/<hydra.output_subdir>/: config.yaml, hydra.yaml, overrides.yaml) as it is
    now: what Hydra writes over before a job runs. Empty when hydra.output_subdir is null."""
    if subdir is None:
        return {}
    return snapshot(run_dir / subdir, ("config.yaml", "hydra.yaml", "overrides.yaml"))
