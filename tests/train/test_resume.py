"""Never lose a run: exact resume after SIGKILL/SIGTERM, safe loading, the non-finite policies, bad input."""
import json
import os
import random
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    COMMAND_S,
    NAN_DATA,
    ONE_THREAD,
    RUN,
    TINY,
    TINY_DATA,
    WAIT_S,
    assert_identical,
    assert_one_line_error,
    assert_one_line_user_error,
    cli_command,
    final_weights,
    read_metrics,
    rewind,
    run_cli,
    start,
    train_here,
    train_run,
    wait_for_steps,
)

from accutrain.errors import UserError
from accutrain.store import files
from accutrain.train.resume import keep_metrics_until


@pytest.mark.slow
@pytest.mark.parametrize("how", [pytest.param("SIGKILL", marks=pytest.mark.quick),
                                 pytest.param("SIGTERM", marks=pytest.mark.long)])
def test_killed_and_resumed_run_ends_bit_identical(slow, how):
    reference, _ = train_here(slow, "reference", *RUN)
    kill_after = random.Random().randint(2, 10)  # step k is logged after checkpoint k-1 is on disk
    proc = start(slow, "killed", *RUN, "+model.delay=0.02")
    wait_for_steps(slow / "killed", kill_after, proc)
    proc.send_signal(getattr(signal, how))
    code = proc.wait(timeout=WAIT_S)
    log = (slow / "killed.log").read_text()
    if how == "SIGTERM":  # finished the step, checkpointed, said how to resume, exited non-zero
        assert code == 128 + signal.SIGTERM, log
        assert "Resume with the same command plus: resume=auto" in log
    else:
        assert code == -signal.SIGKILL
    resumed, proc_out = train_run(slow, "killed", *RUN, "resume=auto")
    assert "resumed from" in proc_out.stderr
    assert_identical(final_weights(resumed), final_weights(reference))
    steps = read_metrics(resumed)[0]
    assert [r["step"] for r in steps] == list(range(1, 13))  # what the killed run logged after its checkpoint is gone
    assert [r["loss"] for r in steps] == [r["loss"] for r in read_metrics(reference)[0]]


@pytest.mark.long  # a kill timed to land in a write: minutes of polling on a loaded machine
@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one(tmp_path):
    big = [*TINY_DATA, "model.hidden=[1024,1024]", "data.image_size=16", "data.size=130",
           "trainer.epochs=2", "micro_batch=16", "accum=2", "trainer.checkpoint_every=1"]
    reference, _ = train_here(tmp_path, "reference", *big)
    proc = start(tmp_path, "killed", *big)
    ckpts, caught = tmp_path / "killed" / "checkpoints", False
    deadline = time.monotonic() + WAIT_S
    while proc.poll() is None and time.monotonic() < deadline:
        if ckpts.is_dir() and any(p.name.endswith(".tmp") for p in ckpts.iterdir()) and len(os.listdir(ckpts)) > 2:
            proc.kill()  # a checkpoint is being written right now
            caught = True
            break
    proc.wait(timeout=WAIT_S)
    assert caught, "the run ended before a checkpoint write could be interrupted"
    assert any(p.name.endswith(".tmp") for p in ckpts.iterdir())  # the half-written file is there, and ignored
    resumed, _ = train_run(tmp_path, "killed", *big, "resume=auto")
    assert_identical(final_weights(resumed), final_weights(reference))


@pytest.mark.slow
def test_sigterm_stops_every_rank_at_the_same_step_and_resumes_exactly(slow):
    args = [*RUN, "devices=2", "accum=2"]
    reference, _ = train_here(slow, "reference", *args)
    proc = start(slow, "killed", *args, "+model.delay=0.02")
    wait_for_steps(slow / "killed", 4, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=WAIT_S) == 128 + signal.SIGTERM
    resumed, _ = train_run(slow, "killed", *args, "resume=auto")
    assert_identical(final_weights(resumed), final_weights(reference))


