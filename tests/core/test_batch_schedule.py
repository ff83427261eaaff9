"""batch_schedule: the effective batch grows with the samples seen; every split of the same schedule takes the same
windows, the learning rate follows each window's batch, and a killed run resumes bit-identically mid-ramp."""
import signal

import pytest
import torch
from conftest import (
    RUN,
    TINY,
    WAIT_S,
    assert_identical,
    assert_one_line_user_error,
    assert_same_weights,
    final_weights,
    read_metrics,
    start,
    train_here,
    train_run,
    wait_for_steps,
)

from accutrain.config.train import compose
from accutrain.core.options import LastWindow
from accutrain.core.plan import make_plan
from accutrain.errors import UserError

# 117 samples, 3 epochs: the ramp 16 → 64 over the first half of the 351 samples, in multiples of 16.
RAMP = ["batch_schedule=ramp", "batch_schedule.batch=[16,64]", "batch_schedule.at=[0,0.5]"]
SCHEDULED = [*TINY, "data.size=117", "trainer.epochs=3", "trainer.grad_clip=0.5", "optim.weight_decay=1e-3", *RAMP]


def plan_of(*overrides, micro_batch=8, devices=1, size=117, epochs=3, max_steps=None, drop=False):
    cfg = compose(*RAMP, *overrides)
    return make_plan(micro_batch=micro_batch, accum=None, devices=devices, global_batch=None, train_size=size,
                     last_window=LastWindow.drop if drop else LastWindow.step, epochs=epochs, max_steps=max_steps,
                     schedule=cfg.batch_schedule)


def test_windows_follow_the_samples_seen():
    plan = plan_of()  # the ramp reaches 64 at sample 176 (half of 3 × 117), in multiples of gcd(16, 64) = 16
    sizes = [plan.window_sizes(e) for e in range(3)]
    seen = 0
    for epoch in sizes:
        assert sum(epoch) == 117
        for i, size in enumerate(epoch):
            batch = plan.batch_at(seen)
            assert size == batch or (i == len(epoch) - 1 and size < batch)  # only an epoch's last may be short
            assert batch % 16 == 0 and 16 <= batch <= 64
            seen += size
    assert sizes[2] == (64, 53)  # after the ramp: the fixed last batch, then the epoch's rest
    assert plan.total_steps == sum(len(e) for e in sizes) and plan.total_epochs == 3
    assert plan.seen_before(2) == 234


def test_steps_max_steps_and_the_drop_policy():
    steps = plan_of("batch_schedule=steps", "batch_schedule.at=[0,1]", "batch_schedule.batch=[32,64]")
    assert steps.window_sizes(0) == (32, 32, 32, 21) and steps.window_sizes(1) == (64, 53)
    assert plan_of(max_steps=5, epochs=None, *["batch_schedule.unit=samples", "batch_schedule.at=[0,100]"]
                   ).total_steps == 5
    dropped = plan_of(drop=True)
    assert all(sum(dropped.window_sizes(e)) < 117 for e in range(dropped.total_epochs))
    assert all(size % 16 == 0 for e in range(dropped.total_epochs) for size in dropped.window_sizes(e))


def test_every_split_of_the_same_schedule_takes_the_same_steps(tmp_path):
    a, _ = train_here(tmp_path, "a", *SCHEDULED, "micro_batch=8")
    b, _ = train_here(tmp_path, "b", *SCHEDULED, "micro_batch=16")
    c, _ = train_here(tmp_path, "c", *SCHEDULED, "micro_batch=4")
    assert_same_weights(final_weights(a), final_weights(b))
    assert_same_weights(final_weights(c), final_weights(b))
    steps = {name: read_metrics(d)[0] for name, d in (("a", a), ("b", b), ("c", c))}
    assert [r["samples"] for r in steps["a"]] == [r["samples"] for r in steps["b"]] == [r["samples"] for r in
                                                                                       steps["c"]]
    assert len({r["effective"] for r in steps["a"]}) > 2  # the batch really grew
    assert [r["micro_batches"] for r in steps["a"]] == [-(-r["samples"] // 8) for r in steps["a"]]


@pytest.mark.slow
def test_two_ranks_take_the_same_steps_under_a_schedule(tmp_path):
    one, _ = train_here(tmp_path, "one", *SCHEDULED, "micro_batch=8")
    two, _ = train_here(tmp_path, "two", *SCHEDULED, "micro_batch=8", "devices=2")
    assert_same_weights(final_weights(two), final_weights(one))


def test_the_learning_rate_follows_each_windows_batch(tmp_path):
    run_dir, log = train_here(tmp_path, "run", *SCHEDULED, "micro_batch=8", "sched=constant", "optim.lr=0.05",
                              "scaling.lr=linear", "scaling.base_batch=16")
    steps = read_metrics(run_dir)[0]
    assert [r["lr"] for r in steps] == pytest.approx([0.05 * r["effective"] / 16 for r in steps], rel=1e-12)
    assert "batch schedule (linear ramp): 16 from sample 0, 64 from sample 176" in log


@pytest.mark.parametrize("args, fragments", [
    (["micro_batch=32"], ["batch_schedule.batch has 16", "micro_batch × devices = 32"]),
    (["accum=2"], ["drop accum=2"]),
    (["batch_schedule.at=[0,2]"], ["batch_schedule.at=[0.0, 2.0]", "from 0 to 1"]),
    (["batch_schedule.at=[0.5,0.7]"], ["ascending points starting at 0"]),
    (["batch_schedule.at=[0]"], ["same length"]),
    (["trainer.epochs=null", "trainer.max_steps=10"], ["batch_schedule.unit=fraction needs trainer.epochs"]),
])
def test_a_schedule_the_run_cannot_make_is_one_line(tmp_path, args, fragments):
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "err", *SCHEDULED, *args)
    assert_one_line_user_error(info.value, *fragments)


def test_resuming_with_another_schedule_is_refused(tmp_path):
    run_dir, _ = train_here(tmp_path, "run", *SCHEDULED, "micro_batch=8", "trainer.max_steps=3")
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "other", *SCHEDULED, "micro_batch=8", "batch_schedule.batch=[16,32]",
                   f"resume={run_dir}")
    assert_one_line_user_error(info.value, "was trained with batch schedule", "resuming needs the same schedule")
    with pytest.raises(UserError):
        train_here(tmp_path, "fixed", *TINY, "data.size=117", "micro_batch=16", f"resume={run_dir}")


@pytest.mark.long  # a feature's resume: the core kill-and-resume test runs every time
@pytest.mark.slow
def test_killed_mid_ramp_and_resumed_ends_bit_identical(slow):
    args = [*(a for a in RUN if not a.startswith("accum=")), *RAMP]
    reference, _ = train_here(slow, "reference", *args)
    proc = start(slow, "killed", *args, "+model.delay=0.02")
    wait_for_steps(slow / "killed", 4, proc)  # the ramp runs over the first 11 windows
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=WAIT_S)
    resumed, out = train_run(slow, "killed", *args, "resume=auto")
    assert "resumed from" in out.stderr
    assert_identical(final_weights(resumed), final_weights(reference))
    assert [r["effective"] for r in read_metrics(resumed)[0]] == [r["effective"] for r in
                                                                  read_metrics(reference)[0]]
    assert torch.load(resumed / "checkpoints" / "last.pt", weights_only=True)["plan"]["schedule"]["batch"] == [16, 64]
