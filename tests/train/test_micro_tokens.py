"""micro_tokens=N (and auto): each window (fixed first, by samples) cut into micro-batches of at most N padded tokens, longest
samples first; the same windows, so the same weights as micro_batch × accum, on one device and on two."""
import random
import re

import pytest
import torch
from conftest import assert_identical, assert_one_line_user_error, final_weights, read_metrics, train_here

from accutrain.config.validate import typed_run, validate
from accutrain.core.options import LastWindow
from accutrain.core.plan import make_plan
from accutrain.core.token_budget import TokenLengths
from accutrain.core.windows import WindowSampler
from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.train.build import build

GPT2 = ["model=hf_causal_lm", "+model.config.model_type=gpt2", "+model.config.n_layer=2", "+model.config.n_head=2",
        "+model.config.n_embd=32", "+model.config.n_positions=64", "model.dropout=0"]
WORDS = "the cat sat on a mat and dog ran far away big small red blue".split()


def test_the_budget_cuts_longest_first_within_n_padded_tokens():
    lengths = torch.tensor([3, 9, 4, 9, 1, 7, 2, 5])
    tokens = TokenLengths(lengths, budget=20)
    chunks = tokens.cut(list(range(8)))
    assert sorted(p for c in chunks for p in c) == list(range(8))  # every sample once
    assert [[int(lengths[p]) for p in c] for c in chunks] == [[9, 9], [7, 5], [4, 3, 2, 1]]  # ties in window order
    assert [c[0] for c in chunks[:1]] == [1]
    assert all(len(c) * max(int(lengths[p]) for p in c) <= 20 for c in chunks)
    assert tokens.padding([[1, 3], [5, 7], [2, 0, 6, 4]]) == (40, 18 + 14 + 16)
    assert TokenLengths(lengths, padded_to=10, budget=25).cut(list(range(8))) == [[1, 3], [5, 7], [2, 0], [6, 4]]


def test_every_rank_takes_as_many_micro_batches_and_together_the_window():
    n = 40
    lengths = torch.tensor([random.Random(i).randint(1, 30) for i in range(n)])
    def shares(devices, rank):
        plan = make_plan(micro_batch=16 // devices, accum=1, devices=devices, global_batch=None, train_size=n,
                         last_window=LastWindow.step, epochs=1, max_steps=None, micro_tokens=64)
        sampler = WindowSampler(plan, 0, rank, devices, tokens=TokenLengths(lengths, budget=64))
        return list(sampler.windows()), len(sampler)
    one, count = shares(1, 0)
    assert count == sum(len(w) for w in one)
    for window in one:  # the budget holds, and micro-batch counts vary with the window's lengths
        assert all(len(mb) * max(int(lengths[i]) for i in mb) <= 64 for mb in window)
    assert len({len(w) for w in one}) > 1
    (r0, c0), (r1, c1) = shares(2, 0), shares(2, 1)
    for w, a, b in zip(one, r0, r1):
        assert len(a) == len(b) and a[0].window.sizes == tuple(len(m) for m in a)
        assert [list(m) for m in w] == [list(m) for pair in zip(a, b) for m in pair if m]  # dealt k → k % 2
    assert c0 == c1 == sum(len(w) for w in r0)


def lm_args(tmp_path, *args):
    r = random.Random(1)
    path = tmp_path / "lm.txt"
    if not path.exists():
        path.write_text("\n".join(" ".join(r.choice(WORDS) for _ in range(r.randint(1, 12))) for _ in range(41)))
    return [*GPT2, "data=text", f"data.train={path}", "data.val_fraction=0.1", "data.max_length=64", "optim=sgd",
            "optim.lr=0.3", "optim.momentum=0", "trainer.epochs=1", "trainer.progress=false", *args]