@pytest.mark.slow
def test_sigterm_during_a_sweep_writes_the_summary_and_gives_the_sweeps_resume_command(slow):
    """Item 9: the jobs that ran are summarised; the printed command resumes the whole sweep: the finished job has
    nothing left to do, the interrupted one continues from its checkpoint, the one that never started starts."""
    sweep = slow / "sweep"
    args = ["-m", *TINY_DATA, "model=custom", "model._target_=slow.Net", "data.size=64", "micro_batch=8",
            "trainer.max_steps=5", "trainer.checkpoint_every=1", "+model.delay=0.1", "seed=0,1,2",
            f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **ONE_THREAD}
    proc = subprocess.Popen([*cli_command(), *args], cwd=slow, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    wait_for_steps(sweep / "1", 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "sweep: 2 runs, 1 completed, 1 interrupted" in out and (sweep / "summary.md").is_file()
    assert "stopped by SIGTERM during job 1" in err and "hydra.run.dir" not in err
    command = err.split("Resume the sweep with:\n", 1)[1].splitlines()[0].strip()
    assert command.startswith("accutrain -m ") and command.endswith(f"hydra.sweep.dir={sweep} resume=auto")
    resumed = subprocess.run([*cli_command(), *shlex.split(command)[1:]], cwd=slow, capture_output=True, text=True,
                             env=env, timeout=COMMAND_S)
    assert resumed.returncode == 0, resumed.stderr
    assert "sweep: 3 runs, 3 completed" in resumed.stdout
    assert "nothing left to train" in (sweep / "0" / "train.log").read_text()
    assert "resumed from" in (sweep / "1" / "train.log").read_text()
    for job in ("0", "1", "2"):
        assert [r["step"] for r in read_metrics(sweep / job)[0]] == [1, 2, 3, 4, 5]


def test_resume_auto_falls_back_past_a_corrupt_checkpoint(slow):
    run, _ = train_here(slow, "run", *RUN, "trainer.keep_checkpoints=20")
    uninterrupted = final_weights(run)  # how the run ended before it was made to look killed
    ckpts = rewind(run, 5)
    bad = ckpts / "step-00000006.pt"  # a newer file cut short: the run must not trust it
    good = ckpts / "step-00000005.pt"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    resumed, log = train_here(slow, "run", *RUN, "resume=auto")
    assert "step-00000006.pt is truncated or corrupt" in log
    assert "falling back to the previous checkpoint (step-00000005.pt)" in log
    assert "resumed from" in log and "at optimizer step 5" in log
    assert_identical(final_weights(resumed), uninterrupted)


def test_resume_with_a_loader_worker_after_an_evaluation_is_bit_identical(slow):
    """With persistent workers the held-out loader makes its iterator once per process: at the first evaluation of
    the uninterrupted run (step 4) but at the first one after the resume (step 8) of a run resumed at step 5. That
    iterator's worker seed must come from a generator of its own, not from the global RNG that dropout draws from."""
    args = [*RUN, "loader.num_workers=1"]
    run, _ = train_here(slow, "run", *args, "trainer.keep_checkpoints=20")
    uninterrupted, losses = final_weights(run), [r["loss"] for r in read_metrics(run)[0]]
    rewind(run, 5)  # after the evaluation at the end of epoch 1, before the one of epoch 2
    resumed, log = train_here(slow, "run", *args, "resume=auto")
    assert "at optimizer step 5" in log
    assert_identical(final_weights(resumed), uninterrupted)
    assert [r["loss"] for r in read_metrics(resumed)[0]] == losses


def test_resume_with_another_split_of_the_same_effective_batch(slow):
    run, _ = train_here(slow, "run", *RUN, "trainer.keep_checkpoints=20")
    uninterrupted = final_weights(run)
    rewind(run, 5)
    resumed, log = train_here(slow, "run", *RUN, "micro_batch=4", "accum=8", "resume=auto")
    assert "resuming with micro_batch 4 × accum 8 × devices 1 (the checkpoint's run used 8 × 4 × 1)" in log
    for key, value in uninterrupted.items():  # same windows; only the float summation order differs
        torch.testing.assert_close(final_weights(resumed)[key], value, rtol=1e-5, atol=1e-6)


def test_resume_auto_without_a_checkpoint_starts_from_scratch(tmp_path):
    _, log = train_here(tmp_path, "fresh", *TINY, "data.size=40", "trainer.max_steps=2", "resume=auto")
    assert "no checkpoint" in log and "starting from scratch" in log


def test_checkpoints_rotate_and_last_is_the_newest(tmp_path):
    run_dir, _ = train_here(tmp_path, "run", *TINY, "data.size=64", "micro_batch=8", "trainer.max_steps=7",
                            "trainer.checkpoint_every=2", "trainer.keep_checkpoints=2")
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.startswith("best-"))
    # best.pt is never rotated; the names of the step files (epoch<E>-step<S>.pt) go with them
    assert names == ["best.pt", "epoch1-step6.pt", "epoch1-step7.pt", "last.pt", "step-00000006.pt",
                     "step-00000007.pt"]
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert last["step"] == 7 and last["progress"]["step"] == 7
    assert {"model", "optimizer", "scheduler", "rng", "progress", "plan", "config"} <= last.keys()


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {Path(os.environ['EXPLOIT_MARKER'])}",))


def refused(tmp_path, *args) -> UserError:
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "refused", *args)
    return info.value


