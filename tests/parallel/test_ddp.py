"""Several devices, for real: 2 gloo processes on the CPU, through the real CLI (spawned and under torchrun)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    COMMAND_S,
    ONE_THREAD,
    RUN,
    TINY,
    TINY_DATA,
    WAIT_S,
    assert_one_line_error,
    assert_one_line_user_error,
    assert_same_weights,
    cli_command,
    final_weights,
    read_metrics,
    run_cli,
    start,
    train_here,
    train_run,
    wait_for_steps,
)

from accutrain.errors import UserError

# 117 samples = 3 windows of 32 + one of 21. With devices=2 micro_batch=8 the 21 are cut 8|8 then 5|0: in the
# last micro-step rank 0 has 5 samples and rank 1 none, and the all-reduce must neither hang nor be biased.
UNEVEN = [*TINY, "data.size=117", "trainer.epochs=3", "trainer.grad_clip=0.5", "optim.weight_decay=1e-3"]

pytestmark = pytest.mark.slow


@pytest.mark.quick  # the quick tier's several devices
def test_two_ranks_equal_one_device_and_the_big_batch(tmp_path):
    two, _ = train_here(tmp_path, "two", *UNEVEN, "devices=2", "micro_batch=8", "accum=2")
    one, _ = train_here(tmp_path, "one", *UNEVEN, "micro_batch=8", "accum=4")
    big, _ = train_here(tmp_path, "big", *UNEVEN, "micro_batch=32", "accum=1")
    assert_same_weights(final_weights(two), final_weights(big))
    assert_same_weights(final_weights(one), final_weights(big))
    steps = read_metrics(two)[0]  # rank 0 alone writes: one record per optimizer step
    assert [r["samples"] for r in steps] == [32, 32, 32, 21] * 3
    assert [r["micro_batches"] for r in steps] == [2] * 12  # micro-steps per rank
    big_steps = read_metrics(big)[0]
    assert [r["loss"] for r in steps] == pytest.approx([r["loss"] for r in big_steps], rel=1e-5)
    assert read_metrics(two)[1][-1]["val_acc"] == pytest.approx(read_metrics(big)[1][-1]["val_acc"])


@pytest.mark.parametrize("accum", [1, 4])
def test_one_gradient_all_reduce_per_optimizer_step(tmp_path, accum):
    run_dir, _ = train_here(tmp_path, f"accum{accum}", *UNEVEN, "devices=2", "micro_batch=4", f"accum={accum}",
                            "trainer.epochs=1")
    steps = read_metrics(run_dir)[0]
    param_bytes = sum(t.numel() * t.element_size() for t in final_weights(run_dir).values())
    assert [r["grad_syncs"] for r in steps] == [1] * len(steps)
    assert [r["comm_bytes"] for r in steps] == [param_bytes] * len(steps)  # one gradient's worth, whatever accum


def test_a_failing_rank_ends_every_rank_with_its_error(tmp_path):
    (tmp_path / "boom.py").write_text(
        "import torch.distributed as dist\nimport torch.nn as nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, num_classes, in_channels, image_size):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(in_channels * image_size ** 2, num_classes)\n"
        "        self.calls = 0\n"
        "    def forward(self, x):\n"
        "        if self.training and dist.is_initialized() and dist.get_rank() == 1:\n"
        "            self.calls += 1\n"
        "            if self.calls == 3:\n"
        "                raise RuntimeError('boom on rank 1')\n"
        "        return self.fc(x.flatten(1))\n")
    _, proc = train_run(tmp_path, "boom", *TINY_DATA, "model=custom", "model._target_=boom.Net", "devices=2",
                        "micro_batch=4", "accum=2", check=False)
    assert proc.returncode == 2  # a plug-in's error: as on one device (runtime.rank_errors)
    assert_one_line_error(proc, "rank 1 of 2: the model boom.Net raised RuntimeError: boom on rank 1 (boom.py:12, in "
                          "forward)")
    # rank 0, waiting in the all-reduce, was stopped: no hang (which train_run's timeout would end)


def test_a_user_error_on_the_ranks_is_one_line(tmp_path):
    _, proc = train_run(tmp_path, "err", "model=mlp", "data=imagefolder", "data.root=/nonexistent/images",
                        "devices=2", check=False)
    assert proc.returncode == 2
    assert_one_line_error(proc, "/nonexistent/images")


def test_devices_auto_is_one_process_on_a_cpu_machine(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _, log = train_here(tmp_path, "auto", *TINY, "data.size=40", "devices=auto", "trainer.max_steps=1")
    assert "× devices 1" in log and "launching" not in log


def test_sync_batchnorm_on_the_cpu_is_refused_plainly(tmp_path):
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "sbn", "debug=fast", "model=resnet18", "data.size=40", "devices=2",
                   "batchnorm.sync=true", "trainer.max_steps=1")
    assert_one_line_user_error(info.value, "batchnorm.sync=true needs CUDA")


@pytest.mark.long  # a sweep's jobs and devices=2 each run every time
def test_multirun_jobs_launch_their_own_workers(tmp_path):
    """A sweep over devices at a fixed global batch: every job takes the same steps."""
    run_cli("-m", *UNEVEN, "trainer.epochs=1", "devices=1,2", "micro_batch=8", "global_batch=32",
            f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    jobs = [tmp_path / "sweep" / "0", tmp_path / "sweep" / "1"]
    assert "accum 4 × devices 1" in (jobs[0] / "train.log").read_text()
    assert "accum 2 × devices 2" in (jobs[1] / "train.log").read_text()
    assert_same_weights(final_weights(jobs[0]), final_weights(jobs[1]))


@pytest.mark.long  # torchrun's world trains on 2 ranks in test_recipes, every run; this one compares its weights
def test_torchrun_world_equals_the_spawned_one(tmp_path):
    args = [*UNEVEN, "trainer.epochs=1", "micro_batch=8", "accum=2"]
    spawned, _ = train_here(tmp_path, "spawned", *args, "devices=2")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "accutrain", *args, f"hydra.run.dir={tmp_path / 'torchrun'}"],  # devices: the default
                          cwd=tmp_path, capture_output=True, text=True, timeout=COMMAND_S)
    assert proc.returncode == 0, proc.stderr
    assert "× devices 2" in proc.stderr and "launching" not in proc.stderr  # the world came from torchrun
    assert_same_weights(final_weights(tmp_path / "torchrun"), final_weights(spawned))
    assert len(read_metrics(tmp_path / "torchrun")[0]) == 4  # written once, by rank 0
    assert not (tmp_path / "outputs").exists()


def test_torchrun_with_devices_disagreeing_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "accutrain", *TINY, "data.size=40", "devices=3",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=COMMAND_S)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if "devices=3 but torchrun started 2 processes" in line]
    # once per rank that gets to say it: torchrun stops the other rank when one fails first (on a busy machine,
    # before that one's line)
    ranks = [line.startswith("[rank 1]") for line in ours]
    assert ours and len(ranks) == len(set(ranks)), proc.stderr
    assert "accutrain/" not in proc.stderr  # no traceback through accutrain (torchrun prints its own report)


def rank_environment(world, key: str) -> tuple[int, str, str]:
    """A worker's view: (its rank, the variable `key`, its RANK variable)."""
    import os

    return world.rank, os.environ.get(key, ""), os.environ["RANK"]


