"""The default checkpointing (trainer.checkpoint_minutes): by the clock the ranks agree on and at every epoch end, so
that a kill of a run with the default config resumes from a checkpoint rather than from step 0."""
import signal

import pytest
from conftest import (
    RUN,
    TINY,
    WAIT_S,
    assert_identical,
    final_weights,
    read_metrics,
    start,
    train_here,
    train_run,
    wait_for_steps,
)

DEFAULT = [arg for arg in RUN if not arg.startswith("trainer.checkpoint_every")]  # 4 windows an epoch, 3 epochs


@pytest.mark.slow
def test_a_default_run_killed_after_its_first_epoch_resumes_from_its_end_bit_identical(slow):
    reference, log = train_here(slow, "reference", *DEFAULT)
    assert "a kill (SIGKILL) sets the run back by at most 10 minutes of training" in log  # said at the start
    proc = start(slow, "killed", *DEFAULT, "+model.delay=0.02")
    wait_for_steps(slow / "killed", 6, proc)  # epoch 1 is steps 1-4: its end's checkpoint is on disk
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL
    resumed, proc = train_run(slow, "killed", *DEFAULT, "resume=auto")
    assert "resumed from" in proc.stderr and "step-00000004.pt" in proc.stderr, proc.stderr
    assert "starting from scratch" not in proc.stderr
    assert_identical(final_weights(resumed), final_weights(reference))
    assert [r["loss"] for r in read_metrics(resumed)[0]] == [r["loss"] for r in read_metrics(reference)[0]]


def step_files(run_dir):
    return sorted(int(p.name[5:13]) for p in (run_dir / "checkpoints").glob("step-*.pt"))


def test_checkpoints_follow_the_clock_and_the_epoch_ends(tmp_path):
    args = [*TINY, "data.size=64", "micro_batch=8", "accum=2", "trainer.epochs=2", "trainer.keep_checkpoints=50"]
    default, _ = train_here(tmp_path, "default", *args)
    assert step_files(default) == [4, 8]  # the epoch ends (4 windows an epoch), within the first 10 minutes
    every, _ = train_here(tmp_path, "every", *args, "trainer.checkpoint_minutes=1e-9")
    assert step_files(every) == list(range(1, 9))  # the clock is always due: every step
    off, log = train_here(tmp_path, "off", *args, "trainer.checkpoint_minutes=null")
    assert step_files(off) == [8] and "loses the whole run" in log


def test_checkpoint_minutes_must_be_positive(tmp_path):
    from accutrain.errors import UserError
    with pytest.raises(UserError, match=r"trainer.checkpoint_minutes=0.0 is not valid: expected a positive number"):
        train_here(tmp_path, "zero", *TINY, "trainer.checkpoint_minutes=0")


def test_a_start_from_scratch_beside_a_best_checkpoint_says_so_without_contradiction(tmp_path):
    from conftest import rewind
    args = [*TINY, "data.size=64", "micro_batch=8", "trainer.max_steps=6", "trainer.eval_every=2",
            "trainer.checkpoint_minutes=null"]
    run_dir, _ = train_here(tmp_path, "run", *args)
    rewind(run_dir, 0)  # killed before any step checkpoint: best.pt alone is left
    _, log = train_here(tmp_path, "run", *args, "resume=auto")
    assert "no checkpoint to resume from" in log and "starting from scratch" in log
    assert "another branch" not in log and "this run starts at optimizer step 0" in log and "best.pt" in log


@pytest.mark.slow
def test_two_ranks_decide_alike_by_the_clock(tmp_path):
    """Each rank's clock differs; the decision is the ranks' mean, carried by the step's all-reduce: every rank
    checkpoints at the same steps (a rank deciding alone would leave the other in the checkpoint's wait)."""
    args = [*TINY, "data.size=64", "micro_batch=4", "accum=2", "trainer.epochs=1", "trainer.keep_checkpoints=50",
            "trainer.checkpoint_minutes=1e-9"]
    two, _ = train_here(tmp_path, "two", *args, "devices=2")
    assert step_files(two) == [1, 2, 3, 4]  # 64 samples in windows of 16: every step