def test_a_checkpoint_carrying_pickled_code_is_refused_not_run(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("EXPLOIT_MARKER", str(marker))
    evil = tmp_path / "evil.pt"
    torch.save({"format": 1, "model": {}, "payload": Exploit()}, evil)
    assert_one_line_user_error(refused(tmp_path, *TINY, "data.size=40", f"resume={evil}"), "refusing to load",
                               "evil.pt")
    assert not marker.exists()


def test_truncated_checkpoint_is_one_line(tmp_path):
    run_dir, _ = train_here(tmp_path, "run", *TINY, "data.size=40", "trainer.max_steps=2")
    last = run_dir / "checkpoints" / "last.pt"
    cut = tmp_path / "cut.pt"
    cut.write_bytes(last.read_bytes()[:1000])
    assert_one_line_user_error(refused(tmp_path, *TINY, "data.size=40", f"resume={cut}"),
                               "cut.pt is truncated or corrupt")


def test_checkpoint_from_another_model_or_batch_is_refused(tmp_path):
    run_dir, _ = train_here(tmp_path, "run", *TINY, "data.size=40", "trainer.max_steps=2")
    # items 7 and 8: another optimizer (KeyError 'step' when loaded) and another seed (another data order)
    assert_one_line_user_error(refused(tmp_path, *TINY, "data.size=40", "optim=adamw", f"resume={run_dir}"),
                               "was trained with the optimizer accutrain.models.optim.sgd; this run uses "
                               "accutrain.models.optim.adamw", "(optim=sgd)")
    assert_one_line_user_error(refused(tmp_path, *TINY, "data.size=40", "seed=1", f"resume={run_dir}"),
                               "was trained with seed=0; this run has seed=1", "resuming needs the same seed")
    (tmp_path / "config.yaml").write_text("micro_batch: 8\n")
    assert_one_line_user_error(refused(tmp_path, *TINY, "data.size=40", f"resume={tmp_path / 'config.yaml'}"),
                               "config.yaml is not a checkpoint: torch.save writes zip archives")
    assert_one_line_user_error(refused(tmp_path, *TINY, "model.hidden=[64]", "data.size=40", f"resume={run_dir}"),
                               "was written for another model")
    assert_one_line_user_error(refused(tmp_path, *TINY, "data.size=40", "micro_batch=16", f"resume={run_dir}"),
                               "was trained with effective batch 32", "this run's is 16")
    assert_one_line_user_error(refused(tmp_path, *TINY, "resume=/nonexistent/last.pt"),
                               "resume=/nonexistent/last.pt: no such checkpoint")


@pytest.fixture
def nan_data(tmp_path, monkeypatch):
    (tmp_path / "nandata.py").write_text(NAN_DATA)
    monkeypatch.syspath_prepend(tmp_path)
    return ["model=mlp", "data=custom", "data._target_=nandata.make", "micro_batch=8", "accum=2", "trainer.epochs=2",
            "trainer.progress=false"]


def test_nonfinite_stop_names_the_step(tmp_path, nan_data):
    error = refused(tmp_path, *nan_data, "trainer.checkpoint_every=1")
    assert_one_line_user_error(error, "non-finite loss at optimizer step", "trainer.on_nonfinite=skip",
                               f"the last checkpoint, {tmp_path / 'refused' / 'checkpoints' / 'step-00000002.pt'}, "
                               "holds finite weights (resume=auto continues from it)")
    for path in (tmp_path / "refused" / "checkpoints").glob("*.pt"):  # every checkpoint written holds finite weights
        assert all(torch.isfinite(t).all() for t in torch.load(path, weights_only=True)["model"].values())


def test_a_diverged_run_without_a_checkpoint_says_so_and_restarts_cleanly(tmp_path, nan_data):
    """Item 3: no claim of a checkpoint that does not exist; starting again from scratch in the same directory
    (resume=auto finds no checkpoint) does not append a second record of every step."""
    error = refused(tmp_path, *nan_data)
    assert_one_line_user_error(error, "non-finite loss at optimizer step 3", "no checkpoint was written before it")
    assert [r["step"] for r in read_metrics(tmp_path / "refused")[0]] == [1, 2]
    run_dir, log = train_here(tmp_path, "refused", *nan_data, "trainer.on_nonfinite=skip", "resume=auto")
    assert "starting from scratch" in log
    assert [r["step"] for r in read_metrics(run_dir)[0]] == list(range(1, 9))


def test_resuming_a_finished_run_trains_nothing_more(tmp_path):
    run_dir, _ = train_here(tmp_path, "run", *TINY, "data.size=40", "trainer.max_steps=3", "micro_batch=8")
    _, log = train_here(tmp_path, "run", *TINY, "data.size=40", "trainer.max_steps=3", "micro_batch=8", "resume=auto")
    assert "nothing left to train" in log
    assert [r["step"] for r in read_metrics(run_dir)[0]] == [1, 2, 3]


def test_nonfinite_skip_drops_the_window_and_counts_it(tmp_path, nan_data):
    run_dir, log = train_here(tmp_path, "skip", *nan_data, "trainer.on_nonfinite=skip")
    steps = read_metrics(run_dir)[0]
    skipped = [r for r in steps if r.get("skipped")]
    assert len(skipped) == 2 and len(steps) == 8  # the poisoned window, once per epoch
    assert all(r["loss"] is None for r in skipped)
    assert "2 non-finite windows skipped" in log
    assert all(torch.isfinite(t).all() for t in final_weights(run_dir).values())


def test_a_corrupt_image_is_named(tmp_path):
    from conftest import make_image_folder
    root = make_image_folder(tmp_path / "images")
    broken = root / "train" / "dog" / "3.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n this is not a picture")
    args = ["model=cnn", "data=imagefolder", f"data.root={root}", "data.image_size=8", "micro_batch=4",
            "trainer.epochs=1"]
    assert_one_line_user_error(refused(tmp_path, *args, "loader.num_workers=0"), f"cannot read image {broken}")
    _, proc = train_run(tmp_path, "w2", *args, "loader.num_workers=2", check=False)  # raised in a loader worker
    assert_one_line_error(proc, f"cannot read image {broken}")


