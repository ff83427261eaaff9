"""Searched sweeps and cluster jobs: the task returns the monitored metric to Optuna; a preemption signal stops
after the step with a checkpoint; under submitit's real local executor a preempted job is requeued and resumes."""
import csv
import json
import os
import signal
import subprocess
import time

import pytest
import yaml
from conftest import (
    COMMAND_S,
    ONE_THREAD,
    RUN,
    TINY,
    WAIT_S,
    assert_identical,
    assert_one_line_user_error,
    cli_command,
    final_weights,
    run_cli,
    train_here,
)

from accutrain.errors import UserError
from accutrain.signals import StopRequest


def test_every_preemption_signal_asks_for_a_stop_after_the_step():
    with StopRequest(announce=False, signals=(signal.SIGUSR1, signal.SIGUSR2)) as stop:
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
        assert stop.signum == signal.SIGUSR2 and stop.name == "SIGUSR2"
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # the previous handlers are back


@pytest.mark.parametrize("name", ["SIGKILL", "SIGNOPE"])
def test_a_signal_that_cannot_be_caught_is_one_line(tmp_path, name):
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "err", *TINY, f"trainer.preempt_signals=[SIGTERM,{name}]")
    assert_one_line_user_error(info.value, "trainer.preempt_signals=", name,
                               "is not valid: expected names of signals a process can catch")


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.long  # the docs' optuna commands run in test_readme
@pytest.mark.slow
def test_an_optuna_search_returns_the_monitored_metric_and_names_the_best_trial(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "search"
    proc = run_cli("-m", "+experiment=optuna_digits", "hydra.sweeper.n_trials=3", "trainer.epochs=1",
                   f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    rows = read_csv(sweep / "summary.csv")
    assert len(rows) == 3 and {r["status"] for r in rows} == {"completed"}
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    best = max(rows, key=lambda r: float(r["best"]))
    assert results["best_value"] == pytest.approx(float(best["best"]))  # what the task returned is the monitor's
    assert f"best run: {best['job']}" in proc.stdout
    report = run_cli(str(sweep), cwd=tmp_path, script="accutrain-report")
    assert f"best run: {best['job']}" in report.stdout and "3 runs, 3 completed" in report.stdout


@pytest.mark.long  # test_scheduler's two-task job is requeued the same way, in every run
@pytest.mark.slow
def test_a_preempted_submitit_job_is_requeued_and_ends_with_the_uninterrupted_weights(slow):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    tmp_path = slow  # slow.py is there, importable here too
    args = [*RUN, "trainer.eval_every=1000"]
    sweep = tmp_path / "sweep"
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)  # slow.py, for the jobs
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **ONE_THREAD}
    log = open(tmp_path / "sweep.log", "w")
    proc = subprocess.Popen([*cli_command(), "-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10",
                             *args, "+model.delay=0.03", "seed=0,1", f"hydra.sweep.dir={sweep}"], cwd=tmp_path,
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    job = sweep / "0"
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = job / "metrics.jsonl"
        if metrics.exists() and sum('"loss"' in line for line in metrics.read_text().splitlines()) >= 4:
            break
        time.sleep(0.01)
    pid = json.loads((job / "status.json").read_text())["pid"]
    os.kill(pid, signal.SIGUSR2)  # what SLURM sends before the time limit (submitit's preemption signal)
    assert proc.wait(timeout=COMMAND_S) == 0, (tmp_path / "sweep.log").read_text()
    train_log = (job / "train.log").read_text()
    assert "submitit requeues this job" in train_log and "requeued after a preemption: resuming" in train_log
    assert json.loads((job / "status.json").read_text())["state"] == "completed"
    rows = read_csv(sweep / "summary.csv")
    assert [r["status"] for r in rows] == ["completed", "completed"]
    uninterrupted, _ = train_here(tmp_path, "uninterrupted", *args, "seed=0")
    assert_identical(final_weights(job), final_weights(uninterrupted))
