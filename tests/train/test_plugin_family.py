"""A window-level loss of the user's, given as `loss._target_` from any module, is a family of its own
(examples/mywindowloss.py, on WindowLoss): exact under any split — micro_batch=4 accum=4, and two gloo ranks, end with
the weights of micro_batch=16 — its traits read from its class (refusals before the run, min_window, BatchNorm),
while a plain function stays a per-term loss."""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TINY, assert_one_line_user_error, final_weights, read_metrics, train_here

from accutrain.config import families
from accutrain.config.train import compose
from accutrain.config.validate import typed_run
from accutrain.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ["loss=custom", "loss._target_=examples.mywindowloss.AlignUniform", "+loss.weight=0.5"]
PAIRS = [*TINY, *PLUGIN, "augment.views=2", "augment.crop=pad", "augment.padding=1", "data.size=70",
         "data.val_size=24", "trainer.epochs=1", "optim=sgd", "optim.lr=0.5"]


@pytest.fixture(autouse=True)
def examples_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # as when run from the repository's top folder


def distance(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.quick  # the quick tier's family of the user's
def test_a_class_implementing_the_protocol_is_a_family_with_its_traits():
    run = typed_run(compose(*PAIRS))
    traits = families.traits_of(run.loss)
    assert traits.whole_window and traits.caches_window and traits.pairs and traits.min_window == 2
    assert families.option(run.loss) == "loss._target_=examples.mywindowloss.AlignUniform"
    per_term = typed_run(compose(*TINY, "loss=custom", "loss._target_=examples.mylosses.cubic",
                                 "data.target=regression"))
    assert not families.traits_of(per_term.loss).whole_window  # a plain function: per term


@pytest.mark.parametrize("extra, fragment", [
    (["strategy=fsdp"], "cannot be combined with strategy=fsdp"),
    (["micro_batch=auto", "global_batch=16", "trainer.memory_budget_mb=500"], "cannot be combined with micro_batch=auto"),
    (["micro_batch=1"], "cannot be combined with an effective batch of 1"),
])
def test_its_traits_refuse_before_the_run(extra, fragment):
    with pytest.raises(UserError) as info:
        typed_run(compose(*PAIRS, *extra))
    assert_one_line_user_error(info.value, "loss._target_=examples.mywindowloss.AlignUniform", fragment)


@pytest.mark.slow
def test_the_plugin_window_loss_is_exact_under_any_split(tmp_path):
    big, _ = train_here(tmp_path, "big", *PAIRS, "micro_batch=16", "accum=1")
    acc, _ = train_here(tmp_path, "acc", *PAIRS, "micro_batch=4", "accum=4")
    two, _ = train_here(tmp_path, "two", *PAIRS, "devices=2", "micro_batch=4", "accum=2")
    start = train_here(tmp_path, "start", *PAIRS, "micro_batch=16", "trainer.max_steps=1")[0]
    weights = final_weights(big)
    assert distance(final_weights(acc), weights) < 1e-5
    assert distance(final_weights(two), weights) < 1e-5
    assert distance(final_weights(start), weights) > 1e-3
    assert [r["samples"] for r in read_metrics(acc)[0]] == [16, 16, 16, 16, 6]