@pytest.mark.slow
def test_micro_tokens_ends_with_the_weights_of_micro_batch_runs_of_the_same_windows(tmp_path):
    pytest.importorskip("transformers")
    acc, _ = train_here(tmp_path, "acc", *lm_args(tmp_path, "micro_batch=4", "accum=4"))
    tok, log = train_here(tmp_path, "tok", *lm_args(tmp_path, "micro_tokens=160", "global_batch=16",
                                                    "trainer.checkpoint_every=1", "trainer.keep_checkpoints=8"))
    middle = tok / "checkpoints" / "step-00000002.pt"  # mid-epoch: the next window is the epoch's third
    resumed, _ = train_here(tmp_path, "resumed", *lm_args(tmp_path, "micro_tokens=160", "global_batch=16",
                                                          f"resume={middle}"))
    assert_identical(final_weights(resumed), final_weights(tok))
    two, _ = train_here(tmp_path, "two", *lm_args(tmp_path, "devices=2", "micro_batch=4", "accum=2",
                                                  "micro_tokens=160"))
    reference = final_weights(acc)
    for run in (tok, two):
        for key, value in final_weights(run).items():
            torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-6)
    steps, budget, shared = read_metrics(acc)[0], read_metrics(tok)[0], read_metrics(two)[0]
    assert [r["samples"] for r in budget] == [r["samples"] for r in steps] == [r["samples"] for r in shared]
    assert [r["elements"] for r in budget] == [r["elements"] for r in steps]
    assert [r["input_tokens"] for r in budget] == [r["input_tokens"] for r in steps]
    assert len({r["micro_batches"] for r in budget}) > 1  # the count follows each window's lengths
    assert sum(r["pad_fraction"] for r in budget) < sum(r["pad_fraction"] for r in steps)  # sorted: less padding
    assert all(r["input_tokens_per_s"] > 0 for r in budget)
    assert [r["grad_syncs"] for r in shared] == [1] * len(shared)  # one all-reduce per window on two ranks
    assert "cut into micro-batches of at most 160 padded tokens" in log


@pytest.mark.parametrize("overrides, message", [
    (["micro_tokens=0"], "micro_tokens=0 is not valid"),
    (["micro_tokens=64", "micro_batch=auto", "global_batch=8"], "micro_tokens=64 cannot be combined with micro_batch=auto: micro_tokens cuts each window by a token budget"),
    (["micro_tokens=64", "global_batch=9", "devices=2"], "global_batch=9 is not a multiple of devices 2"),
    (["micro_tokens=64", "global_batch=8", "accum=2"], "drop accum=2"),
])
def test_what_micro_tokens_cannot_take_is_one_line(compose, overrides, message):
    with pytest.raises(UserError) as info:
        validate(compose(*overrides))
    assert_one_line_user_error(info.value, message)


@pytest.mark.parametrize("lm, overrides, message", [
    (True, ["micro_tokens=40"], "micro_tokens=40 is less than the longest training sample, 55 tokens"),
    (False, ["model=mlp", "data=digits", "micro_tokens=64"], "this data's samples are not token sequences"),
])
def test_a_budget_below_one_sample_or_data_without_tokens_is_one_line(compose, tmp_path, lm, overrides, message):
    pytest.importorskip("transformers")
    cfg = typed_run(compose(*(lm_args(tmp_path, "micro_batch=4", "accum=4") if lm else []), *overrides))
    with pytest.raises(UserError) as info:
        build(cfg, World(), torch.device("cpu"))
    assert_one_line_user_error(info.value, message)


def test_fixed_width_sequences_are_cut_as_micro_batch_budget_over_width_with_no_padding_figures():
    from accutrain.core.batches import BatchFormat
    from accutrain.data.datasets import sequences
    from accutrain.data.lengths import token_lengths

    data = sequences(40, 8, vocab=11, min_length=4, max_length=16, seed=0)
    tokens = token_lengths(data, BatchFormat(), 50)  # 3 rows of 16 tokens fit 50
    plan = make_plan(micro_batch=21, accum=1, devices=1, global_batch=None, train_size=40,
                     last_window=LastWindow.step, epochs=1, max_steps=None, micro_tokens=50)
    budget = WindowSampler(plan, 0, tokens=tokens)
    plain = WindowSampler(make_plan(micro_batch=3, accum=7, devices=1, global_batch=None, train_size=40,
                                    last_window=LastWindow.step, epochs=1, max_steps=None), 0)
    window = next(budget.windows())
    assert [list(m) for m in window] == [list(m) for m in next(plain.windows())]  # equal lengths keep their order
    assert [len(m) for m in window] == [3] * 7 and budget.padding(window[0].window) is None



