"""PyTorch's threads and the cores they get: the start's line (threads, the cores this process may use, the load),
the load in the periodic step line, trainer.threads (N, auto), and the warning, once, when the steps' rate shows
the threads starved — proven with a measured load injected, not by timing a busy machine."""
import os

import pytest
import torch
from conftest import TINY, assert_one_line_user_error, run_of, train_here

from accutrain.errors import UserError
from accutrain.train.threads import REMEDY, ThreadWatch, available_cpus, choose


def watch(load, threads=2, cpus=2):
    measured = []

    def measure():
        measured.append(load)
        return load
    return ThreadWatch(threads, cpus, measure), measured


def test_the_warning_comes_once_when_the_rate_halves_while_the_load_exceeds_the_cores():
    w, measured = watch(load=4.6)
    assert [w.step(rate) for rate in [90, 400, 410, 405, 398, 402, 401]] == [None] * 7  # steady: nothing, no load read
    assert not measured
    said = [w.step(rate) for rate in [150, 140, 150, 145, 150, 20, 20]]
    fired = [s for s in said if s]
    assert len(fired) == 1 and said.index(fired[0]) == 2  # when the median of the last 5 falls under half the best
    assert "slowed to 150 samples/s from 402" in fired[0] and "load 4.6 on 2 cores" in fired[0]
    assert "PyTorch's 2 threads wait for cores other processes hold" in fired[0] and fired[0].endswith(REMEDY)
    assert "OMP_NUM_THREADS=1" in REMEDY and "trainer.threads=1" in REMEDY


def test_no_warning_when_the_cores_are_free_or_the_run_has_one_thread():
    free, _ = watch(load=1.9)
    one, measured = watch(load=9.0, threads=1)
    rates = [400] * 6 + [100] * 10
    assert not any(free.step(r) for r in rates) and not any(one.step(r) for r in rates) and not measured


def test_trainer_threads_auto_takes_the_cores_the_load_leaves():
    assert choose(None, 8, 3.0, 1) is None  # PyTorch's own choice (or OMP_NUM_THREADS)
    assert choose(3, 8, 7.5, 1) == 3
    assert [choose("auto", 8, busy, 1) for busy in (0.2, 3.4, 7.9, 30.0)] == [8, 5, 1, 1]
    assert choose("auto", 8, 0.0, 2) == 4 and choose("auto", 2, 4.2, 1) == 1  # shared by two ranks; a busy 2 cores


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "many"])
def test_a_bad_thread_count_is_one_line(value):
    with pytest.raises(UserError) as info:
        run_of(*TINY, f"trainer.threads={value}")
    assert_one_line_user_error(info.value, f"trainer.threads={value}", "auto")


def test_the_run_says_its_threads_cores_and_load_at_start_and_in_the_step_line(tmp_path):
    before = torch.get_num_threads()
    try:
        _, log = train_here(tmp_path, "run", *TINY, "data.size=64", "trainer.max_steps=2", "trainer.log_every=1",
                            "trainer.threads=1")
    finally:
        torch.set_num_threads(before)
    cpus = available_cpus()
    assert f"CPU: 1 PyTorch thread on {cpus} available core{'s' if cpus > 1 else ''}, load " in log
    assert "(trainer.threads=1)" in log
    assert f" on {cpus} cores" in next(line for line in log.splitlines() if line.startswith("step 2/2"))
    assert len(os.sched_getaffinity(0)) == cpus
