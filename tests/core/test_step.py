"""The one formula: the accumulated gradient is the gradient of the window's mean loss."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accutrain.core.batches import Batch
from accutrain.core.step import accumulate, evaluate, grad_norm, micro_steps


def model_and_data(n=14, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x = torch.randn(n, 5, dtype=torch.float64)
    y = torch.randint(3, (n,))
    return model, x, y


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def big_batch_grad(model, x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return grads(model)


@pytest.mark.quick
def test_accumulated_gradient_equals_big_batch_on_a_short_tail():
    model, x, y = model_and_data(n=14)  # micro-batches of 4: 4, 4, 4, 2
    expected = big_batch_grad(model, x, y)
    model.zero_grad(set_to_none=True)
    chunks = list(zip(x.split(4), y.split(4)))
    loss_sum = accumulate(model, chunks, terms=14, device=torch.device("cpu"))
    for g, e in zip(grads(model), expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss_sum.sum() / 14, F.cross_entropy(model(x), y).detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.quick
def test_dividing_by_accum_would_be_wrong_on_a_short_tail():
    """The naive recipe (mean loss per micro-batch / accum) over-weights the short micro-batch."""
    model, x, y = model_and_data(n=14)
    expected = big_batch_grad(model, x, y)
    model.zero_grad(set_to_none=True)
    chunks = list(zip(x.split(4), y.split(4)))
    for xb, yb in chunks:
        (F.cross_entropy(model(xb), yb) / len(chunks)).backward()
    assert not all(torch.allclose(g, e) for g, e in zip(grads(model), expected))


def test_world_scale_undoes_ddp_averaging():
    """Each rank scales by world/|W|: averaging the ranks' gradients gives the window's mean gradient."""
    model, x, y = model_and_data(n=10)
    expected = big_batch_grad(model, x, y)
    per_rank = []
    for part_x, part_y in ((x[:7], y[:7]), (x[7:], y[7:])):  # uneven ranks: 7 and 3 samples
        model.zero_grad(set_to_none=True)
        accumulate(model, [(part_x, part_y)], terms=10, device=torch.device("cpu"), world=2)
        per_rank.append(grads(model))
    for a, b, e in zip(*per_rank, expected):
        torch.testing.assert_close((a + b) / 2, e, rtol=1e-12, atol=1e-12)


def test_no_sync_on_every_micro_batch_but_the_last():
    model, x, y = model_and_data(n=12)
    entered = []

    class Recorder:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    chunks = list(zip(x.split(4), y.split(4)))
    accumulate(model, chunks, 12, torch.device("cpu"), no_sync=Recorder)
    assert len(entered) == len(chunks) - 1


def test_micro_steps_skip_stand_ins_but_the_synchronising_one():
    """The one rule both one-pass and two-pass accumulation walk: a stand-in (an empty share of a short window) runs
    only when it is the last micro-batch, whose backward all-reduces; the last always synchronises."""
    x, y = torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64)
    real, stand_in = Batch(x, y), Batch(x, y, stand_in=True)
    walk = lambda *batches: [(b.stand_in, last) for b, last in micro_steps(batches)]  # noqa: E731
    assert walk(real, real) == [(False, False), (False, True)]
    assert walk(real, stand_in) == [(False, False), (True, True)]  # forwarded: the all-reduce happens
    assert walk(stand_in, stand_in, real) == [(False, True)]  # skipped: nothing to synchronise there
    assert walk(stand_in) == [(True, True)]
    assert walk() == []


def test_grad_norm_measures_before_clipping():
    model, x, y = model_and_data()
    big_batch_grad(model, x, y)
    params = list(model.parameters())
    norm = grad_norm(params, None)
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))
    torch.testing.assert_close(norm, expected)
    clipped_from = grad_norm(params, float(norm) / 2)
    torch.testing.assert_close(clipped_from, expected)
    torch.testing.assert_close(grad_norm(params, None), expected / 2, rtol=1e-5, atol=0)  # clip_grad_norm_ adds 1e-6


def test_evaluate_sums_are_sample_weighted_whatever_the_batch():
    model, x, y = model_and_data(n=10)
    full = evaluate(model, [(x, y)], torch.device("cpu"))
    split = evaluate(model, list(zip(x.split(3), y.split(3))), torch.device("cpu"))
    torch.testing.assert_close(full, split, rtol=1e-6, atol=1e-6)
    assert full[2] == 10 and 0 <= full[1] <= 10
    torch.testing.assert_close(full[0] / 10, F.cross_entropy(model(x), y).detach(), rtol=1e-6, atol=1e-6)
    assert model.training


def test_a_kept_backward_seed_gives_the_bits_of_a_multiply():
    """Precision.backward seeds with weight × ones, kept while the weight stays: micro-batches of two windows
    (weights 1/7, then 1/5) and a stand-in's 0 in between give, bit for bit, the gradients of (loss × weight)."""
    from accutrain.core.precision import make_precision

    precision = make_precision("32", torch.device("cpu"))
    model, x, y = model_and_data(n=12)
    for weight, part in [(1 / 7, slice(0, 4)), (1 / 7, slice(4, 7)), (0.0, slice(7, 9)), (1 / 5, slice(9, 12))]:
        loss = F.cross_entropy(model(x[part]), y[part], reduction="sum")
        (loss * weight).backward()
        expected = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        precision.backward(F.cross_entropy(model(x[part]), y[part], reduction="sum"), weight)
        assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
        model.zero_grad(set_to_none=True)
    assert precision._seed[0] == 1 / 5 and precision._seed[1].item() == 1 / 5  # the last window's, in float64
