"""The core promise: every split of the same effective batch takes the same optimizer steps on the same windows."""
import pytest
import torch
from conftest import EXACT, assert_same_weights, final_weights, read_metrics, train_here


# 110 samples = 3 windows of 32 + a window of 14: with micro_batch 8 the last micro-batch holds 6 samples.
# grad_clip makes per-micro-batch clipping (a classic bug) show up as different weights.
@pytest.mark.quick  # the quick tier's exactness test of cross-entropy
def test_accumulated_runs_equal_the_big_batch_run(tmp_path):
    big, _ = train_here(tmp_path, "big", *EXACT, "micro_batch=32", "accum=1")
    acc, _ = train_here(tmp_path, "acc", *EXACT, "micro_batch=8", "accum=4")
    glob, _ = train_here(tmp_path, "glob", *EXACT, "micro_batch=4", "global_batch=32")
    assert_same_weights(final_weights(acc), final_weights(big))
    assert_same_weights(final_weights(glob), final_weights(big))

    # the weights moved, and another seed would not match: the equality above is not vacuous
    other, _ = train_here(tmp_path, "other", *EXACT, "micro_batch=32", "seed=1")
    assert any(not torch.allclose(final_weights(other)[k], final_weights(big)[k]) for k in final_weights(big))

    steps = {name: read_metrics(d)[0] for name, d in (("big", big), ("acc", acc), ("glob", glob))}
    for name, records in steps.items():  # one record per optimizer step, windows of the real sizes
        assert [r["step"] for r in records] == list(range(1, 13)), name
        assert [r["samples"] for r in records] == [32, 32, 32, 14] * 3, name
    assert [r["micro_batches"] for r in steps["acc"]] == [4, 4, 4, 2] * 3
    assert [r["micro_batches"] for r in steps["glob"]] == [8, 8, 8, 4] * 3
    assert [r["micro_batches"] for r in steps["big"]] == [1] * 12
    for name in ("acc", "glob"):  # the scheduler moved once per optimizer step; the logged loss is the window's
        assert [r["lr"] for r in steps[name]] == pytest.approx([r["lr"] for r in steps["big"]], rel=1e-12)
        assert [r["loss"] for r in steps[name]] == pytest.approx([r["loss"] for r in steps["big"]], rel=1e-5)
        assert [r["grad_norm"] for r in steps[name]] == pytest.approx([r["grad_norm"] for r in steps["big"]],
                                                                       rel=1e-4)


def test_drop_policy_skips_the_incomplete_window_for_every_split(tmp_path):
    a, _ = train_here(tmp_path, "a", *EXACT, "micro_batch=8", "accum=4", "trainer.last_window=drop")
    b, _ = train_here(tmp_path, "b", *EXACT, "micro_batch=32", "trainer.last_window=drop")
    assert [r["samples"] for r in read_metrics(a)[0]] == [32] * 9
    assert_same_weights(final_weights(a), final_weights(b))
