"""Multiruns through the real CLI: one summary row per job, failing jobs recorded without ending the sweep;
the experiment and launcher configs compose."""
import csv
import json
import shutil

import pytest
from conftest import TINY, TINY_DATA, assert_one_line_error, read_metrics, run_cli
from PIL import Image

from accutrain.config.train import config_dir

# 40 samples, 3 optimizer steps per job: the sweep is about the summary, not the training.
QUICK = [*TINY, "data.size=40", "trainer.max_steps=3"]


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def assert_png(path):
    with Image.open(path) as image:
        image.verify()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A finished multirun of three jobs, the last of which fails at run time (micro_batch=0)."""
    tmp = tmp_path_factory.mktemp("sweep")
    proc = run_cli("-m", *QUICK, "micro_batch=4,8,0", "accum=2", f"hydra.sweep.dir={tmp / 'sweep'}", cwd=tmp,
                   check=False)
    return tmp / "sweep", proc


@pytest.mark.xdist_group("test_sweeps-sweep")  # one worker builds the module's sweep once
def test_multirun_summarises_every_job_and_goes_on_past_a_failing_one(sweep):
    sweep_dir, proc = sweep
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the sweep ran to the end, and says a job failed
    assert "Traceback" not in proc.stderr
    assert "1 of 3 jobs failed" in proc.stderr

    rows = read_csv(sweep_dir / "summary.csv")
    assert [r["job"] for r in rows] == ["0", "1", "2"]
    assert [r["status"] for r in rows] == ["completed", "completed", "failed"]
    assert [r["effective_batch"] for r in rows] == ["8", "16", ""]
    assert [(r["micro_batch"], r["accum"], r["devices"]) for r in rows[:2]] == [("4", "2", "1"), ("8", "2", "1")]
    assert [r["steps"] for r in rows] == ["3", "3", "0"]
    assert "micro_batch=0 is not valid" in rows[2]["error"]
    for r, micro_batch in zip(rows, (4, 8, 0)):
        assert f"micro_batch={micro_batch}" in r["overrides"].split()
    for r in rows[:2]:
        steps, evals = read_metrics(sweep_dir / r["job"])
        assert float(r["final_loss"]) == pytest.approx(steps[-1]["loss"])
        assert float(r["best_val_acc"]) == pytest.approx(max(e["val_acc"] for e in evals))

    summary = (sweep_dir / "summary.md").read_text()
    table = [line for line in summary.splitlines() if line.startswith("| ")]
    assert len(table) == 4  # the header and one row per job
    assert "| micro_batch=4 |" in table[1] and "4 × 2 × 1" in table[1] and table[1].rstrip().endswith("completed |")
    assert table[3].rstrip().endswith("failed    |")
    assert "- 2 failed: micro_batch=0 is not valid" in summary
    assert "overrides shared by every run:" in summary and "accum=2" in summary
    shared = next(line for line in summary.splitlines() if line.startswith("overrides shared by every run:"))
    assert "micro_batch=" not in shared  # varying overrides stay out of the shared line
    best = max(rows[:2], key=lambda r: float(r["best"]))  # the better of the two that ran, by the monitored val_acc
    assert f"best run: {best['job']} (micro_batch={best['micro_batch']}): val_acc {float(best['best']):.4f}" in summary
    assert "![" in summary
    assert_png(sweep_dir / "summary.png")
    assert "| micro_batch=8 |" in proc.stdout  # the table is printed at the end of the sweep

    for job in ("0", "1"):
        assert_png(sweep_dir / job / "loss.png")
    assert not (sweep_dir / "2" / "loss.png").exists()  # no step, no plot
    errors = [line for line in (sweep_dir / "2" / "train.log").read_text().splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "micro_batch=0" in errors[0]


@pytest.mark.xdist_group("test_sweeps-sweep")  # one worker builds the module's sweep once
def test_the_sweeps_stdout_is_its_table_and_hydras_launch_lines_are_on_stderr(sweep):
    """docs/outputs.md's recipe, `accutrain -m … > table.md`, gives a file that starts with the table."""
    sweep_dir, proc = sweep
    assert "[HYDRA] Launching 3 jobs locally" in proc.stderr and "[HYDRA] \t#0 : " in proc.stderr
    assert "[HYDRA]" not in proc.stdout
    assert proc.stdout.startswith(f"{sweep_dir}: 3 runs, 2 completed, 1 failed\n"), proc.stdout[:300]
    assert "\n| job | overrides " in proc.stdout


