"""status.json in a run directory: `running` from the start, then `completed`, `failed` (with the error in one
line) or `interrupted`, so that a report can tell finished, broken and still-running runs apart."""
from __future__ import annotations

import json
import logging
import os
import socket
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Optional

from accutrain.errors import Preempted, one_line
from accutrain.store.files import json_text, write_atomic
from accutrain.store.record import Changes, current

STATUS_FILE = "status.json"
FINAL_STATES = ("completed", "failed", "interrupted", "requeued")  # requeued: preempted, to resume under submitit

log = logging.getLogger("accutrain")


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="milliseconds")


def write_status(run_dir: Path, state: str, error: Optional[str] = None) -> Optional[bytes]:
    """Record the run's state; a final state keeps what the running record holds (start time, plan). The bytes
    written (None when they could not be). Never raises: logs a warning."""
    record: dict[str, Any] = {"state": state, "started": _now(), "host": socket.gethostname(), "pid": os.getpid()}
    if state != "running":
        record = {**(read_status(run_dir) or {}), **{k: v for k, v in record.items() if k != "started"}}
        record.setdefault("started", _now())
        record["ended"] = _now()
    if error is not None:
        record["error"] = error
    return _write(run_dir, record)


def add_to_status(run_dir: Path, **fields: Any) -> None:
    """Add fields (the batch plan, …) to the run's status record, if it has one."""
    record = read_status(run_dir)
    if record is not None:
        _write(run_dir, {**record, **fields})


def _write(run_dir: Path, record: dict[str, Any]) -> Optional[bytes]:
    """Replace status.json whole; when that fails (a full disk has no room for the new file), overwrite the old one
    in place: the blocks it holds already take the record, so that status.json tells how the run ended. The bytes
    written, or None."""
    path, text = run_dir / STATUS_FILE, (json_text(record) + "\n").encode()
    try:
        write_atomic(path, text)
        return text
    except OSError as e:
        error = e
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        fd = None
    if fd is not None:
        try:
            os.pwrite(fd, text, 0)
            os.ftruncate(fd, len(text))
            os.fsync(fd)
            return text
        except OSError:
            pass
        finally:
            os.close(fd)
    log.warning(f"could not record the run's status in {path}: {error.strerror or error}")
    return None


def read_status(run_dir: Path) -> Optional[dict[str, Any]]:
    """The status record, or None when there is none or it cannot be read."""
    try:
        record = json.loads((run_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "state" in record else None


def _alive(pid: int) -> bool:
    """Whether the process exists on this host and has not ended (a killed process not yet reaped is a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # no /proc (macOS): trust os.kill
        return True
    return state not in ("Z", "X")


def live_here(record: dict[str, Any]) -> bool:
    """The record's process runs on this host, and is not this process."""
    return (record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int)
            and record["pid"] != os.getpid() and _alive(record["pid"]))


def current_state(record: Optional[dict[str, Any]]) -> str:
    """completed | failed | interrupted | running | unknown (no record).

    A `running` record whose process is gone from this host was killed without a word: interrupted. On another
    host (a cluster node) that cannot be checked, so it stays running.
    """
    if record is None:
        return "unknown"
    state = record["state"]
    if state in FINAL_STATES:
        return state
    if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int) and not _alive(record["pid"]):
        return "interrupted"
    return "running"


def taken_over(run_dir: Path) -> bool:
    """Whether this run took its directory over: the session adds the plan to the running record once the resume is
    accepted and there is something to train, before it writes anything else there."""
    return "plan" in (read_status(run_dir) or {})


class Recorded:
    """What `recorded` did: `kept` is True when the command changed nothing and the earlier record was put back."""

    kept = False


@contextmanager
def recorded(run_dir: Path, changes: Optional[Changes] = None) -> Iterator[Recorded]:
    """Mark the run running, then completed, failed (error in one line) or interrupted (a signal); re-raises.

    A command continuing an earlier run (its status.json is there) that ends before it takes the directory over —
    refused, or with nothing left to train — leaves the earlier record as it was: status.json byte for byte (one of
    a run that had not been marked completed is marked so when nothing is left to train), and everything else in
    `changes` (what the command wrote before: Hydra's .hydra/ record, its mark) put back where it still holds what
    the command wrote. Each status.json this writes is added to `changes`."""
    path = run_dir / STATUS_FILE
    earlier = path.read_bytes() if path.is_file() and read_status(run_dir) is not None else None
    changes = Changes() if changes is None else changes
    outcome = Recorded()

    def record(state: str, error: Optional[str] = None) -> None:
        before = current(path)
        changes.wrote(path, write_status(run_dir, state, error), before)

    def put_back(done: bool) -> bool:
        if earlier is None or taken_over(run_dir):
            return False
        before = json.loads(earlier)
        if done and before["state"] != "completed":
            _write(run_dir, {**{k: v for k, v in before.items() if k != "error"}, "state": "completed",
                             "ended": _now()})
            changes.forget(path)
        changes.put_back()
        outcome.kept = True
        return True

    record("running")
    try:
        yield outcome
    except KeyboardInterrupt:
        if not put_back(False):
            record("interrupted")
        raise
    except Preempted as e:
        if not put_back(False):
            record("interrupted", str(e))
        raise
    except BaseException as e:
        if not put_back(False):
            record("failed", one_line(e))
        raise
    if not put_back(True):
        record("completed")
