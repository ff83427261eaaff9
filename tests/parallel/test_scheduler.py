"""The world a scheduler started: SLURM's srun tasks (and a submitit job's) form one world from the scheduler's
variables alone, exactly as torchrun's; wrong combinations are one line."""
import json
import os
import signal
import socket
import subprocess

import pytest
import torch
from conftest import (
    COMMAND_S,
    ONE_THREAD,
    RUN,
    TINY,
    WAIT_S,
    assert_identical,
    assert_one_line_error,
    assert_same_weights,
    cli_command,
    final_weights,
    read_metrics,
    train_here,
    wait_for_steps,
)

from accutrain import dist
from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.runtime.scheduler import PORTS, adopt_scheduler_world, first_host, slurm_world

UNEVEN = [*TINY, "data.size=117", "trainer.epochs=1", "trainer.grad_clip=0.5", "optim.weight_decay=1e-3"]


def step_env(rank: int, tasks: int = 2, job: str = "4242", **more: str) -> dict:
    """What srun gives task `rank` of a step of `tasks` tasks on this host."""
    return {**dict(SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS=str(tasks), SLURM_NTASKS=str(tasks),
                   SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_STEP_NODELIST="localhost",
                   SLURM_JOB_NODELIST="localhost"), **more}


# SLURM's node lists (scontrol show hostnames expands them): hosts separated by commas outside brackets, bracket
# groups of zero-padded numbers and ranges, anywhere in a name and several in one name.
NODE_LISTS = [
    ("gpu[07-09,12],cpu3", "gpu07"), ("n[001-004]-ib", "n001-ib"), ("a[1-2]b[3-4]", "a1b3"), ("node1,node2", "node1"),
    ("a-b-[3-4]", "a-b-3"), ("single", "single"), ("n[5]", "n5"), ("rack[2,4-5]-gpu[010-012]", "rack2-gpu010"),
    ("x[09-10]y,z[1-2]", "x09y"), ("node-001.cluster", "node-001.cluster"), (" c[3-4] ", "c3"),
]


@pytest.mark.parametrize("nodelist, host", NODE_LISTS)
def test_the_first_host_of_a_node_list(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "n[1-", "a]b", ",x", "n[a-b]", "n[1-2]]"])
def test_a_node_list_that_cannot_be_read_is_one_line(nodelist):
    with pytest.raises(UserError, match="cannot read the node list"):
        first_host(nodelist)


def test_an_srun_task_becomes_a_rank_of_torchruns_world():
    env = step_env(1, tasks=16, job="123456", SLURM_LOCALID="1", SLURM_STEP_NODELIST="gpu[01-02]")
    assert adopt_scheduler_world(env) == "SLURM"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("1", "16", "1", "gpu01")
    assert env["MASTER_PORT"] == str(PORTS[0] + 123456 % (PORTS[1] - PORTS[0]))
    assert adopt_scheduler_world(env) is None  # torchrun's variables (now set) win