def test_an_unwritable_output_directory_is_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _, proc = train_run(tmp_path, "a_file/run", *TINY, check=False)
    assert proc.returncode == 2
    assert_one_line_error(proc, "cannot create the output directory", "Not a directory")
    (tmp_path / "outputs").write_text("")  # Hydra's default run directory cannot be made here either
    proc = run_cli(*TINY, cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert_one_line_error(proc, "cannot create the output directory outputs")


def test_a_kill_while_a_resume_trims_metrics_leaves_the_history_whole(tmp_path, monkeypatch):
    """keep_metrics_until replaces metrics.jsonl whole: killed before the new file is in place (here: at the rename),
    the history is as it was — it used to be truncated first and written again."""
    path = tmp_path / "metrics.jsonl"
    history = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 101)) + '{"step": 101, "lo'
    path.write_text(history)

    def killed(*args):
        raise KeyboardInterrupt  # the process dies before the trimmed file replaces the old one

    monkeypatch.setattr(files.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        keep_metrics_until(path, 50)
    assert path.read_text() == history and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    monkeypatch.undo()
    keep_metrics_until(path, 50)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == list(range(1, 51))


# A window of 16 micro-batches (micro_batch=2 × accum 16; with 2 devices 8 micro-batches each): a stop signal early in
# it abandons it at once (trainer.stop_grace_s=0: no window ends inside the grace), dropping its partial gradients.
LONG_WINDOW = [*RUN, "data.size=128", "micro_batch=2", "accum=16", "trainer.epochs=2", "trainer.stop_grace_s=0"]


def stop_early_in_a_window(tmp_path: Path, name: str, *args: str, delay: float = 0.1) -> tuple[str, int]:
    """Start the run, send SIGTERM a few micro-batches into the window after optimizer step 2; (its log, exit code)."""
    # 0.1 s a micro-batch: the window of step 3 takes 1.6 s on one rank and 0.8 s on two, room enough for this
    # process to see step 2 late on a loaded machine and still signal well before the window's end
    proc = start(tmp_path, name, *args, f"+model.delay={delay}")
    wait_for_steps(tmp_path / name, 2, proc)
    time.sleep(delay)  # about one micro-batch into the window of step 3
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=WAIT_S)
    return (tmp_path / f"{name}.log").read_text(), code