def test_workers_start_from_the_fork_server_with_the_environment_of_the_moment(monkeypatch):
    """Workers fork from a server that imported accutrain once; each still sees the environment its parent had
    when it started them (as a spawned one would), not the server's from when it started."""
    import multiprocessing

    from accutrain.runtime.workers import spawn, start_method

    if "forkserver" in multiprocessing.get_all_start_methods():
        assert start_method() == "forkserver"
    monkeypatch.setenv("ACCUTRAIN_TEST_PROBE", "first")
    assert spawn(2, rank_environment, ("ACCUTRAIN_TEST_PROBE",), None) == (0, "first", "0")
    monkeypatch.setenv("ACCUTRAIN_TEST_PROBE", "second")  # the server is running now
    assert spawn(2, rank_environment, ("ACCUTRAIN_TEST_PROBE",), None) == (0, "second", "0")


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (Linux: /proc/<pid>/task/*/children)."""
    found: set[int] = set()
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids = {int(c) for c in children.read_text().split()}
        except OSError:
            continue
        for kid in kids:
            found |= {kid} | descendants(kid)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the workers' parent-death signal is Linux's")
def test_a_command_killed_outright_leaves_no_rank_training(tmp_path):
    """SIGKILL the command mid-run: its ranks die with it (they would go on training, writing the run directory
    and holding their devices), so metrics.jsonl stops growing."""
    proc = start(tmp_path, "run", *TINY, "devices=2", "micro_batch=4", "accum=2", "trainer.epochs=100000")
    wait_for_steps(tmp_path / "run", 3, proc)
    below = descendants(proc.pid)
    assert len(below) >= 2, below  # the fork server and the ranks (at least the ranks)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and any(alive(p) for p in below):
        time.sleep(0.1)
    assert not [p for p in below if alive(p)], "ranks outlived the command"
    metrics = tmp_path / "run" / "metrics.jsonl"
    size = metrics.stat().st_size
    time.sleep(1.0)
    assert metrics.stat().st_size == size


def children(pid: int) -> set[int]:
    found: set[int] = set()
    for listing in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found |= {int(c) for c in listing.read_text().split()}
        except OSError:
            continue
    return found


def holds_open(pid: int, path: Path) -> bool:
    try:
        return any(Path(os.readlink(fd)) == path for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finding the ranks through /proc")
def test_a_rank_killed_outright_ends_the_run_in_one_line_naming_it(tmp_path):
    """Issue 32: kill -9 of one worker. Every rank stops at once (the others SIGKILLed, not sent the SIGTERM that
    they took for a stop request: "checkpointing" announced, none written) and the command says which rank died and
    where resume=auto continues, in one line, without Hydra's traceback; status.json says failed."""
    run_dir = tmp_path / "run"
    proc = start(tmp_path, "run", *TINY, "devices=2", "micro_batch=4", "accum=2", "trainer.epochs=100000",
                 "trainer.checkpoint_every=2")
    wait_for_steps(run_dir, 3, proc)
    ranks = [rank for child in children(proc.pid) for rank in children(child)]  # the fork server's children
    others = [rank for rank in ranks if not holds_open(rank, run_dir / "metrics.jsonl")]  # rank 0 writes it
    assert len(ranks) == 2 and len(others) == 1, ranks
    os.kill(others[0], signal.SIGKILL)
    assert proc.wait(timeout=WAIT_S) == 1
    output = (tmp_path / "run.log").read_text()
    assert "Traceback" not in output and "then checkpointing" not in output and "leaked" not in output, output
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1 and "rank 1 of 2 was killed by SIGKILL" in errors[0], output
    assert "resume=auto continues from its newest checkpoint" in errors[0]
    record = json.loads((run_dir / "status.json").read_text())
    assert record["state"] == "failed" and "rank 1 of 2 was killed by SIGKILL" in record["error"]


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_once_after_a_checkpoint(slow):
    """Ctrl-C in a terminal signals every process of the command's group. The ranks have a session of their own, as
    torchrun's do: the command passes the signal on once, so the ranks stop together after the step and checkpoint —
    none takes the terminal's copy for a second Ctrl-C and leaves the others in a collective (a traceback)."""
    tmp_path = slow
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen([*cli_command(), *RUN, "+model.delay=0.05", "devices=2",
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **ONE_THREAD})
    wait_for_steps(tmp_path / "run", 2, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the command, its fork server, not the ranks
    assert proc.wait(timeout=WAIT_S) == 128 + signal.SIGINT
    output = (tmp_path / "run.log").read_text()
    assert "Traceback" not in output and "stopped by SIGINT after optimizer step" in output, output
    assert json.loads((tmp_path / "run" / "status.json").read_text())["state"] == "interrupted"


FAILING_LOSS = """
import os

def loss(output, target):
    if os.environ.get("EXIT_CODE"):
        os._exit(int(os.environ["EXIT_CODE"]))
    raise ValueError("no loss for this batch")
"""


@pytest.mark.parametrize("how", ["raises", "exits"])
def test_a_plugin_that_fails_on_two_ranks_is_one_line_with_one_devices_exit_code(tmp_path, how):
    """Issue 52: a custom loss raising ValueError was 66 lines and exit 1 with devices=2 (one device: one line, exit
    2); a rank's os._exit(7) a traceback ending `rank 1 of 2 died (exit code 7)` (one device: exit 7)."""
    (tmp_path / "mine.py").write_text(FAILING_LOSS)
    env = {"EXIT_CODE": "7"} if how == "exits" else {}
    args = [*TINY, "loss=custom", "loss._target_=mine.loss", "trainer.max_steps=2"]
    one = run_cli(*args, f"hydra.run.dir={tmp_path / 'one'}", cwd=tmp_path, check=False, env=env)
    two = run_cli(*args, "devices=2", f"hydra.run.dir={tmp_path / 'two'}", cwd=tmp_path, check=False, env=env)
    assert two.returncode == one.returncode == (7 if how == "exits" else 2), two.stderr
    assert "Traceback" not in two.stdout + two.stderr
    if how == "raises":
        assert_one_line_error(two, "of 2: the loss mine.loss raised ValueError: no loss for this batch (mine.py:7, "
                                   "in loss); the full traceback is in train.log")
        assert one.stderr.count("error:") == 1 and "the loss mine.loss raised ValueError" in one.stderr
    else:
        assert_one_line_error(two, "of 2 exited with code 7 (os._exit or sys.exit in the code it ran): every rank "
                                   "stopped")
