"""The run directory before a run starts: whether an earlier run left its work there (then it is continued with
resume=auto, replaced with trainer.overwrite=true, or refused), and whether this run can write into it."""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from accutrain.errors import UserError
from accutrain.store.files import read_jsonl
from accutrain.store.record import Changes
from accutrain.store.run_files import CHECKPOINTS, METRICS, RUN_FILES  # noqa: F401 (RUN_FILES: for store.owned)
from accutrain.store.status import STATUS_FILE, live_here, read_status

log = logging.getLogger("accutrain")



def checkpoint_files(run_dir: Path) -> list[Path]:
    """The checkpoints (step-NNNNNNNN.pt, last.pt, their names epoch<E>-step<S>.pt and best-….pt) and checkpoint
    temporary files in run_dir/checkpoints/."""
    from accutrain.store.checkpoint import NAMED_FILE, STEP_FILE  # (checkpoint imports torch: not needed for --help)

    folder = run_dir / CHECKPOINTS
    if not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if STEP_FILE.match(p.name) or NAMED_FILE.match(p.name) or p.name == "last.pt"
            or (p.name.startswith(".") and p.name.endswith(".tmp"))]


def earlier_run(run_dir: Path) -> Optional[str]:
    """What an earlier run left in run_dir (its status, optimizer steps logged, checkpoints), or None when there is
    nothing to lose: no checkpoint, no step in metrics.jsonl, and no status.json but one of a run that failed or was
    interrupted before its first optimizer step (its record is replaced)."""
    record = read_status(run_dir)
    steps = sum(1 for _, r in read_jsonl(run_dir / METRICS) if "loss" in r and isinstance(r.get("step"), int))
    checkpoints = sorted(p.name for p in checkpoint_files(run_dir) if p.name.startswith("step-"))
    started = record is None or record["state"] not in ("failed", "interrupted")
    if not steps and not checkpoint_files(run_dir) and not (started and (run_dir / STATUS_FILE).exists()):
        return None
    parts = [f"status {record['state']}" if record else "no status.json"]
    parts.append(f"{steps} optimizer step{'s' if steps > 1 else ''} in {METRICS}" if steps else f"no step in {METRICS}")
    parts.append(f"checkpoints up to {checkpoints[-1]}" if checkpoints else "no step checkpoint")
    return ", ".join(parts)


def check_reuse(run_dir: Path, resume: Optional[str], overwrite: bool, key: str = "hydra.run.dir") -> bool:
    """Refuse (UserError) a run directory that holds an earlier run unless the config continues it (`resume`: auto, or
    a checkpoint) or replaces it (trainer.overwrite=true), or while that run is still running on this host. True when
    an earlier run is there."""
    found = earlier_run(run_dir)
    if found is None:
        return False
    record = read_status(run_dir)
    if record is not None and record["state"] == "running" and live_here(record):
        raise UserError(f"{run_dir} ({key}) is in use: its run is still running (pid {record['pid']} on this "
                        "host); wait for it to end or stop it, or choose another directory")
    if resume is None and not overwrite:
        raise UserError(f"{run_dir} ({key}) holds an earlier run ({found}): add resume=auto to continue it, "
                        f"trainer.overwrite=true to delete it and start afresh, or choose a new {key}")
    return True


def writable(directory: Path, what: str) -> None:
    """Make `directory` if needed and write (and fsync) a small file in it, so that a directory that is a file,
    read-only or on a full disk is one line now rather than a lost run later."""
    if directory.exists() and not directory.is_dir():
        raise UserError(f"cannot write {what} into {directory}: it is a file, not a directory (move it away)")
    probe = directory / f".accutrain-write-test-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise UserError(f"cannot write {what} into {directory}: {e.strerror or e}") from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass


def appendable(path: Path, what: str) -> None:
    """The log file Hydra will open for appending (created empty when it does not exist)."""
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise UserError(f"cannot write {what} {path}: {e.strerror or e}") from None


def check_writable(run_dir: Path, log_file: Optional[Path] = None) -> None:
    """The run directory, its checkpoints/ and (when given) its log file can be written."""
    writable(run_dir, "the run's files")
    writable(run_dir / CHECKPOINTS, "checkpoints")
    if log_file is not None:
        appendable(log_file, "the log file")


def clear(run_dir: Path) -> list[str]:
    """trainer.overwrite=true: delete what an earlier run owned and empty its train.log (store.overwrite); the names
    removed."""
    from accutrain.store.overwrite import clear_run

    return clear_run(run_dir)


LOCK_FILE = ".lock"


@contextmanager
def held(run_dir: Path, key: str = "hydra.run.dir", changes: Optional[Changes] = None) -> Iterator[None]:
    """This command's hold on run_dir (a run's or a sweep's), from before it looks for an earlier run there to its
    end: a second accutrain started into the same directory meanwhile (two fresh starts, two resume=auto at the same
    moment) is refused in one line, where the check and the `running` record would let both through. The hold is the
    kernel's lock (flock) on run_dir/.lock: it ends with the process, however the process ends. A lock file this
    creates is added to `changes`. Where there is no flock (Windows), nothing is held."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / LOCK_FILE
    try:
        fd, created = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        fd, created = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644), False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"{run_dir} ({key}) is in use: another accutrain is running in it right now; wait for it to "
                        "end, or choose another directory") from None
    if created and changes is not None:
        changes.lock = lock
    try:
        yield
    finally:
        os.close(fd)  # the lock goes with the descriptor


def prepare(run_dir: Path, resume: Optional[str], overwrite: bool, log_file: Optional[Path] = None) -> None:
    """Before a run writes anything into run_dir: refuse an earlier run's directory (unless continued or replaced),
    check that it can be written, and with trainer.overwrite=true delete what the earlier run wrote."""
    if check_reuse(run_dir, resume, overwrite) and overwrite:
        removed = clear(run_dir)
        log.warning(f"trainer.overwrite=true: deleted the earlier run's {', '.join(removed) or 'files'} in {run_dir}")
    check_writable(run_dir, log_file)
