"""loss=contrastive keeps the promise: micro_batch=8 accum=8, and devices=2 micro_batch=8 accum=4, end with the
weights of micro_batch=64 (AdamW, clipping, float32, no dropout), on windows with a short tail — while the naive
per-micro-batch loss (loss.window=false) does not; bad combinations are one line naming the key."""

import pytest
import torch
from conftest import (
    TINY,
    TINY_DATA,
    assert_identical,
    assert_one_line_user_error,
    final_weights,
    killed_at_step,
    read_metrics,
    train_here,
    train_run,
)

pytestmark = pytest.mark.slow

# 150 samples: windows of 64, 64 and 22 (micro-batches of 8: the last holds 6); two random views per sample.
PAIRS = [*TINY, "loss=contrastive", "augment.views=2", "augment.crop=pad", "augment.padding=1", "data.size=150",
         "data.val_size=40", "trainer.epochs=2", "optim=adamw", "optim.lr=0.003", "trainer.grad_clip=0.5",
         "loss.temperature=0.2"]


def distance(a: dict, b: dict) -> float:
    """The largest absolute difference of any weight."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("extra", [pytest.param([], marks=pytest.mark.quick),  # the quick tier's window loss
                                   ["loss.learn_temperature=true", "loss.symmetric=false"]])
def test_window_loss_accumulated_equals_the_big_batch(tmp_path, extra):
    big, _ = train_here(tmp_path, "big", *PAIRS, *extra, "micro_batch=64", "accum=1")
    acc, _ = train_here(tmp_path, "acc", *PAIRS, *extra, "micro_batch=8", "accum=8")
    start = train_here(tmp_path, "start", *PAIRS, *extra, "micro_batch=64", "trainer.max_steps=1")[0]
    weights = final_weights(big)
    assert distance(final_weights(acc), weights) < 1e-5
    assert distance(final_weights(start), weights) > 1e-3  # the weights moved: the equality is not vacuous
    steps = read_metrics(acc)[0]
    assert [r["samples"] for r in steps] == [64, 64, 22] * 2
    assert [r["loss"] for r in steps] == pytest.approx([r["loss"] for r in read_metrics(big)[0]], rel=1e-5)
    evals = read_metrics(acc)[1]
    assert "val_recall1" in evals[-1] and evals[-1]["val_loss"] == pytest.approx(read_metrics(big)[1][-1]["val_loss"],
                                                                                   rel=1e-5)
    if extra:  # the learnt temperature is a weight: stepped, checkpointed
        assert "contrastive_logit_scale" in weights
        assert float(weights["contrastive_logit_scale"]) != pytest.approx(float(torch.tensor(1 / 0.2).log()))


def test_window_loss_on_two_ranks_equals_the_big_batch(tmp_path):
    # the last window of 22 is cut 8|8 then 6|0 on two ranks: rank 1's last share is empty
    two, _ = train_here(tmp_path, "two", *PAIRS, "devices=2", "micro_batch=8", "accum=4",
                        "loss.learn_temperature=true")
    big, _ = train_here(tmp_path, "big", *PAIRS, "micro_batch=64", "accum=1", "loss.learn_temperature=true")
    assert distance(final_weights(two), final_weights(big)) < 1e-5
    assert read_metrics(two)[1][-1]["val_recall1"] == read_metrics(big)[1][-1]["val_recall1"]


def test_naive_window_false_differs_measurably(tmp_path):
    big, _ = train_here(tmp_path, "big", *PAIRS, "micro_batch=64")
    naive, log = train_here(tmp_path, "naive", *PAIRS, "micro_batch=8", "accum=8", "loss.window=false")
    assert "loss.window=false" in log and "NOT the big batch's" in log
    assert distance(final_weights(naive), final_weights(big)) > 1e-3


@pytest.mark.parametrize("args, fragments", [
    (["augment.views=2", "augment.crop=pad"], ["augment.views=2", "loss=contrastive"]),
    (["loss=contrastive"], ["loss=contrastive needs pairs", "augment.views=2"]),
    (["loss=contrastive", "augment.views=2"], ["augment.views=2 needs two different random views", "augment="]),
    (["loss=contrastive", "augment.views=2", "augment.crop=pad", "model=resnet18"],
     ["loss=contrastive with BatchNorm", "batchnorm.convert=group"]),
    (["loss=contrastive", "augment.views=2", "augment.crop=pad", "loss.temperature=0"], ["loss.temperature=0"]),
    (["loss=contrastive", "augment.views=2", "augment.crop=pad", "trainer.noise_scale=true", "accum=2"],
     ["loss=contrastive cannot be combined with trainer.noise_scale=true", "trainer.noise_scale=false"]),
])
def test_bad_combinations_are_one_line(tmp_path, args, fragments):
    from accutrain.errors import UserError

    with pytest.raises(UserError) as info:
        train_here(tmp_path, "bad", *TINY_DATA, *args)
    assert_one_line_user_error(info.value, *fragments)


def test_a_sigkill_mid_run_resumes_bit_identical_with_dropout_replayed(slow):
    """The two passes' random states (dropout on) and the learnt temperature are in the checkpoint's state."""
    args = [*TINY_DATA, "model=custom", "model._target_=slow.Net", "loss=contrastive", "augment.views=2",
            "augment.crop=pad", "augment.padding=1", "data.size=117", "trainer.epochs=3", "micro_batch=8", "accum=4",
            "trainer.checkpoint_every=1", "optim=adamw", "loss.learn_temperature=true"]
    reference, _ = train_here(slow, "reference", *args)
    killed_at_step(slow, "killed", 5, *args, "+model.delay=0.02")
    resumed, out = train_run(slow, "killed", *args, "resume=auto")
    assert "resumed from" in out.stderr
    assert_identical(final_weights(resumed), final_weights(reference))
    assert [r["loss"] for r in read_metrics(resumed)[0]] == [r["loss"] for r in read_metrics(reference)[0]]