def test_torchrun_inside_an_allocation_wins_and_a_batch_script_is_not_a_task():
    torchrun = {**step_env(0), "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}
    assert adopt_scheduler_world(torchrun) is None and torchrun["RANK"] == "3"
    batch = {k: v for k, v in step_env(0, tasks=8).items() if not k.startswith("SLURM_STEP")}  # sbatch's script
    assert adopt_scheduler_world(batch) is None and "RANK" not in batch
    assert slurm_world(step_env(0, tasks=1)) is None  # one task: a single run as today
    given = step_env(0, MASTER_ADDR="10.0.0.1", MASTER_PORT="29400")
    assert adopt_scheduler_world(given) == "SLURM" and (given["MASTER_ADDR"], given["MASTER_PORT"]) == \
        ("10.0.0.1", "29400")


def test_a_step_without_a_node_list_is_one_line():
    env = {k: v for k, v in step_env(0).items() if "NODELIST" not in k}
    with pytest.raises(UserError, match="SLURM started 2 tasks but gave no node list"):
        adopt_scheduler_world(env)


def test_a_process_bound_to_its_own_gpu_takes_it_whatever_its_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # srun --gpus-per-task=1: task 1 sees its GPU only
    assert dist.worker_device(torch.device("cuda"), World(1, 2, 1)) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(UserError, match="LOCAL_RANK=2 but this process sees 2 CUDA device"):
        dist.worker_device(torch.device("cuda"), World(2, 4, 2))


def free_port_job_id() -> str:
    """A job id whose derived port is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if not PORTS[0] <= port < PORTS[1]:
        port = PORTS[0] + port % (PORTS[1] - PORTS[0])
    return str(port - PORTS[0] + 7 * (PORTS[1] - PORTS[0]))


def srun(tmp_path, tasks: int, *args: str) -> list[subprocess.Popen]:
    """`srun -n tasks accutrain args` simulated: one accutrain process per task, each with its SLURM variables."""
    job = free_port_job_id()
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT")}
    return [subprocess.Popen([*cli_command(), *args], cwd=tmp_path, env={**base, **ONE_THREAD, **step_env(r, tasks,
                             job)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(tasks)]


@pytest.mark.slow
def test_srun_tasks_form_one_world_equal_to_one_device(tmp_path):
    args = [*UNEVEN, "micro_batch=8", "accum=2"]
    tasks = srun(tmp_path, 2, *args, f"hydra.run.dir={tmp_path / 'slurm'}")
    outputs = [t.communicate(timeout=COMMAND_S) for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outputs
    assert "accum 2 × devices 2" in outputs[0][1] and "launching" not in outputs[0][1]  # SLURM's world, not spawned
    one, _ = train_here(tmp_path, "one", *UNEVEN, "micro_batch=8", "accum=4")
    assert_same_weights(final_weights(tmp_path / "slurm"), final_weights(one))
    assert len(read_metrics(tmp_path / "slurm")[0]) == 4  # written once, by rank 0
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("args, fragment", [
    (["devices=3"], "devices=3 but SLURM (srun) started 2 processes"),
    (["micro_batch=8", "global_batch=24"], "global_batch=24 is not a multiple of micro_batch 8 × devices 2"),
])
def test_a_world_that_contradicts_the_config_is_one_line(tmp_path, args, fragment):
    task = srun(tmp_path, 2, *TINY, *args, f"hydra.run.dir={tmp_path / 'run'}")
    task[1].kill()  # rank 0 refuses before it waits for anyone
    out, err = task[0].communicate(timeout=WAIT_S)
    assert_one_line_error(subprocess.CompletedProcess([], task[0].returncode, out, err), fragment)
    assert not (tmp_path / "run" / "checkpoints").exists()
    task[1].wait()


@pytest.mark.slow
def test_a_submitit_job_of_two_tasks_is_one_world(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    args = [*UNEVEN, "micro_batch=8", "accum=2"]
    sweep = tmp_path / "sweep"
    env = {**os.environ, **ONE_THREAD}
    proc = subprocess.run([*cli_command(), "-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
                           "hydra.launcher.timeout_min=10", *args, "seed=0", f"hydra.sweep.dir={sweep}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=COMMAND_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (sweep / "0" / "train.log").read_text()
    assert "accum 2 × devices 2" in log, log
    one, _ = train_here(tmp_path, "one", *UNEVEN, "micro_batch=8", "accum=4")
    assert_same_weights(final_weights(sweep / "0"), final_weights(one))


def task_pids(job_id: str) -> dict[int, int]:
    """{global rank: pid} of the tasks of submitit's local job `job_id` (from their environment)."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
        except (OSError, ValueError):
            continue
        env = dict(item.decode(errors="replace").partition("=")[::2] for item in environ if b"=" in item)
        if env.get("SUBMITIT_LOCAL_JOB_ID") == job_id and "SUBMITIT_LOCAL_GLOBALID" in env:
            found[int(env["SUBMITIT_LOCAL_GLOBALID"])] = int(entry)
    return found


@pytest.mark.slow
def test_a_preempted_two_task_job_is_requeued_once_and_ends_with_the_uninterrupted_weights(slow):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    tmp_path = slow  # slow.py is there, importable by the tasks too
    args = [*RUN, "trainer.eval_every=1000", "micro_batch=8", "accum=2"]
    sweep, job = tmp_path / "sweep", tmp_path / "sweep" / "0"
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **ONE_THREAD}
    log = open(tmp_path / "sweep.log", "w")
    proc = subprocess.Popen([*cli_command(), "-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
                             "hydra.launcher.timeout_min=10", *args, "+model.delay=0.03", "seed=0",
                             f"hydra.sweep.dir={sweep}"], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env)
    wait_for_steps(job, 4, proc)
    job_id = next(p.name.split("_")[0] for p in (sweep / ".submitit").iterdir() if p.name[0].isdigit())
    pids = task_pids(job_id)
    assert sorted(pids) == [0, 1], pids
    for pid in pids.values():  # SLURM signals every task of the job before its time limit
        os.kill(pid, signal.SIGUSR2)
    assert proc.wait(timeout=COMMAND_S) == 0, (tmp_path / "sweep.log").read_text()
    train_log = (job / "train.log").read_text()
    assert train_log.count("submitit requeues this job") == 1, train_log
    assert "requeued after a preemption: resuming" in train_log
    assert json.loads((job / "status.json").read_text())["state"] == "completed"
    uninterrupted, _ = train_here(tmp_path, "uninterrupted", *args, "seed=0", "devices=2")  # dropout: same split
    assert_identical(final_weights(job), final_weights(uninterrupted))