@pytest.mark.xdist_group("test_sweeps-sweep")  # one worker builds the module's sweep once
def test_report_rebuilds_the_same_summary_of_a_finished_sweep(sweep, tmp_path):
    sweep_dir, _ = sweep
    copy = shutil.copytree(sweep_dir, tmp_path / "sweep")
    for name in ("summary.md", "summary.csv", "summary.png"):
        (copy / name).unlink()
    proc = run_cli(str(copy), cwd=tmp_path, script="accutrain-report")
    assert "3 runs, 2 completed, 1 failed" in proc.stdout
    assert "| micro_batch=8 |" in proc.stdout and "- 2 failed: micro_batch=0" in proc.stdout
    original = (sweep_dir / "summary.md").read_text().replace(str(sweep_dir), "DIR")
    assert (copy / "summary.md").read_text().replace(str(copy), "DIR") == original
    assert [r["effective_batch"] for r in read_csv(copy / "summary.csv")] == ["8", "16", ""]
    assert_png(copy / "summary.png")


@pytest.mark.slow
def test_a_crashing_job_is_recorded_as_failed_and_the_sweep_goes_on(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import torch.nn as nn\n"
        "class Good(nn.Module):\n"
        "    def __init__(self, num_classes, in_channels, image_size):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(in_channels * image_size ** 2, num_classes)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x.flatten(1))\n"
        "class Crash(Good):\n"
        "    def forward(self, x):\n"
        "        if self.training:\n"
        "            raise RuntimeError('crashed in training')\n"
        "        return super().forward(x)\n")
    proc = run_cli("-m", *TINY_DATA, *QUICK[len(TINY):], "model=custom",
                   "model._target_=mymodels.Crash,mymodels.Good",
                   "micro_batch=4", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr
    rows = read_csv(tmp_path / "sweep" / "summary.csv")
    assert [r["status"] for r in rows] == ["failed", "completed"]
    assert rows[0]["error"] == "RuntimeError: crashed in training"
    assert rows[1]["steps"] == "3"
    assert "Traceback" in (tmp_path / "sweep" / "0" / "train.log").read_text()  # a bug keeps its traceback

    # a single run: one line naming the model, its error and where (item 7), the traceback in train.log; recorded
    single = tmp_path / "single"
    proc = run_cli(*TINY_DATA, *QUICK[len(TINY):], "model=custom", "model._target_=mymodels.Crash", "micro_batch=4",
                   f"hydra.run.dir={single}", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert_one_line_error(proc, "the model mymodels.Crash raised RuntimeError: crashed in training (mymodels.py:11, "
                                f"in forward); the full traceback is in {single / 'train.log'}")
    assert "Traceback" in (single / "train.log").read_text()
    record = json.loads((single / "status.json").read_text())
    assert (record["state"], record["error"]) == ("failed", "RuntimeError: crashed in training")


@pytest.mark.long  # a pool of processes each importing PyTorch; the basic launcher's sweeps run every time
@pytest.mark.slow
def test_joblib_launcher_runs_jobs_in_parallel_and_writes_the_summary(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    proc = run_cli("-m", *QUICK, "micro_batch=4,8", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert "Joblib.Parallel(n_jobs=2" in proc.stdout + proc.stderr
    rows = read_csv(tmp_path / "sweep" / "summary.csv")
    assert [(r["effective_batch"], r["status"]) for r in rows] == [("4", "completed"), ("8", "completed")]
    pids = {json.loads((tmp_path / "sweep" / job / "status.json").read_text())["pid"] for job in ("0", "1")}
    assert len(pids) == 2  # two worker processes, not one after the other in the launching process
    assert_png(tmp_path / "sweep" / "summary.png")


@pytest.mark.slow
def test_accum_sweep_experiment_takes_the_same_steps_in_every_job(tmp_path):
    """The shipped experiment, shortened: four splits of the global batch 64 end with the same losses."""
    proc = run_cli("-m", "+experiment=accum_sweep", "trainer.epochs=1", "trainer.progress=false",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    rows = read_csv(tmp_path / "sweep" / "summary.csv")
    assert [(r["micro_batch"], r["accum"], r["effective_batch"]) for r in rows] == [
        ("8", "8", "64"), ("16", "4", "64"), ("32", "2", "64"), ("64", "1", "64")]
    assert {r["status"] for r in rows} == {"completed"} and {r["steps"] for r in rows} == {"23"}
    losses = [float(r["final_loss"]) for r in rows]
    assert losses == pytest.approx([losses[0]] * 4, rel=1e-4)
    assert "| micro_batch=64 |" in proc.stdout


@pytest.fixture
def compose_with_hydra(compose):
    return lambda *overrides: compose(*overrides, hydra=True)


def test_every_experiment_composes_and_sweeps_something(compose_with_hydra):
    experiments = sorted(p.stem for p in (config_dir() / "experiment").glob("*.yaml"))
    assert {"accum_sweep", "memory_sweep"} <= set(experiments)
    for name in experiments:
        cfg = compose_with_hydra(f"+experiment={name}")
        assert cfg.hydra.sweeper.params, name
    accum = compose_with_hydra("+experiment=accum_sweep")
    assert accum.global_batch == 64 and accum.model._target_ == "accutrain.models.mlp"
    assert all(64 % int(m) == 0 for m in accum.hydra.sweeper.params.micro_batch.split(","))
    memory = compose_with_hydra("+experiment=memory_sweep")
    assert memory.global_batch == 64 and memory.model.name == "resnet18"
    batch = compose_with_hydra("+experiment=batch_sweep")
    assert batch.scaling.lr.name == "linear" and batch.scaling.base_batch == 32


def test_sweep_summary_callback_is_configured(compose_with_hydra):
    cfg = compose_with_hydra()
    assert cfg.hydra.callbacks.sweep_summary._target_ == "accutrain.cli.sweep_summary.SweepSummary"


def test_launcher_configs_compose(compose_with_hydra):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    joblib = compose_with_hydra("hydra/launcher=joblib", "hydra.launcher.n_jobs=2").hydra.launcher
    assert joblib._target_.endswith("JoblibLauncher") and joblib.n_jobs == 2
    slurm = compose_with_hydra("hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu").hydra.launcher
    assert slurm._target_.endswith("SlurmLauncher") and slurm.partition == "gpu"
    preset = compose_with_hydra("hydra/launcher=slurm_gpu", "hydra.launcher.partition=a100",
                                "hydra.launcher.timeout_min=30").hydra.launcher
    assert preset._target_.endswith("SlurmLauncher")
    assert (preset.partition, preset.gpus_per_node, preset.tasks_per_node, preset.nodes) == ("a100", 1, 1, 1)
    assert preset.timeout_min == 30 and preset.cpus_per_task == 8


@pytest.mark.long  # micro_batch=auto in process, a sweep's resume in test_record, every run
@pytest.mark.slow
def test_a_sweep_with_auto_micro_batch_and_resume(tmp_path):
    """Every job searches (or reuses the sweep's cached) micro-batch; a second sweep resumes each job in place."""
    sweep_dir = tmp_path / "sweep"
    args = [*TINY, "data.size=96", "micro_batch=auto", "global_batch=32", "trainer.memory_budget_mb=1000000",
            "resume=auto", "seed=0,1", f"hydra.sweep.dir={sweep_dir}"]
    first = run_cli("-m", *args, "trainer.max_steps=3", cwd=tmp_path)
    logs = [(sweep_dir / str(job) / "train.log").read_text() for job in (0, 1)]
    assert "micro_batch=auto: trial steps" in logs[0] and "micro_batch=auto: 32, cached in" in logs[1]
    assert (sweep_dir / "micro_batch_auto.json").is_file() and "4 runs" not in first.stdout
    run_cli("-m", *args, "trainer.max_steps=6", cwd=tmp_path)
    for job in (0, 1):
        log = (sweep_dir / str(job) / "train.log").read_text()
        assert "resumed from" in log and "at optimizer step 3" in log
        assert [r["step"] for r in read_metrics(sweep_dir / str(job))[0]] == [1, 2, 3, 4, 5, 6]
    rows = read_csv(sweep_dir / "summary.csv")
    assert [(r["steps"], r["status"]) for r in rows] == [("6", "completed"), ("6", "completed")]
