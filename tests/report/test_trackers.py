"""Trackers (logger=): what TensorBoard, MLflow and W&B read back with their own readers is metrics.jsonl, one point
per optimizer step; a resumed run continues the same tracker runs without duplicates; a sweep's jobs are runs grouped
by the sweep; a tracker that fails mid-run is one warning line and training completes."""
import csv
import json
import shutil
import signal
import struct
import time
import zlib
from datetime import datetime
from pathlib import Path

import pytest
from conftest import (
    SLOW_MODEL,
    TINY,
    TINY_DATA,
    WAIT_S,
    read_metrics,
    run_cli,
    run_of,
    start,
    train_here,
    train_run,
    wait_for_steps,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

from accutrain.errors import UserError
from accutrain.store import mark
from accutrain.trackers import Trackers

# 100 samples in windows of 32: 4 optimizer steps per epoch (the last window of 4 samples), 8 over two epochs.
SPLIT = ["data.size=100", "micro_batch=16", "accum=2"]
RUN = [*TINY, *SPLIT]


def assert_points(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    """The same steps, in order, and the same values (TensorBoard keeps float32)."""
    assert [step for step, _ in got] == [step for step, _ in expected]
    assert [value for _, value in got] == pytest.approx([value for _, value in expected], rel=1e-6)


# --- reading back -------------------------------------------------------------------------------------------
def tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of a scalar as TensorBoard shows it: every point (size_guidance 0), purges applied."""
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def wandb_records(path: Path):
    """The records of a W&B offline run file (run-<id>.wandb), decoded with W&B's own protobuf classes. The framing
    is not a documented format: when it is not what this reader knows, the test is skipped, not failed."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B" or data[4:7] != struct.pack("<HB", 0xBEE1, 0):
        pytest.skip(f"{path.name} does not start with the W&B header this reader knows ({data[:7]!r})")
    block, pos, parts = 32768, 7, []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the tail of a 32 KiB block too short for a record header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload = data[pos + 7:pos + 7 + length]
        if kind == 0 or len(payload) < length or zlib.crc32(bytes([kind]) + payload) != crc:
            break  # zero padding, or a record cut short
        pos += 7 + length
        parts.append(payload)
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record
        elif kind not in (2, 3):
            pytest.skip(f"{path.name}: record piece type {kind} is not one this reader knows")


def wandb_segments(run_dir: Path) -> list[dict]:
    """Each offline segment of the run directory's W&B run (a resume adds one), oldest first: its run record and
    its history rows by step."""
    segments = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        seg = {"path": path, "history": {}}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                seg["run"] = record.run
            elif kind == "history":
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
                seg["history"][record.history.step.num] = row
        segments.append(seg)
    return segments


def mlflow_client(db: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{db.resolve()}")


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory):
    """An empty MLflow sqlite store, created once per test process: creating one takes several seconds (its
    migrations); each test copies it to where the run will look for its store."""
    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    mlflow_client(db).search_experiments()
    return db


def csv_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# --- every tracker, and a resume ----------------------------------------------------------------------------
@pytest.mark.xdist_group("mlflow")  # the tests that need an MLflow store run in one process: one template
def test_every_tracker_holds_the_steps_of_metrics_jsonl_and_a_resume_continues_the_same_runs(tmp_path,
                                                                                             mlflow_template):
    runs = tmp_path / "runs"
    runs.mkdir()
    shutil.copy(mlflow_template, runs / "mlflow.db")  # the default store: the run directory's parent
    args = [*RUN, "trainer.checkpoint_every=3"]
    began = time.time()
    run_dir, log = train_here(runs, "run", *args, "logger=[tensorboard,mlflow,wandb]")
    first = json.loads((run_dir / "trackers.json").read_text())
    assert "tensorboard: event files in" in log and "mlflow: run" in log and "wandb: offline run" in log
    # A run killed after step 8 whose newest checkpoint is step 6: the resume replays steps 7 and 8. It adds the
    # csv tracker, which gets steps 1-6 from metrics.jsonl.
    for name in ("step-00000008.pt", "last.pt"):
        (run_dir / "checkpoints" / name).unlink()
    time.sleep(max(0.0, began + 1.1 - time.time()))  # W&B names a run's offline segment by its start second
    _, log = train_here(runs, "run", *args, "logger=many", "resume=auto")
    assert "resumed from" in log and "at optimizer step 6" in log and "stopped logging" not in log
    again = json.loads((run_dir / "trackers.json").read_text())
    assert {k: again[k] for k in first} == first and "csv" in again  # the same tracker runs

    steps, evals = read_metrics(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 9)) and [r["step"] for r in evals] == [4, 8]
    losses = [(r["step"], r["loss"]) for r in steps]
    val = [(r["step"], r["val_loss"]) for r in evals]

    # TensorBoard: one point per optimizer step (the killed session's 7 and 8 purged), metrics.jsonl's values.
    assert_points(tensorboard_scalars(run_dir, "train/loss"), losses)
    assert tensorboard_scalars(run_dir, "train/samples_seen") == [(r["step"], r["samples_seen"]) for r in steps]
    assert_points(tensorboard_scalars(run_dir, "val/loss"), val)
    raw = [e.step for f in sorted(run_dir.glob("events.out.tfevents.*")) for e in EventFileLoader(str(f)).Load()
           if e.summary.value and e.summary.value[0].tag == "train/loss"]
    assert raw.count(7) == 2  # both sessions wrote step 7: the reader's purge is what keeps one
    events = EventAccumulator(str(run_dir), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert events.Images("loss_plot")[-1].encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"
    assert "config" in "".join(events.Tags()["tensors"]) and "summary/steps" in events.Tags()["scalars"]

    # MLflow: the same run, FINISHED, every step once, the config and the batch plan as parameters.
    client = mlflow_client(runs / "mlflow.db")
    run = client.get_run(first["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"  # the directory (and the overrides, by CLI)
    assert len(client.search_runs([run.info.experiment_id])) == 1
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert_points(sorted(history), losses)  # no step twice
    assert_points(sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val/loss")), val)
    params = run.data.params
    assert params["optim.lr"] == "0.05" and params["accum"] == "2" and params["plan.effective"] == "32"
    assert params["model.hidden"] == "[32]" and params["logger.wandb.mode"] == "null"
    assert run.data.metrics["summary/steps"] == 8 and run.data.metrics["summary/samples_seen"] == 200
    assert "loss.png" in [a.path for a in client.list_artifacts(run.info.run_id)]

    # W&B offline: two segments of one run id; the newest holds every step once (the earlier one may have lost
    # its unflushed tail to the kill; `wandb sync` keeps each step once).
    segments = wandb_segments(run_dir)
    assert len(segments) == 2 and {s["run"].run_id for s in segments} == {first["wandb"]["id"]}
    newest = segments[-1]["history"]
    assert sorted(newest) == list(range(1, 9))
    assert_points([(s, newest[s]["train/loss"]) for s in sorted(newest)], losses)
    assert_points([(s, newest[s]["val/loss"]) for s in sorted(newest) if "val/loss" in newest[s]], val)
    assert newest[8]["loss_plot/_type"] == "image-file"

    # CSV, added by the resumed session: metrics.jsonl's records as rows, every step.
    rows = csv_rows(run_dir / "metrics.csv")
    assert_points([(int(r["step"]), float(r["loss"])) for r in rows if r["loss"]], losses)
    assert_points([(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"]], val)


# --- a real kill --------------------------------------------------------------------------------------------
@pytest.mark.long  # a feature's resume: the core kill-and-resume test runs every time
@pytest.mark.slow
def test_a_killed_run_resumes_its_tensorboard_run_without_duplicate_steps(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_MODEL)
    args = [*TINY_DATA, *SPLIT, "model=custom", "model._target_=slow.Net", "+model.delay=0.03", "trainer.epochs=3",
            "trainer.checkpoint_every=4", "logger=[tensorboard,csv]"]
    proc = start(tmp_path, "run", *args)
    wait_for_steps(tmp_path / "run", 7, proc)  # steps 5-7 are logged after the checkpoint of step 4
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL
    run_dir, out = train_run(tmp_path, "run", *args, "resume=auto")
    assert "resumed from" in out.stderr
    steps, _ = read_metrics(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert_points(tensorboard_scalars(run_dir, "train/loss"), [(r["step"], r["loss"]) for r in steps])
    rows = csv_rows(run_dir / "metrics.csv")
    assert [int(r["step"]) for r in rows if r["loss"]] == list(range(1, 13))


# --- a sweep ------------------------------------------------------------------------------------------------
@pytest.mark.xdist_group("mlflow")
def test_a_sweep_is_one_tracker_run_per_job_grouped_by_the_sweep(tmp_path, mlflow_template):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    mark.write_new(sweep, "sweep")  # a sweep directory accutrain made: the store may be put there first
    shutil.copy(mlflow_template, sweep / "mlflow.db")  # where the jobs' store goes: their directories' parent
    run_cli("-m", *RUN, "trainer.max_steps=3", "seed=0,1", "logger=[tensorboard,mlflow,wandb]",
            f"hydra.sweep.dir={sweep}", cwd=tmp_path)

    # TensorBoard over the sweep directory: one run per job.
    runs = EventMultiplexer(size_guidance={"scalars": 0}).AddRunsFromDirectory(str(sweep))
    runs.Reload()
    assert sorted(runs.Runs()) == ["0", "1"]
    for job in ("0", "1"):
        steps, _ = read_metrics(sweep / job)
        assert_points([(e.step, e.value) for e in runs.Scalars(job, "train/loss")],
                      [(r["step"], r["loss"]) for r in steps])

    # MLflow: one experiment named after the sweep, a run per job.
    client = mlflow_client(sweep / "mlflow.db")
    experiment = client.get_experiment_by_name("sweep")
    jobs = client.search_runs([experiment.experiment_id])
    assert sorted(r.data.tags["accutrain.job"] for r in jobs) == ["0", "1"]
    for r in jobs:
        assert r.info.status == "FINISHED" and r.data.tags["accutrain.sweep"] == "sweep"
        assert r.data.params["seed"] == r.data.tags["accutrain.job"]
        assert r.info.run_name.startswith(f"{r.data.tags['accutrain.job']} ")
        assert [m.step for m in client.get_metric_history(r.info.run_id, "train/loss")] == [1, 2, 3]

    # W&B: two runs, one group.
    seen = [wandb_segments(sweep / job) for job in ("0", "1")]
    assert all(len(s) == 1 for s in seen)
    assert [s[0]["run"].run_group for s in seen] == ["sweep", "sweep"]
    assert seen[0][0]["run"].run_id != seen[1][0]["run"].run_id
    assert [sorted(s[0]["history"]) for s in seen] == [[1, 2, 3], [1, 2, 3]]


# --- failures -----------------------------------------------------------------------------------------------
class Saboteur:
    """A tracker of the test's own (logger=custom): removes TensorBoard's directory at step 3, raises at step 5."""

    def start(self, run):
        self.tensorboard = run.run_dir / "tb"

    def log_step(self, record):
        for _ in range(100) if record["step"] == 3 else ():  # TensorBoard's writer thread may add a file meanwhile
            shutil.rmtree(self.tensorboard, ignore_errors=True)
            if not self.tensorboard.exists():
                break
        if record["step"] == 5:
            raise ConnectionError("the tracking server went away")


def test_a_tracker_failing_mid_run_is_one_warning_line_and_training_completes(tmp_path, capfd):
    run_dir, log = train_here(tmp_path, "run", *RUN, "logger=[tensorboard,custom,csv]",
                              "logger.tensorboard.log_dir=tb", "logger.custom._target_=test_trackers.Saboteur")
    warnings = [line for line in log.splitlines() if "stopped logging" in line]
    assert len(warnings) == 2, log
    assert warnings[0].startswith("tracker tensorboard stopped logging (") and "FileNotFoundError" in warnings[0]
    assert warnings[1] == ("tracker custom stopped logging (log_step: ConnectionError: the tracking server went "
                           "away); training goes on")
    assert "done: 8 optimizer steps" in log and (run_dir / "checkpoints" / "step-00000008.pt").is_file()
    assert [int(r["step"]) for r in csv_rows(run_dir / "metrics.csv") if r["loss"]] == list(range(1, 9))
    printed = capfd.readouterr()
    assert "Traceback" not in printed.out + printed.err


@pytest.mark.parametrize("logger, module, extra", [("tensorboard", "torch.utils.tensorboard", "tensorboard"),
                                                   ("mlflow", "mlflow", "mlflow"), ("wandb", "wandb", "wandb")])
def test_a_missing_tracker_library_is_one_line_naming_the_extra(compose, tmp_path, monkeypatch, logger, module,
                                                                   extra):
    monkeypatch.setitem(__import__("sys").modules, module, None)  # `import module` now fails
    with pytest.raises(UserError) as error:
        Trackers.build(run_of(f"logger={logger}"), tmp_path)
    assert str(error.value) == f'logger={logger} needs the {module.split(".")[-1]} package: pip install ' \
                               f'"accutrain[{extra}]"'


@pytest.mark.parametrize("args, fragment", [
    (["logger=tensorboard", "+logger.tensorboard.colour=red"], "logger.tensorboard "
                                                               "(accutrain.trackers.tensorboard.TensorBoard): "
                                                               "got an unexpected keyword argument 'colour'"),
    (["logger=wandb", "logger.wandb.mode=sometimes"], "logger.wandb.mode=sometimes is not valid"),
    (["+logger.mine=3"], "logger.mine is not a tracker: expected logger.mine._target_=module.Class"),
    (["logger=custom", "logger.custom._target_=nowhere.Tracker"], "logger.custom._target_=nowhere.Tracker: "
                                                                  "cannot import it"),
])
def test_bad_tracker_options_are_one_line(compose, tmp_path, args, fragment):
    with pytest.raises(UserError) as error:
        Trackers.build(run_of(*args), tmp_path)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_logger_group_composes_one_several_or_none(compose):
    assert dict(compose().logger) == {}
    assert list(compose("logger=many").logger) == ["csv", "tensorboard", "mlflow", "wandb"]
    both = compose("logger=[tensorboard,csv]", "logger.tensorboard.log_dir=tb").logger
    assert list(both) == ["tensorboard", "csv"] and both.tensorboard.log_dir == "tb"
    assert compose("logger=mlflow", "logger.mlflow.tracking_uri=http://localhost:5000").logger.mlflow.tracking_uri \
        == "http://localhost:5000"


def test_an_unreachable_mlflow_server_is_switched_off_in_seconds(tmp_path):
    """A tracking_uri whose server does not answer (nothing listens on port 9): one warning line at start, then the
    run trains to its end without it — MLflow's own retries would hold step 1 for minutes."""
    run_dir, proc = train_run(tmp_path, "run", *TINY, "trainer.max_steps=3", "logger=mlflow",
                              "logger.mlflow.tracking_uri=http://127.0.0.1:9")
    output = proc.stdout + proc.stderr
    stopped = [line for line in output.splitlines() if "tracker mlflow stopped logging" in line]
    assert len(stopped) == 1 and "logger.mlflow.tracking_uri=http://127.0.0.1:9" in stopped[0], output
    assert "Traceback" not in output and len(read_metrics(run_dir)[0]) == 3
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed"
    span = datetime.fromisoformat(status["ended"]) - datetime.fromisoformat(status["started"])
    # the run itself (not the command's start-up) was not held by MLflow's retries, which take minutes; the margin
    # is a loaded 2-core machine's, where these few steps take up to a minute
    assert span.total_seconds() < 150, span


@pytest.mark.parametrize("args, fragment", [
    (["logger=csv", "logger.csv.filename=metrics.jsonl"],
     "logger.csv.filename=metrics.jsonl: metrics.jsonl is accutrain's own in the run directory"),
    (["logger=csv", "logger.csv.filename=checkpoints/rows.csv"],
     "logger.csv.filename=checkpoints/rows.csv: checkpoints is accutrain's own"),
    (["logger=tensorboard", "logger.tensorboard.log_dir=.hydra"], "logger.tensorboard.log_dir=.hydra: .hydra is"),
])
def test_a_tracker_cannot_take_the_run_directorys_own_names(compose, tmp_path, args, fragment):
    """Issue 32, item 8: `logger.csv.filename=metrics.jsonl` replaced the metrics with CSV rows."""
    with pytest.raises(UserError) as error:
        Trackers.build(run_of(*TINY, *args), tmp_path / "run")
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_a_tracker_file_clashing_or_outside_is_refused_before_anything_is_written(tmp_path):
    """From the command line: one line naming the key, exit 2, no run directory; an existing file outside the run
    directory is not replaced (a new one there is written)."""
    proc = run_cli(*TINY, "trainer.max_steps=2", "logger=csv", "logger.csv.filename=metrics.jsonl",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and not (tmp_path / "run").exists()
    assert "error: logger.csv.filename=metrics.jsonl: metrics.jsonl is accutrain's own" in proc.stderr
    (tmp_path / "precious.csv").write_text("the user's own rows\n")
    proc = run_cli(*TINY, "trainer.max_steps=2", "logger=csv", "logger.csv.filename=../precious.csv",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and not (tmp_path / "run").exists()
    assert (f"error: logger.csv.filename=../precious.csv: {tmp_path / 'precious.csv'} exists already, outside the "
            "run directory, and would be replaced") in proc.stderr
    assert (tmp_path / "precious.csv").read_text() == "the user's own rows\n"
    # a new file outside, then a resume of that run writes it again (it is the run's own now)
    run_dir, _ = train_run(tmp_path, "run", *TINY, "trainer.max_steps=2", "trainer.checkpoint_every=1",
                           "logger=csv", "logger.csv.filename=../rows.csv")
    assert len((tmp_path / "rows.csv").read_text().splitlines()) > 2
    train_run(tmp_path, "run", *TINY, "trainer.max_steps=3", "logger=csv", "logger.csv.filename=../rows.csv",
              "resume=auto")
    assert [int(r["step"]) for r in csv.DictReader(open(tmp_path / "rows.csv")) if r["loss"]] == [1, 2, 3]
