"""Issue 32, item 5: a disk that fills mid-run. Every run file's write that fails is one line and training goes on;
a checkpoint that cannot be written never replaces a good one, is said at the end and recorded in status.json;
status.json tells how the run ended. The full disk is the kernel's: RLIMIT_FSIZE lowered on the running process
(prlimit), so that its writes past the limit fail with EFBIG through the real write paths (torch.save's writer,
metrics.jsonl's append, train.log's handler, the plot), as ENOSPC would."""
import errno
import json
import os
import resource
import subprocess

import pytest
import torch
from conftest import COMMAND_S, ONE_THREAD, RUN, cli_command, wait_for_steps

from accutrain.store import status
from accutrain.train.metrics import MetricsLog


def limit_file_size(pid: int, size: int) -> None:
    """Files of process `pid` cannot grow past `size` bytes from now on (its later writes past it fail)."""
    hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)[1]
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (size, hard))


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_ends_cleanly_and_status_tells_the_truth(slow):
    tmp_path = slow
    run_dir = tmp_path / "run"
    args = [*RUN, "+model.delay=0.02", "trainer.epochs=30", "trainer.max_steps=30", "trainer.checkpoint_every=2"]
    proc = subprocess.Popen([*cli_command(), *args, f"hydra.run.dir={run_dir}"], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,  # a pipe: not a file of the limit
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **ONE_THREAD})
    try:
        wait_for_steps(run_dir, 4, proc)
        checkpoint_size = (run_dir / "checkpoints" / "last.pt").stat().st_size
        limit = (run_dir / "metrics.jsonl").stat().st_size + 2000  # metrics.jsonl fills a few steps later
        assert limit < checkpoint_size
        limit_file_size(proc.pid, limit)
        output = proc.communicate(timeout=COMMAND_S)[0]
    finally:
        proc.kill()
    assert proc.returncode == 2, output
    assert "Traceback" not in output and "Logging error" not in output, output
    assert output.count(f"could not write {run_dir / 'metrics.jsonl'}") == 1, output  # once, not per flush
    assert output.count(f"could not write {run_dir / 'train.log'}") <= 1, output
    errors = [line for line in output.splitlines() if "error: could not write the checkpoint of optimizer step 30" in
              line]  # said once, at the end: the run's last checkpoint
    assert len(errors) == 1 and "the run's last steps are not saved" in errors[0], output
    assert "the next checkpoint tries again" in output and f"records (up to optimizer step 30) could not be " \
        f"written to {run_dir / 'metrics.jsonl'}" in output

    record = json.loads((run_dir / "status.json").read_text())
    assert record["state"] == "failed" and "could not write the checkpoint of optimizer step 30" in record["error"]
    failed = record["checkpoints_failed"]
    assert failed["last_step"] == 30 and failed["count"] >= 1 and failed["error"] == os.strerror(errno.EFBIG)

    # the newest whole checkpoint is the last one written before the limit; no half-written file beside it
    checkpoints = run_dir / "checkpoints"
    assert not [p.name for p in checkpoints.iterdir() if p.name.endswith(".tmp")]
    last = torch.load(checkpoints / "last.pt", weights_only=True)
    assert last["step"] == failed["steps"][0] - 2 and f"step-{last['step']:08d}.pt" in os.listdir(checkpoints)
    # metrics.jsonl: whole lines only, the steps in order from 1 (those that fit)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if '"loss"' in line]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] >= last["step"]


def test_metrics_that_cannot_be_written_are_kept_and_written_later(tmp_path):
    """A failed append is cut back to the last whole line and its records written with the next flush."""
    path = tmp_path / "metrics.jsonl"
    metrics = MetricsLog(path)
    metrics.write({"plan": {}})
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 30, hard))
    try:
        for step in range(1, 4):
            metrics.step({"step": step, "loss": 0.5, "padding": "x" * 20})
        metrics.flush()
        size_while_full = path.stat().st_size
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert metrics.failure == os.strerror(errno.EFBIG) and size_while_full == len('{"plan": {}}\n')
    metrics.close()  # room again: every record, in order
    assert [json.loads(line).get("step") for line in path.read_text().splitlines()] == [None, 1, 2, 3]


def test_status_json_is_written_in_place_when_there_is_no_room_for_a_new_file(tmp_path, monkeypatch):
    status.write_status(tmp_path, "running")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(status, "write_atomic", full)  # a new file (the atomic replacement) finds no room
    status.write_status(tmp_path, "failed", "could not write the checkpoint of optimizer step 3")
    record = status.read_status(tmp_path)
    assert record["state"] == "failed" and record["error"].startswith("could not write the checkpoint")
    assert "started" in record and "ended" in record


def files_of_4_kib():
    """In the child: no file may grow past 4 KiB (the start's write check, 4 KiB, passes; Hydra's record does not)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


@pytest.mark.parametrize("sweep", [False, True])
def test_hydras_own_record_on_a_full_disk_is_one_line(tmp_path, sweep):
    """Issue 52: Hydra's .hydra/hydra.yaml (a run) or multirun.yaml (a sweep) that cannot be written was Hydra's
    traceback (its _save_config's OSError)."""
    deep = tmp_path.joinpath(*["d" * 200] * 18)  # hydra.yaml names the run directory twice: over 4 KiB
    args = ["-m", "debug=fast", "seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep'}"] if sweep else \
        ["debug=fast", f"hydra.run.dir={deep}"]
    proc = subprocess.run([*cli_command(), *args], cwd=tmp_path, capture_output=True, text=True, timeout=COMMAND_S,
                          preexec_fn=files_of_4_kib, env={**os.environ, **ONE_THREAD})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in output, output
    errors = [line for line in output.splitlines() if "error:" in line]
    written = tmp_path / "sweep" / "multirun.yaml" if sweep else deep / ".hydra" / "hydra.yaml"
    assert errors == [f"accutrain: error: Hydra could not write {written} ({os.strerror(errno.EFBIG)}): make room "
                      "on that disk (or choose a directory on another) and run the command again"], output