BATCHNORM_MODEL = """
import time
import torch.nn as nn

class Net(nn.Module):
    def __init__(self, num_classes, in_channels, image_size, delay=0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size ** 2, 16), nn.BatchNorm1d(16),
                                 nn.ReLU(), nn.Linear(16, num_classes))
        self.delay = delay

    def forward(self, x):
        if self.training:
            time.sleep(self.delay)
        return self.net(x)
"""


@pytest.mark.slow
@pytest.mark.parametrize("devices, model", [pytest.param(1, "slow.Net", marks=pytest.mark.long), (2, "slow.Net"),
                                           (1, "stopbn.Net")])
def test_a_stop_early_in_a_long_window_abandons_it_and_the_resume_is_bit_identical(slow, devices, model):
    """Issue 32: a stop signal does not wait for a long window. The run stops within a few micro-batches, checkpoints
    optimizer step 2 (the window of step 3 dropped, its RNG and running statistics put back), and its resume ends
    bit-identical to the uninterrupted run — dropout's masks, and BatchNorm's running statistics, which the dropped
    window's forward passes moved; with 2 ranks both abandon the same micro-batch."""
    (slow / "stopbn.py").write_text(BATCHNORM_MODEL)
    args = [*LONG_WINDOW, f"devices={devices}", f"model._target_={model}"]
    reference, _ = train_here(slow, "reference", *args)
    log, code = stop_early_in_a_window(slow, "stopped", *args)
    assert code == 128 + signal.SIGTERM, log
    abandoned = [line for line in log.splitlines() if "abandoned the window of optimizer step 3 after" in line]
    assert len(abandoned) == 1, log
    done = int(abandoned[0].split(" after ")[1].split(" of ")[0])
    assert done <= 16 // devices - 2, abandoned  # stopped well before the window's end
    run_dir = slow / "stopped"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "interrupted"
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == 2
    assert [r["step"] for r in read_metrics(run_dir)[0]] == [1, 2]
    resumed, _ = train_run(slow, "stopped", *args, "resume=auto")
    assert_identical(final_weights(resumed), final_weights(reference))
    assert [r["loss"] for r in read_metrics(resumed)[0]] == [r["loss"] for r in read_metrics(reference)[0]]


