"""Run status, loss.png and `accutrain-report` on a finished, a failed and a half-finished run."""
import csv
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY, assert_one_line_error, read_metrics, run_cli, strict_json, train_run
from PIL import Image

from accutrain.errors import UserError
from accutrain.report import runs
from accutrain.report import summary as report
from accutrain.store.status import add_to_status, current_state, one_line, recorded, write_status

QUICK = [*TINY, "data.size=40", "micro_batch=4", "accum=2", "trainer.max_steps=4", "trainer.eval_every=2"]


def dead_pid() -> int:
    """The id of a process that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def status(run_dir):
    return json.loads((run_dir / "status.json").read_text())


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    run_dir, proc = train_run(tmp, "run", *QUICK)
    return run_dir, proc


@pytest.mark.xdist_group("test_report-finished_run")  # one worker builds the module's finished_run once
def test_a_run_records_its_status_and_draws_its_loss(finished_run):
    run_dir, proc = finished_run
    record = status(run_dir)
    assert record["state"] == "completed" and "error" not in record
    assert record["started"] <= record["ended"]
    with Image.open(run_dir / "loss.png") as image:
        image.verify()
    assert "warning" not in proc.stderr


@pytest.mark.xdist_group("test_report-finished_run")  # one worker builds the module's finished_run once
def test_report_on_a_single_run(finished_run, tmp_path):
    run_dir = shutil.copytree(finished_run[0], tmp_path / "run")
    (run_dir / "loss.png").unlink()
    proc = run_cli(str(run_dir), cwd=tmp_path, script="accutrain-report")
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 2, proc.stdout
    cells = [c.strip() for c in table[1].strip().strip("|").split("|")]
    assert (cells[2], cells[3], cells[4], cells[-1]) == ("8", "4 × 2 × 1", "4", "completed")
    assert "1 run, 1 completed" in proc.stdout
    steps, evals = read_metrics(run_dir)
    (row,) = list(csv.DictReader(open(run_dir / "summary.csv", newline="")))
    assert (row["effective_batch"], row["steps"], row["status"]) == ("8", "4", "completed")
    assert float(row["final_loss"]) == pytest.approx(steps[-1]["loss"])
    assert float(row["best_val_loss"]) == pytest.approx(min(e["val_loss"] for e in evals))
    process = json.loads((run_dir / "status.json").read_text())["peak_mem_mb"]  # the process's: evaluations too
    assert float(row["peak_mem_mb"]) == max(process, *(r["peak_mem_mb"] for r in steps))
    assert "data.size=40" in row["overrides"].split()
    assert "loss.png" in (run_dir / "summary.md").read_text()
    with Image.open(run_dir / "loss.png") as image:
        image.verify()


def half_finished(finished_run, tmp_path, pid):
    """The finished run as a killed (or still running) one leaves it: metrics cut mid-line, status running."""
    run_dir = shutil.copytree(finished_run[0], tmp_path / "run")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    step_lines = [i for i, line in enumerate(lines) if '"loss"' in line]
    cut = step_lines[2]  # keep two whole steps, then half of the third
    (run_dir / "metrics.jsonl").write_text("".join(lines[:cut]) + lines[cut][: len(lines[cut]) // 2])
    record = status(run_dir)
    (run_dir / "status.json").write_text(json.dumps(dict(state="running", started=record["started"],
                                                         host=socket.gethostname(), pid=pid)))
    shutil.rmtree(run_dir / "checkpoints")
    return run_dir


@pytest.mark.xdist_group("test_report-finished_run")  # one worker builds the module's finished_run once
def test_report_on_a_killed_run(finished_run, tmp_path):
    run_dir = half_finished(finished_run, tmp_path, dead_pid())
    proc = run_cli(str(run_dir), cwd=tmp_path, script="accutrain-report")
    (row,) = list(csv.DictReader(open(run_dir / "summary.csv", newline="")))
    assert (row["steps"], row["status"], row["effective_batch"]) == ("2", "interrupted", "8")
    assert float(row["final_loss"]) == pytest.approx(read_metrics(finished_run[0])[0][1]["loss"])
    assert "interrupted" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.xdist_group("test_report-finished_run")  # one worker builds the module's finished_run once
def test_report_on_a_running_run(finished_run, tmp_path):
    run_dir = half_finished(finished_run, tmp_path, os.getpid())  # this process is alive: the run is running
    proc = run_cli(str(run_dir), cwd=tmp_path, script="accutrain-report")
    (row,) = list(csv.DictReader(open(run_dir / "summary.csv", newline="")))
    assert (row["steps"], row["status"]) == ("2", "running")
    assert float(row["wall_s"]) > 0
    assert "1 run, 1 running" in proc.stdout


def test_a_single_run_with_a_bad_value_is_one_line_and_writes_nothing(tmp_path):
    """A bad value is refused before the run directory is made (a sweep's job records it:
    tests/report/test_sweeps.py)."""
    run_dir, proc = train_run(tmp_path, "bad", *TINY, "micro_batch=0", check=False)
    assert proc.returncode == 2
    assert_one_line_error(proc, "micro_batch=0")
    assert not run_dir.exists()


@pytest.mark.parametrize("make, fragment", [
    (lambda tmp: tmp / "nowhere", "is not a directory"),
    (lambda tmp: tmp, "no accutrain run in"),
])
def test_report_on_nothing_is_one_line(tmp_path, make, fragment):
    proc = run_cli(str(make(tmp_path)), cwd=tmp_path, script="accutrain-report", check=False)
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("accutrain-report: error:") and fragment in proc.stderr


# --- units --------------------------------------------------------------------------------------------
def fake_run(run_dir, steps, state="completed", overrides=("micro_batch=8",), extra=None):
    run_dir.mkdir(parents=True)
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    plan = dict(effective=32, micro_batch=8, accum=4, devices=1)
    lines = [json.dumps(dict(plan=plan))] + [
        json.dumps(dict(step=i + 1, loss=1.0 / (i + 1), samples=32, samples_seen=32 * (i + 1),
                        samples_per_s=100.0 + i, **(extra(i) if extra else {}))) for i in range(steps)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    write_status(run_dir, "running")
    add_to_status(run_dir, plan=plan)
    if state != "running":
        write_status(run_dir, state)
    return run_dir


def test_peak_memory_is_the_largest_recorded_and_missing_otherwise(tmp_path):
    with_mem = runs.read_run(fake_run(tmp_path / "a", 3, extra=lambda i: dict(peak_mem_mb=[500.0, 900.4, 700][i])),
                               "a")
    without = runs.read_run(fake_run(tmp_path / "b", 3), "b")
    assert with_mem.peak_mem_mb == 900.4 and without.peak_mem_mb is None
    cells = report.table_cells([with_mem, without])
    assert cells[0][9] == "900"
    assert cells[1][9] == runs.MISSING_VALUE
    assert (with_mem.effective, with_mem.micro_batch, with_mem.accum, with_mem.devices) == (32, 8, 4, 1)
    assert with_mem.samples_per_s == 101.0  # the median over steps


def test_metrics_reader_skips_a_truncated_line_and_keeps_the_latest_record_of_a_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 2, "loss": 1.4}\n'
                    '{"step": 2, "val_loss": 1.3, "val_acc": 0.5}\n{"step": 3, "lo')
    steps, evals = runs.read_metrics(path)
    assert [(r["step"], r["loss"]) for r in steps] == [(1, 2.0), (2, 1.4)]
    assert [e["val_acc"] for e in evals] == [0.5]


def test_metrics_jsonl_is_strict_json_and_a_value_that_is_not_finite_is_null(tmp_path):
    """An infinite validation loss (a model that puts probability 0 on a target) was written `Infinity`, which only
    Python's json reads: every record is strict JSON, a non-finite value null, and the report reads it as missing."""
    from accutrain.train.metrics import MetricsLog

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    metrics.step(dict(step=1, loss=2.0, samples_seen=8, grad_norm=float("nan"), lr=0.1))
    metrics.evaluation(dict(step=1, epoch=1, val_loss=float("inf"), val_acc=0.5, val_ppl=float("-inf")))
    metrics.step(dict(step=2, loss=1.0, samples_seen=16, lr=0.1))
    metrics.evaluation(dict(step=2, epoch=1, val_loss=0.7, val_acc=0.75))
    metrics.close()
    steps, evals = read_metrics(run_dir)  # conftest's reader refuses NaN and Infinity
    assert steps[0]["grad_norm"] is None and steps[0]["loss"] == 2.0
    assert (evals[0]["val_loss"], evals[0]["val_ppl"], evals[0]["val_acc"]) == (None, None, 0.5)
    row = runs.read_run(run_dir, "run")
    assert row.best_val_loss == 0.7 and row.best_val_acc == 0.75 and row.val_curve == [(16, 0.7)]
    write_status(run_dir, "running")
    add_to_status(run_dir, best=dict(metric="val_loss", value=float("nan")))
    assert strict_json((run_dir / "status.json").read_text())["best"]["value"] is None


