"""Never lose a run, part 4 (issue 44): two commands racing for one folder never remove or change each other's files.
Each command's steps — the command line checked, the directory claimed (held, looked at again, marked), Hydra's job
run — are interleaved in every order, in this process, deterministically; and a refused command puts back only
what it wrote itself."""
from __future__ import annotations

import itertools
import json
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

import pytest
from conftest import TINY

from accutrain.cli import hydra_internals
from accutrain.cli.command import check, claimed
from accutrain.cli.job import Tally, train_job
from accutrain.config.train import config_dir
from accutrain.errors import UserError
from accutrain.store import mark, record

FRESH = [*TINY, "data.size=24", "micro_batch=8", "trainer.max_steps=1", "trainer.progress=false"]
STEPS = ("check", "claim", "run")


def files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, dot-files included (the mark, the lock, Hydra's record)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class Command:
    """One `accutrain … hydra.run.dir=<run_dir>`, step by step as accutrain.cli.main runs it."""

    def __init__(self, run_dir: Path) -> None:
        self.argv = [*FRESH, f"hydra.run.dir={run_dir}"]
        self.decided, self.hold, self.outcome, self.error = None, ExitStack(), None, ""
        self.after: Optional[dict[str, bytes]] = None  # the run directory as the command left it, if it trained

    def step(self, name: str, run_dir: Path) -> None:
        if self.outcome is not None:  # refused: its remaining steps never happen
            return
        try:
            if name == "check":
                self.decided = check(self.argv)
            elif name == "claim":
                self.hold.enter_context(claimed(self.decided))
            else:
                with self.hold:
                    hydra_internals.run(self.decided.argv, train_job(self.decided, Tally(), lambda: None),
                                        str(config_dir()), "train", self.decided.mode)
                self.outcome, self.after = "completed", files(run_dir)
        except UserError as e:
            self.outcome, self.error = "refused", str(e)
        except SystemExit as e:
            assert e.code == 2, e.code
            self.outcome = "refused"


def orders() -> list[tuple[str, ...]]:
    """Every interleaving of two commands' three steps (each command's in its own order): 20."""
    found = set()
    for chosen in itertools.combinations(range(6), 3):
        found.add(tuple("a" if i in chosen else "b" for i in range(6)))
    return sorted(found)


@pytest.mark.slow
def test_two_fresh_commands_into_one_new_folder_in_every_order(tmp_path):
    """Issue 44: a command refused after another took the folder removed what it found absent when it started —
    the other's status.json, train.log, Hydra's record. In every order: one complete run, one refusal, and the
    complete run's files as it left them, byte for byte."""
    for n, order in enumerate(orders()):
        run_dir = tmp_path / f"order-{n}" / "run"
        commands = {"a": Command(run_dir), "b": Command(run_dir)}
        steps = {"a": iter(STEPS), "b": iter(STEPS)}
        for who in order:
            commands[who].step(next(steps[who]), run_dir)
        outcomes = sorted(c.outcome for c in commands.values())
        assert outcomes == ["completed", "refused"], (order, outcomes)
        done = next(c for c in commands.values() if c.outcome == "completed")
        refused = next(c for c in commands.values() if c.outcome == "refused")
        assert "is in use: another accutrain is running in it" in refused.error or \
            "holds an earlier run (status completed" in refused.error, (order, refused.error)
        assert files(run_dir) == done.after, order
        assert json.loads((run_dir / "status.json").read_text())["state"] == "completed"
        assert mark.read(run_dir)["accutrain"] == "run" and (run_dir / "checkpoints" / "last.pt").is_file()


def test_a_refused_command_puts_back_only_what_it_wrote(tmp_path):
    """What another command wrote since — a file rewritten, a file created — stays; what this one wrote goes back
    as it was; a folder it made goes only when empty."""
    run_dir = tmp_path / "run"
    changes = record.Changes(made=[run_dir])
    run_dir.mkdir()
    mine, rewritten, kept = run_dir / "mine.yaml", run_dir / "rewritten.yaml", run_dir / "kept.yaml"
    kept.write_text("before\n")
    for path in (mine, rewritten, kept):
        before = record.current(path)
        path.write_text("this command's\n")
        changes.wrote(path, path.read_bytes(), before)
    rewritten.write_text("another command's\n")  # written over since
    (run_dir / "theirs.yaml").write_text("another command's\n")  # created since
    assert changes.put_back() == [mine, kept]
    assert files(run_dir) == {"kept.yaml": b"before\n", "rewritten.yaml": b"another command's\n",
                              "theirs.yaml": b"another command's\n"}
    assert run_dir.is_dir()  # not empty: left
    (run_dir / "theirs.yaml").unlink()
    (run_dir / "rewritten.yaml").unlink()
    (run_dir / "kept.yaml").unlink()
    changes.put_back()
    assert not run_dir.exists()  # made by the command, and empty now


def test_a_file_named_from_two_places_is_put_back_as_one(tmp_path, monkeypatch):
    """The claim names the run directory as the command line gives it (runs/x), the job as Hydra's absolute output
    directory: Hydra's record kept under one name and found under the other was removed, not put back."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "x").mkdir(parents=True)
    overrides = tmp_path / "runs" / "x" / "overrides.yaml"
    overrides.write_text("- seed=0\n")
    changes = record.Changes()
    changes.was({Path("runs/x/overrides.yaml"): b"- seed=0\n"})
    overrides.write_text("- resume=auto\n")  # what Hydra writes for the command
    changes.found({overrides: b"- resume=auto\n"})
    changes.put_back()
    assert overrides.read_text() == "- seed=0\n"


def test_a_claim_the_disk_refuses_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """The disk fills between the command's checks and its claim: one line, and neither its lock nor its mark
    left behind."""
    import errno
    import os

    from accutrain.store import claim

    def full(directory, kind):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(mark, "write_new", full)
    changes = record.Changes(made=[tmp_path / "run"])
    with pytest.raises(UserError, match=r"cannot write the run's files into .*run \(hydra.run.dir\): No space left"):
        with claim.claimed(tmp_path / "run", "run", "hydra.run.dir", lambda: None, changes):
            pass
    assert not (tmp_path / "run").exists()
