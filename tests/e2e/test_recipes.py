"""The cluster recipes of the pages (docs/cluster.md's sbatch scripts, SkyPilot task and Kubeflow TrainJob) and
torchrun's one-machine command (docs/devices.md) run as printed on the CPU, with the scheduler simulated:

- an sbatch script runs under bash with the variables SLURM gives a batch script of one node, an `srun` that starts
  SLURM_NTASKS tasks with a step's variables and a `scontrol` that expands node lists and records a requeue. The
  time-limit signal of the script's `#SBATCH --signal` goes to every task mid-run, as SLURM sends it; the script must
  requeue the job, and run again as the requeued job (same id) it must resume from the checkpoint and complete;
- a SkyPilot task's `run` runs with SkyPilot's variables for one node of two processes;
- a TrainJob's command runs with the `PET_*` variables Kubeflow Trainer's torch runtime gives one pod of two.

Every `accutrain` and `torchrun` they start gets small sizes appended (as tests/e2e/test_readme.py appends them), and
the recipes' shared storage, `/checkpoints`, is a temporary folder."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import COMMAND_S, ONE_THREAD, SLOW_MODEL, WAIT_S, cli_command
from docs_blocks import ROOT, all_commands, recipes

from accutrain.runtime.scheduler import PORTS

DATA = ["trainer.progress=false", "data=synthetic", "data.size=64", "data.val_size=16", "data.image_size=8",
        "data.channels=1"]
SHORT = [*DATA, "model=mlp", "model.hidden=[16]", "trainer.max_steps=2"]
# A run slow enough for a signal to land mid-run: a model that sleeps in forward, 6 optimizer steps of 0.4 s or more
# (the recipes' window of 1024 takes the 64 samples whole: 2 micro-batches of 16 per rank).
SLOW = [*DATA, "model=custom", "model._target_=slow.Net", "+model.delay=0.2", "trainer.epochs=6"]
PROCESSES = 2  # per simulated node: SLURM's tasks, SkyPilot's and Kubernetes' GPUs per node

SRUN = '''#!{python}
"""srun in a batch script: SLURM_NTASKS tasks of the command, each with a step's variables; their pids appended to
SIM_TASKS; exits with the highest exit code (128 + the signal for a task a signal ended)."""
import os, subprocess, sys
tasks = int(os.environ["SLURM_NTASKS"])
step = dict(SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS=str(tasks), SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"])
procs = [subprocess.Popen(sys.argv[1:], env={{**os.environ, **step, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}})
         for r in range(tasks)]
with open(os.environ["SIM_TASKS"], "a") as f:
    f.write("".join(f"{{p.pid}}\\n" for p in procs))
codes = [p.wait() for p in procs]
sys.exit(max(128 - c if c < 0 else c for c in codes))
'''
SCONTROL = '''#!{python}
"""scontrol: `show hostnames LIST` (a simulated node list: names separated by commas) and `requeue ID` (recorded in
SIM_REQUEUED)."""
import os, sys
args = sys.argv[1:]
if args[:2] == ["show", "hostnames"] and "[" not in args[2]:
    print("\\n".join(args[2].split(",")))
elif args[:1] == ["requeue"] and len(args) == 2:
    with open(os.environ["SIM_REQUEUED"], "a") as f:
        f.write(args[1] + "\\n")
else:
    sys.exit(f"scontrol (simulated) does not know {{args}}")
'''
# `accutrain` and `torchrun` as the recipes call them, with the test's overrides appended (torchrun passes the
# arguments after its module on to it).
APPEND = '''#!{python}
import json, os, sys
os.execv({real!r}, [{real!r}, *sys.argv[1:], *json.loads(os.environ["SIM_APPEND"])])
'''


def free_port(within: range = range(0, 1)) -> int:
    """A port free now: any, or one in `within`."""
    for port in [0] if within == range(0, 1) else range(within.start + os.getpid() % 997, within.stop, 7):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise AssertionError(f"no free port in {within}")


class Cluster:
    """A work folder (a copy of examples/, the slow model), the simulated commands first on PATH, and the
    environment every recipe runs in."""

    def __init__(self, tmp_path: Path):
        self.work = tmp_path / "work"
        shutil.copytree(ROOT / "examples", self.work / "examples")
        (self.work / "slow.py").write_text(SLOW_MODEL)
        self.storage = tmp_path / "checkpoints"  # the recipes' /checkpoints
        self.tasks, self.requeued = tmp_path / "tasks", tmp_path / "requeued"
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        torchrun = Path(sys.executable).with_name("torchrun")
        for name, text in [("srun", SRUN.format(python=sys.executable)),
                           ("scontrol", SCONTROL.format(python=sys.executable)),
                           ("accutrain", APPEND.format(python=sys.executable, real=cli_command()[0])),
                           ("torchrun", APPEND.format(python=sys.executable, real=str(torchrun)))]:
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                              "MASTER_", "PET_", "SKYPILOT_"))}
        self.env = {**clean, **ONE_THREAD, "PATH": path, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(self.work),
                    "SIM_TASKS": str(self.tasks), "SIM_REQUEUED": str(self.requeued), "SIM_APPEND": json.dumps(SHORT)}

    def text(self, recipe: str) -> str:
        """The recipe with its shared storage here, and its fixed rendezvous port one free now (the port the recipe
        prints is a cluster's; here other tests, and other commands on this machine, may hold it)."""
        return recipe.replace("/checkpoints", str(self.storage)).replace(":29500", f":{free_port()}").replace(
            "--master-port 29500", f"--master-port {free_port()}")

    def start(self, argv: list[str], extra: dict[str, str], append: list[str]) -> subprocess.Popen:
        log = open(self.work.parent / "recipe.log", "a")
        return subprocess.Popen(argv, cwd=self.work, env={**self.env, **extra, "SIM_APPEND": json.dumps(append)},
                                stdout=log, stderr=subprocess.STDOUT, text=True)

    def log(self) -> str:
        return (self.work.parent / "recipe.log").read_text()


def finished(run_dir: Path, cluster: Cluster, state: str = "completed") -> dict:
    """The run's status.json, which must say `state`; the run trained on PROCESSES ranks."""
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == state, (status, cluster.log()[-5000:])
    assert status["plan"]["devices"] == PROCESSES, status
    return status


def wait_for_steps(run_dir: Path, steps: int, proc: subprocess.Popen, cluster: Cluster) -> None:
    deadline = time.monotonic() + WAIT_S  # a loaded 2-core machine starts 2 ranks slowly; the wait ends at the step
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and sum('"loss"' in line for line in metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.01)
    raise AssertionError(f"no step {steps} in {run_dir}:\n{cluster.log()[-5000:]}")


def sbatch_signal(script: str) -> signal.Signals:
    """The signal of `#SBATCH --signal=[B:]NAME@seconds`."""
    name = re.search(r"^#SBATCH --signal=(?:B:)?(\w+)@\d+", script, flags=re.M).group(1)
    return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]