TOKEN_OOM_MODEL = '''
import torch
import torch.nn as nn

class Net(nn.Module):
    """A tiny language model whose training forward runs out of memory above `limit` tokens (rows × length)."""
    def __init__(self, num_classes, limit=200):
        super().__init__()
        self.embed, self.head, self.limit = nn.Embedding(num_classes, 16), nn.Linear(16, num_classes), limit

    def forward(self, input_ids, attention_mask=None):
        if self.training and input_ids.numel() > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated: {input_ids.numel()} > {self.limit})")
        return self.head(torch.tanh(self.embed(input_ids))).transpose(1, 2)
'''


def test_search_doubles_then_bisects_to_the_largest_multiple_that_fits():
    from accutrain.train.auto_tokens import search_multiple

    tried = []

    def fits(k):
        tried.append(k)
        return k <= 11, 0.0

    assert search_multiple(40, fits)[0] == 11 and tried == [1, 2, 4, 8, 16, 12, 10, 11]
    assert search_multiple(5, lambda k: (True, 0.0))[0] == 5  # the whole window fits: no larger budget helps
    with pytest.raises(UserError) as info:
        search_multiple(5, lambda k: (False, 0.0))
    assert_one_line_user_error(info.value, "micro_tokens=auto: not even the longest training sample alone fits")


@pytest.mark.slow
def test_micro_tokens_auto_finds_the_largest_budget_that_fits_and_keeps_the_global_batch(tmp_path, monkeypatch):
    (tmp_path / "tokmodel.py").write_text(TOKEN_OOM_MODEL)
    monkeypatch.syspath_prepend(tmp_path)
    args = [a for a in lm_args(tmp_path) if not a.startswith(("model.", "+model."))]
    args = [a for a in args if a != "model=hf_causal_lm"] + ["model=custom", "model._target_=tokmodel.Net",
                                                             "loss.shift_labels=true", "loss.normalize=tokens"]
    longest = 55  # the longest line of lm_args' data, in byte tokens with its end
    auto, log = train_here(tmp_path, "runs/auto", *args, "micro_tokens=auto", "global_batch=16",
                           "trainer.memory_budget_mb=1000000")
    assert re.search(rf"micro_tokens=auto: trial steps {longest}: fits \(\d+ MiB\); {2 * longest}: fits \(\d+ MiB\); "
                     rf"{4 * longest}: does not fit; {3 * longest}: fits", log)  # 3 rows of 55 = 165 ≤ 200 < 220
    assert f"cut into micro-batches of at most {3 * longest} padded tokens" in log
    assert "effective batch 16" in log
    fixed, _ = train_here(tmp_path, "fixed", *args, f"micro_tokens={3 * longest}", "global_batch=16")
    assert_identical(final_weights(auto), final_weights(fixed))  # the trials left no trace
    steps, _ = train_here(tmp_path, "steps", *args, "micro_batch=4", "accum=4", "+model.limit=100000")
    for key, value in final_weights(steps).items():
        torch.testing.assert_close(value, final_weights(auto)[key], rtol=1e-5, atol=1e-6)
    assert [r["samples"] for r in read_metrics(auto)[0]] == [r["samples"] for r in read_metrics(steps)[0]]
    _, again = train_here(tmp_path, "runs/again", *args, "micro_tokens=auto", "global_batch=16",
                          "trainer.memory_budget_mb=1000000")
    assert f"micro_tokens=auto: {3 * longest}, cached in" in again and "trial steps" not in again
