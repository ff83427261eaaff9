"""What one command changed in a run directory, to put back when it turns out to change nothing: a command refused
before it takes the directory over (another seed, a checkpoint of another model, the directory in use, a mistake
of the data found at start) or one with nothing left to train. Hydra writes its .hydra/ record (the composed config,
the overrides) and opens the log before the job runs, and the job marks status.json `running` as it starts; each
file is put back as it was — but only where it still holds what this command wrote: a file another command wrote
meanwhile is never removed or replaced by this one's put back."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
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


def absolute(path: Path) -> Path:
    """One name per file, whatever the working directory a caller named it from (a run directory given as
    runs/x, and as Hydra's absolute output directory)."""
    return Path(os.path.abspath(path))


def current(path: Path) -> Optional[bytes]:
    """The file's bytes now, None when there is none (or it cannot be read)."""
    try:
        return path.read_bytes()
    except OSError:
        return None


@dataclass
class Changes:
    """What this command changed in its directory: each file as it was before the command (`before`; None: absent)
    and as the command (or Hydra for it) wrote it (`ours`), by absolute path; the files it created while it held the directory, whose
    bytes it does not follow (`created`: its log); the lock file it created (`lock`: removed last, while the command
    still holds it, so that another command that takes the directory next finds nothing of this one's); the
    directories it made (`made`)."""

    before: Files = field(default_factory=dict)
    ours: Files = field(default_factory=dict)
    created: set[Path] = field(default_factory=set)
    made: list[Path] = field(default_factory=list)
    lock: Optional[Path] = None

    def was(self, files: Files) -> None:
        """`files` as they are before the command writes them."""
        for path, content in files.items():
            self.before[absolute(path)] = content

    def wrote(self, path: Path, content: Optional[bytes], before: Optional[bytes]) -> None:
        """The command wrote `content` to `path` (None: removed it), which held `before` when the command first
        changed it."""
        self.before.setdefault(absolute(path), before)
        self.ours[absolute(path)] = content

    def found(self, files: Files) -> None:
        """Hydra wrote `files` for this command (their bytes now), over what `before` holds of them."""
        for path, content in files.items():
            self.wrote(path, content, None)

    def forget(self, path: Path) -> None:
        """`path` stays as it is now (the command's write of it is its outcome)."""
        self.before.pop(absolute(path), None)
        self.ours.pop(absolute(path), None)
        self.created.discard(path)

    def put_back(self) -> list[Path]:
        """Put each file back as it was before, where it still holds what this command wrote (another command's
        write since is left alone); remove the files it created, then the directories it made, where empty. Never
        raises: a file that cannot be put back is left as it is. The paths put back."""
        done = []
        for path, ours in self.ours.items():
            before = self.before.get(path)
            now = current(path)
            if now != ours or now == before:
                continue
            try:
                if before is None:
                    path.unlink()
                else:
                    write_atomic(path, before)
                done.append(path)
            except OSError:
                continue
        for path in [*self.created, *([self.lock] if self.lock else [])]:
            try:
                path.unlink()
                done.append(path)
            except OSError:
                pass
        for folder in sorted(self.made, key=lambda p: len(p.parts), reverse=True):
            try:
                os.rmdir(folder)  # only when empty
            except OSError:
                pass
        return done


def hydra_record(run_dir: Path, subdir: Optional[str]) -> Files:
    """Hydra's record of a run (run_dir/<hydra.output_subdir>/: config.yaml, hydra.yaml, overrides.yaml) as it is
    now: what Hydra writes over before a job runs. Empty when hydra.output_subdir is null."""
    if subdir is None:
        return {}
    return snapshot(run_dir / subdir, ("config.yaml", "hydra.yaml", "overrides.yaml"))