def run_sbatch(cluster: Cluster, script: str) -> None:
    """The script as SLURM runs it on one node of PROCESSES GPUs: the time-limit signal to every task mid-run, the
    requeue the script asks for, then the requeued job (same id), which resumes and completes."""
    path = cluster.work.parent / "job.sh"
    path.write_text(cluster.text(script))
    # the srun tasks' rendezvous port is derived from the job id (accutrain.runtime.scheduler.port_for): one free now
    job = str(free_port(range(*PORTS)) - PORTS[0] + 7 * (PORTS[1] - PORTS[0]))
    tasks = 1 if "torchrun" in script else PROCESSES  # one torchrun per node, or one task per GPU
    batch = dict(SLURM_JOB_ID=job, SLURM_JOBID=job, SLURM_JOB_NODELIST="localhost", SLURM_NNODES="1",
                 SLURM_NTASKS=str(tasks), SLURM_GPUS_ON_NODE=str(PROCESSES), SLURM_PROCID="0",
                 SLURM_RESTART_COUNT="0")
    run_dir = cluster.work / "runs" / job
    proc = cluster.start(["bash", str(path)], batch, SLOW)
    wait_for_steps(run_dir, 2, proc, cluster)
    time.sleep(0.1)
    for pid in map(int, cluster.tasks.read_text().split()):  # SLURM signals the step's tasks
        os.kill(pid, sbatch_signal(script))
    assert proc.wait(timeout=COMMAND_S) is not None
    status = finished(run_dir, cluster, "interrupted")
    stopped = re.match(rf"stopped by {sbatch_signal(script).name} after optimizer step (\d+); checkpoint ",
                       status["error"])
    assert stopped and int(stopped.group(1)) < 6, status  # early, after a checkpoint
    assert cluster.requeued.read_text().split() == [job], cluster.log()[-5000:]

    again = cluster.start(["bash", str(path)], {**batch, "SLURM_RESTART_COUNT": "1"}, SLOW)
    assert again.wait(timeout=COMMAND_S) == 0, cluster.log()[-5000:]
    finished(run_dir, cluster)
    assert f"resumed from {run_dir / 'checkpoints'}" in (run_dir / "train.log").read_text()
    assert cluster.requeued.read_text().split() == [job]  # not again once completed


