"""The commands the tests fork (tests/forked.py) are the console script's: the same output, exit codes and files as
the script started in a fresh interpreter, and a process of their own that signals reach."""
from __future__ import annotations

import json
import os
import signal
import subprocess

import forked
import pytest
from conftest import (
    ONE_THREAD,
    TINY,
    TINY_DATA,
    WAIT_S,
    cli_command,
    command_process,
    read_metrics,
    run_cli,
    start,
    wait_for_steps,
)

pytestmark = pytest.mark.skipif(os.environ.get("ACCUTRAIN_TESTS_FRESH") == "1", reason="every command starts anew here")


def test_a_forked_command_answers_as_the_console_script(tmp_path):
    for args in (["--version"], [*TINY, "micro_batch=0"]):
        new = run_cli(*args, cwd=tmp_path, check=False, fresh=True)
        fork = run_cli(*args, cwd=tmp_path, check=False)
        assert (fork.returncode, fork.stdout, fork.stderr) == (new.returncode, new.stdout, new.stderr)
    assert new.returncode == 2 and "micro_batch=0" in new.stderr
    losses = {}
    for name, fresh in (("fresh", True), ("forked", False)):
        run_cli(*TINY, "trainer.max_steps=2", f"hydra.run.dir={tmp_path / name}", cwd=tmp_path, fresh=fresh)
        losses[name] = [r["loss"] for r in read_metrics(tmp_path / name)[0]]
        assert json.loads((tmp_path / name / "status.json").read_text())["state"] == "completed"
    assert losses["forked"] == losses["fresh"] and len(losses["fresh"]) == 2


def test_a_forked_command_is_a_process_of_its_own(slow):
    """Its own pid, which a signal reaches (SIGKILL: -9, as subprocess reports it); the user's module imported from
    its working directory (slow.Net), as the console script does."""
    proc = start(slow, "killed", *TINY_DATA, "model=custom", "model._target_=slow.Net", "+model.delay=0.05",
                 "trainer.max_steps=100")
    assert isinstance(proc, forked.Forked) and proc.pid > 0
    wait_for_steps(slow / "killed", 2, proc)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL
    echo = command_process([*cli_command(), "--version"], slow, {**os.environ, "PYTHONUNBUFFERED": "1", **ONE_THREAD},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert isinstance(echo, forked.Forked)
    assert echo.communicate(timeout=WAIT_S)[0].startswith("accutrain ") and echo.returncode == 0