def test_find_runs_orders_jobs_naturally_and_skips_hidden_folders(tmp_path):
    for job in ("10", "2", "1"):
        fake_run(tmp_path / "sweep" / job, 1)
    (tmp_path / "sweep" / ".submitit" / "123").mkdir(parents=True)
    (tmp_path / "sweep" / ".submitit" / "123" / "status.json").write_text("{}")
    found = runs.find_runs(tmp_path / "sweep")
    assert [p.name for p in found] == ["1", "2", "10"]
    assert runs.find_runs(tmp_path / "sweep" / "2") == [tmp_path / "sweep" / "2"]


def test_states():
    host = socket.gethostname()
    assert current_state(None) == "unknown"
    assert current_state(dict(state="completed")) == "completed"
    assert current_state(dict(state="failed", error="x")) == "failed"
    assert current_state(dict(state="running", host=host, pid=os.getpid())) == "running"
    assert current_state(dict(state="running", host=host, pid=dead_pid())) == "interrupted"
    assert current_state(dict(state="running", host=host + "-elsewhere", pid=dead_pid())) == "running"


@pytest.mark.skipif(not hasattr(os, "waitid") or not os.path.isdir("/proc"), reason="needs Linux /proc")
def test_a_killed_process_not_yet_reaped_counts_as_ended():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # it has ended but is not reaped: a zombie
    try:
        assert current_state(dict(state="running", host=socket.gethostname(), pid=proc.pid)) == "interrupted"
    finally:
        proc.wait()


