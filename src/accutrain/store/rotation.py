"""The run directory's checkpoints/ in rotation: step files (or sharded directories) newest first, the newest `keep`
kept with last.pt, the names given to a user (epoch<E>-step<S>.pt, best.pt), a later branch set aside after a resume."""
from __future__ import annotations

import logging
import os
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from accutrain.errors import UserError
from accutrain.store import mark
from accutrain.store.checkpoint import ABANDONED, NAMED_FILE, STEP_FILE, load, save_atomic
from accutrain.store.files import fsync_dir

log = logging.getLogger("accutrain")


class Rotation:
    """The run directory's checkpoints/: step-NNNNNNNN.pt files (the newest `keep`) and last.pt, the newest; or
    step-NNNNNNNN/ directories (sharded) and last, a link to the newest."""

    def __init__(self, directory: Path, keep: int) -> None:
        self.directory, self.keep = directory, keep
        self.unmarked = False  # said that the run directory lost its mark (once)

    def steps(self) -> list[Path]:
        """Step files, newest first (those of abandoned branches, in abandoned-*/, are not among them)."""
        if not self.directory.is_dir():
            return []
        files = [p for p in self.directory.iterdir() if STEP_FILE.match(p.name)]
        return sorted(files, key=step_number, reverse=True)

    def save(self, state: dict[str, Any], step: int, epoch: Optional[int] = None) -> Path:
        """step-NNNNNNNN.pt (and last.pt, the same file), and with `epoch` (1-based, the step's) a name for its user,
        epoch<E>-step<S>.pt, the same file again; the oldest beyond `keep` go, with their names."""
        path = self.directory / f"step-{step:08d}.pt"
        save_atomic(state, path)
        if epoch is not None:
            self.name(path, f"epoch{epoch}-step{step}.pt")
        last, tmp = self.directory / "last.pt", self.directory / ".last.pt.tmp"
        try:
            tmp.unlink(missing_ok=True)
            try:
                os.link(path, tmp)  # last.pt is the same file, swapped in atomically
            except OSError:
                save_atomic(state, tmp)
            os.replace(tmp, last)
            fsync_dir(self.directory)
        except BaseException:  # a full disk, an I/O error: no temporary file left behind; the step file is whole
            tmp.unlink(missing_ok=True)
            raise
        self.prune()
        return path

    def commit(self, path: Path) -> None:
        """A sharded checkpoint's directory is whole: `last` links to it, the oldest beyond `keep` go."""
        tmp = self.directory / ".last.tmp"
        tmp.unlink(missing_ok=True)
        os.symlink(path.name, tmp)
        os.replace(tmp, self.directory / "last")
        fsync_dir(self.directory)
        self.prune()

    def prune(self) -> None:
        """The step checkpoints beyond `keep` deleted (and their names), in a run directory accutrain marked only: in
        any other, one warning and nothing deleted."""
        gone = self.steps()[self.keep :]
        if gone and mark.owner(self.directory.parent) != "run":
            if not self.unmarked:
                log.warning(f"{self.directory.parent} no longer carries accutrain's mark ({mark.MARK_FILE}): the "
                            f"checkpoints beyond trainer.keep_checkpoints={self.keep} are kept, not deleted")
            self.unmarked = True
            return
        for old in gone:
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
        for named in self.named(lambda best, step: not best and step in {step_number(p) for p in gone}):
            named.unlink(missing_ok=True)

    def save_best(self, state: dict[str, Any], label: Optional[str] = None) -> Path:
        """best.pt: the state at the best evaluation so far; never rotated away, never what resume=auto picks. With
        `label` (epoch<E>-step<S>-<metric><value>) also best-<label>.pt, the same file, the previous best's name gone."""
        path = self.directory / "best.pt"
        save_atomic(state, path)
        for old in self.named(lambda best, step: best):
            old.unlink(missing_ok=True)
        if label is not None:
            self.name(path, f"best-{label}.pt")
        return path

    def name(self, path: Path, name: str) -> None:
        """Give the checkpoint file `path` a second name in its folder (a hard link: no second copy; no temporary
        file, as nothing reads it back). Where the file system has no hard links, it keeps its one name."""
        try:
            (self.directory / name).unlink(missing_ok=True)
            os.link(path, self.directory / name)
        except OSError as e:
            log.debug(f"{path} keeps its one name ({name}: {e})")

    def named(self, which: Any = None) -> list[Path]:
        """The checkpoints' names for their users (epoch<E>-step<S>.pt, best-….pt) that `which(best, step)` picks."""
        if not self.directory.is_dir():
            return []
        found = [(p, NAMED_FILE.match(p.name)) for p in self.directory.iterdir()]
        return [p for p, m in found if m and (which is None or which(bool(m.group(1)), int(m.group(2))))]

    def latest_good(self, passed: Optional[set[Path]] = None) -> Optional[tuple[Path, dict[str, Any]]]:
        """The newest checkpoint that loads, last.pt included (a last.pt that is no step file's link counts by the
        step it holds), but those `passed`; an unreadable one is reported (and added to `passed`) and the previous
        one tried."""
        passed = set() if passed is None else passed
        candidates: list[tuple[int, Path]] = [(step_number(p), p) for p in self.steps() if p not in passed]
        last = self.directory / "last.pt"
        if last.is_file() and last not in passed and not any(same_file(last, p) for _, p in candidates):
            try:
                candidates.append((int(load(last, mmap=True)["step"]), last))
            except (UserError, KeyError, TypeError, ValueError) as e:
                log.warning(f"resume=auto: {e if isinstance(e, UserError) else f'{last} holds no step'}; "
                            "it is not used")
                passed.add(last)
        candidates.sort(key=lambda c: c[0], reverse=True)  # a tie: the step file first (same state, named by step)
        for i, (_, path) in enumerate(candidates):
            try:
                return path, load(path)
            except UserError as e:
                passed.add(path)
                fallback = candidates[i + 1][1].name if i + 1 < len(candidates) else "none left: starting from scratch"
                log.warning(f"resume=auto: {e}; falling back to the previous checkpoint ({fallback})")
        return None

    def set_aside(self, step: int) -> Optional[Path]:
        """A run that goes on from optimizer step `step` starts a branch: the checkpoints of later steps (and last,
        best when they hold a later step or cannot be read) are moved, kept, into checkpoints/abandoned-<time>/, so
        that they never outrank the live branch in rotation or for resume=auto. That folder, or None (nothing was
        later)."""
        later = [p for p in self.steps() if step_number(p) > step]
        for name in ("last.pt", "last", "best.pt", "best"):
            path = self.directory / name
            if (path.exists() or path.is_symlink()) and self._step_held(path, later) > step:
                later.append(path)
        later += self.named(lambda best, held: held > step)
        if not later:
            return None
        mark.require(self.directory.parent, "run", "set a branch's later checkpoints aside")
        aside = self.directory / f"{ABANDONED}{datetime.now():%Y%m%d-%H%M%S}"
        n = 1
        while aside.exists():
            n += 1
            aside = aside.with_name(f"{ABANDONED}{datetime.now():%Y%m%d-%H%M%S}-{n}")
        aside.mkdir()
        for path in later:
            os.replace(path, aside / path.name)
        fsync_dir(self.directory)
        return aside

    def _step_held(self, path: Path, later: list[Path]) -> float:
        """The optimizer step last/last.pt/best/best.pt holds (infinite when it cannot be read: it is set aside)."""
        if path.is_symlink():
            match = STEP_FILE.match(os.readlink(path))
            return float(match.group(1)) if match else float("inf")
        for step_path in later + self.steps():
            if path.is_file() and step_path.is_file() and same_file(path, step_path):
                return float(step_number(step_path))
        try:
            return float(load(path, mmap=True, evaluation=True)["step"])  # best.pt: weights only
        except (UserError, KeyError, TypeError, ValueError):
            return float("inf")


def step_number(path: Path) -> int:
    """The optimizer step in a step checkpoint's name (step-NNNNNNNN.pt or step-NNNNNNNN/)."""
    return int(STEP_FILE.match(path.name).group(1))


def same_file(a: Path, b: Path) -> bool:
    """Whether two names are one file (last.pt is a hard link to the newest step file)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