def run_skypilot(cluster: Cluster, task: str) -> None:
    """`run` on one node of PROCESSES GPUs, in the synced workdir; `setup` must install accutrain from it."""
    spec = yaml.safe_load(cluster.text(task))
    assert spec["workdir"] == "." and spec["setup"] == "pip install .", spec  # test_packaging builds it from there
    sky = dict(SKYPILOT_NODE_IPS="127.0.0.1", SKYPILOT_NUM_NODES="1", SKYPILOT_NODE_RANK="0",
               SKYPILOT_NUM_GPUS_PER_NODE=str(PROCESSES))
    assert cluster.start(["bash", "-c", spec["run"]], sky, SHORT).wait(timeout=COMMAND_S) == 0, cluster.log()[-5000:]
    finished(Path(re.search(r"hydra\.run\.dir=(\S+)", spec["run"]).group(1)), cluster)


def run_trainjob(cluster: Cluster, job: str) -> None:
    """The trainer's command in one pod, with the PET_* variables the torch-distributed runtime sets."""
    spec = yaml.safe_load(cluster.text(job))
    trainer = spec["spec"]["trainer"]
    built = next(c for c in all_commands() if c[0].startswith("docker build"))[0]
    assert f"-t {trainer['image']} " in built, (trainer["image"], built)  # the image the page builds
    pet = dict(PET_NNODES="1", PET_NPROC_PER_NODE=str(PROCESSES), PET_NODE_RANK="0", PET_MASTER_ADDR="127.0.0.1",
               PET_MASTER_PORT=str(free_port()))
    command = [str(word) for word in trainer["command"]]
    assert cluster.start(command, pet, SHORT).wait(timeout=COMMAND_S) == 0, cluster.log()[-5000:]
    finished(Path(next(w for w in command if w.startswith("hydra.run.dir=")).split("=", 1)[1]), cluster)


RUN = {"sbatch": run_sbatch, "skypilot": run_skypilot, "trainjob": run_trainjob}
RECIPES = recipes()


def test_the_pages_have_the_recipes_the_issue_names():
    kinds = [kind for _, kind, _ in RECIPES]
    assert kinds.count("sbatch") == 2 and kinds.count("skypilot") == 1 and kinds.count("trainjob") == 1, kinds
    torchrun = [body for _, kind, body in RECIPES if "torchrun" in body]
    assert len(torchrun) == 3 and all("devices=" not in body for body in torchrun)  # the world is the devices


@pytest.mark.slow
@pytest.mark.xdist_group("recipes")  # one at a time: the recipes' rendezvous port 29500 is fixed
@pytest.mark.parametrize("page, kind, recipe", RECIPES,
                         ids=[f"{kind}-{i}" for i, (_, kind, _) in enumerate(RECIPES)])
def test_a_cluster_recipe_runs_as_printed(tmp_path, page, kind, recipe):
    RUN[kind](Cluster(tmp_path), recipe)


@pytest.mark.slow
@pytest.mark.xdist_group("recipes")
def test_torchrun_on_one_machine_trains_on_two_ranks_without_devices(tmp_path):
    """docs/devices.md's `torchrun --standalone --nproc_per_node=2 -m accutrain debug=fast`: `devices` left at its
    default means torchrun's two processes."""
    command = next(c for c, _, _ in all_commands() if c.startswith("torchrun --standalone"))
    assert command == "torchrun --standalone --nproc_per_node=2 -m accutrain debug=fast"
    cluster = Cluster(tmp_path)
    proc = cluster.start([*command.split(), "hydra.run.dir=run"], {}, [])
    assert proc.wait(timeout=COMMAND_S) == 0, cluster.log()[-5000:]
    assert "effective batch 64 = micro_batch 32 × accum 1 × devices 2" in cluster.log()
    assert "launching" not in cluster.log()  # torchrun's world: accutrain spawned nothing
    finished(cluster.work / "run", cluster)
    assert len([line for line in (cluster.work / "run" / "metrics.jsonl").read_text().splitlines()
                if '"loss"' in line]) == 10  # written once, by rank 0