# The slow model of RUN, writing each training forward's weights (a sum) to <trace>-<rank>: the forwards of one
# window all see the weights of the step before it.
TRACED_MODEL = """
import os
import time
import torch.nn as nn

class Net(nn.Module):
    def __init__(self, num_classes, in_channels, image_size, delay=0.0, trace=None):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size ** 2, 32), nn.ReLU(),
                                 nn.Dropout(0.3), nn.Linear(32, num_classes))
        self.delay, self.trace = delay, trace

    def forward(self, x):
        if self.training:
            time.sleep(self.delay)
            if self.trace:
                with open(f"{self.trace}-{os.environ.get('RANK', '0')}", "a") as f:
                    f.write(f"{float(self.net[1].weight.double().sum()):.15e}\\n")
        return self.net(x)
"""


@pytest.mark.slow
def test_sigterm_mid_window_on_two_ranks_abandons_it_on_both_and_the_resume_is_bit_identical(slow):
    """Issue 44: with devices=2 and a grace the window cannot end within (16 micro-batches a rank, ≈ 0.1 s each, a
    grace of 1 s: its rest is more than half of it), a SIGTERM early in the window abandons it on both ranks at the
    same micro-batch — each rank's forwards with the weights of step 2 stop there — and the resume is
    bit-identical."""
    (slow / "traced.py").write_text(TRACED_MODEL)
    args = [*RUN, "model._target_=traced.Net", "data.size=128", "micro_batch=2", "accum=16", "devices=2",
            "trainer.epochs=2", "trainer.stop_grace_s=1"]
    reference, _ = train_here(slow, "reference", *args)
    log, code = stop_early_in_a_window(slow, "stopped", *args, "+model.trace=forwards")
    assert code == 128 + signal.SIGTERM, log
    abandoned = [line for line in log.splitlines() if "SIGTERM: abandoned the window of optimizer step 3 after" in line]
    assert len(abandoned) == 1, log
    done = int(abandoned[0].split(" after ")[1].split(" of ")[0])
    assert done <= 16 - 4 and "of 16 micro-batches" in abandoned[0], abandoned  # far from its end
    for rank in (0, 1):  # the last run of equal weights: the window of step 3, as far as this rank went
        weights = (slow / f"forwards-{rank}").read_text().split()
        last = weights[::-1]
        assert next(i for i, w in enumerate(last) if w != last[0]) == done, (rank, done)
    run_dir = slow / "stopped"
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == 2
    resumed, _ = train_run(slow, "stopped", *args, "resume=auto")
    assert_identical(final_weights(resumed), final_weights(reference))


@pytest.mark.slow
def test_a_stop_within_the_grace_finishes_the_window(slow):
    """Within the grace (here 600 s, half of it far beyond the window's rest) the window is finished, as before."""
    args = [*LONG_WINDOW, "trainer.stop_grace_s=600"]
    log, code = stop_early_in_a_window(slow, "stopped", *args)
    assert code == 128 + signal.SIGTERM, log
    assert "SIGTERM: finished the window of optimizer step 3 (it ends within 0.5 × trainer.stop_grace_s=600" in log
    assert "abandoned" not in log, log
    assert torch.load(slow / "stopped" / "checkpoints" / "last.pt", weights_only=True)["step"] == 3


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_negative_stop_grace_is_one_line(value):
    from accutrain.cli.command import check

    with pytest.raises(UserError) as info:
        check([*TINY, f"trainer.stop_grace_s={value}"])
    assert_one_line_user_error(info.value, f"trainer.stop_grace_s={value}", "0 or more")