def test_recorded_marks_every_outcome(tmp_path):
    with recorded(tmp_path):
        assert status(tmp_path)["state"] == "running"
    assert status(tmp_path)["state"] == "completed"
    (tmp_path / "failed").mkdir()
    (tmp_path / "stopped").mkdir()
    with pytest.raises(UserError), recorded(tmp_path / "failed"):  # a new run's (an earlier one's record is kept)
        raise UserError("accum=0 is not valid")
    assert (status(tmp_path / "failed")["state"], status(tmp_path / "failed")["error"]) == ("failed",
                                                                                            "accum=0 is not valid")
    with pytest.raises(KeyboardInterrupt), recorded(tmp_path / "stopped"):
        raise KeyboardInterrupt
    assert status(tmp_path / "stopped")["state"] == "interrupted"
    assert one_line(ValueError("first\nsecond")) == "ValueError: first"
    assert one_line(RuntimeError()) == "RuntimeError"


def sweep_rows() -> list:
    """An accum sweep at a fixed micro_batch (so micro_batch never changes), one of whose jobs diverged."""
    from accutrain.report.runs import RunRow

    rows = []
    for job, accum in enumerate((1, 2, 4)):
        losses = [2.3 * 0.97 ** i + 0.3 * (i % 2) for i in range(60)]  # spiky, as at lr 0.05
        if accum == 4:
            losses = [2.3 * 10 ** (i / 3) for i in range(60)]  # diverged: up to 1e20
        rows.append(RunRow(path=Path(str(job)), job=str(job), overrides=["micro_batch=8", f"accum={accum}"],
                           status="completed", micro_batch=8, accum=accum, devices=1, effective=8 * accum,
                           samples_per_s=1000.0 * accum, peak_mem_mb=500.0 + accum,
                           curve=[(8 * accum * (i + 1), loss) for i, loss in enumerate(losses)]))
    return rows


def test_summary_plot_is_against_what_the_sweep_varied_and_a_diverged_job_hides_nothing():
    """Item 10: memory and speed against accum (the override that varies), labelled; the loss axis cut above the
    runs that did not diverge, and the plot says which one did."""
    from accutrain.report.plots import summary_figure

    loss, memory, speed = summary_figure(sweep_rows()).axes
    for ax, label in ((memory, "peak memory (MiB)"), (speed, "samples/s")):
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("accum", label)
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4"]
    assert loss.get_ylim()[1] < 5  # the healthy curves (losses up to 2.6) fill the axis
    notes = [t.get_text() for t in loss.texts]
    assert len(notes) == 1 and notes[0].startswith("axis cut at") and "diverged: accum=4 (up to 1.07e+20)" in notes[0]


def test_summary_plot_of_several_varied_overrides_names_each_job():
    from accutrain.report.plots import summary_figure

    rows = sweep_rows()[:2]
    rows[1].overrides = ["micro_batch=16", "accum=2", "model=cnn"]
    _, memory, _ = summary_figure(rows).axes
    assert memory.get_xlabel() == "job (micro_batch, accum, model)"
    assert [t.get_text() for t in memory.get_xticklabels()] == ["micro_batch=8 accum=1",
                                                                "micro_batch=16 accum=2 model=cnn"]


def test_loss_plot_draws_a_moving_average_over_the_raw_loss():
    """Item 11."""
    from accutrain.report.plots import run_figure, smoothed

    row = sweep_rows()[0]
    ax = run_figure(row).axes[0]
    raw, average = ax.lines[:2]
    assert raw.get_alpha() < 1 and list(raw.get_ydata()) == [loss for _, loss in row.curve]
    assert "moving average over ~6 steps" in average.get_label()
    spikes = lambda ys: sum(abs(b - a) for a, b in zip(ys, ys[1:]))  # noqa: E731
    assert spikes(list(average.get_ydata())) < spikes(list(raw.get_ydata())) / 3
    assert smoothed([2.0, 2.0, None, float("nan"), 2.0], 5) == [2.0] * 5  # debiased; a skipped step keeps the value
