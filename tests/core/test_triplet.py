"""loss=triplet, a family added through the registry alone (its core module, its spec, its yaml, these tests): its
loss and gradient are the hand-written float64 batch-hard formula over the whole window, and micro_batch=4 accum=4
— on one device and on two gloo ranks — ends with the weights of micro_batch=16 (SGD), while each micro-batch's own
hardest negatives (loss.window=false) do not."""
from __future__ import annotations

import pytest
import torch
from conftest import TINY, final_weights, read_metrics, train_here

from accutrain.core.batches import Batch
from accutrain.core.gradcache import accumulate_window_loss, one_pass
from accutrain.core.losses.triplet import TripletLoss


def hand_written(z: torch.Tensor, margin: float, distance: str) -> torch.Tensor:
    """Σ_i max(0, m + d(a_i, p_i) − min over every other candidate c of d(a_i, c)), one anchor at a time."""
    def d(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if distance == "cosine":
            return 1 - (u @ v) / (u.norm() * v.norm())
        return (u - v).norm()

    total = torch.zeros((), dtype=torch.float64)
    n, r = z.shape[0], z.shape[1]
    for i in range(n):
        others = [d(z[i, 0], z[j, k]) for j in range(n) for k in range(1, r) if (j, k) != (i, 1)]
        total = total + torch.clamp(margin + d(z[i, 0], z[i, 1]) - torch.stack(others).min(), min=0)
    return total


@pytest.mark.parametrize("distance", ["cosine", "euclidean"])
@pytest.mark.parametrize("negatives", [0, 2])
def test_the_loss_and_its_gradient_are_the_hand_written_batch_hard_formula(distance, negatives):
    torch.manual_seed(0)
    z = torch.randn(7, 2 + negatives, 5, dtype=torch.float64, requires_grad=True)
    loss = TripletLoss(margin=0.5, distance=distance)
    ours = loss.per_sample(z).sum()
    ref = hand_written(z, 0.5, distance)
    assert 0 < float(ref) and float(ours) == pytest.approx(float(ref), rel=1e-12)
    g_ours, = torch.autograd.grad(ours, z)
    g_ref, = torch.autograd.grad(ref, z)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.quick  # the quick tier's triplet window
def test_micro_batches_give_the_window_gradient_and_per_micro_batch_negatives_do_not():
    """Gradient caching over 3 micro-batches (4, 4, 2) equals one differentiable pass over the window of 10."""
    torch.manual_seed(1)
    model = torch.nn.Linear(6, 4, dtype=torch.float64)
    x, y = torch.randn(10, 2, 6, dtype=torch.float64), torch.arange(10)
    whole = Batch(x, y)

    def grads(run) -> list[torch.Tensor]:
        model.zero_grad()
        run()
        return [p.grad.clone() for p in model.parameters()]

    micro = [Batch(x[s], y[s]) for s in (slice(0, 4), slice(4, 8), slice(8, 10))]
    exact = TripletLoss(margin=1.0)
    big = grads(lambda: one_pass(model, whole, 10, exact, torch.device("cpu")))
    acc = grads(lambda: accumulate_window_loss(model, micro, 10, torch.device("cpu"), exact))
    naive = grads(lambda: accumulate_window_loss(model, micro, 10, torch.device("cpu"), TripletLoss(1.0,
                                                                                                      window=False)))
    for a, b in zip(acc, big):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert max(float((a - b).abs().max()) for a, b in zip(naive, big)) > 1e-4


# 70 samples: windows of 16, 16, 16, 16 and 6 (a short tail); two random views of each image.
PAIRS = [*TINY, "loss=triplet", "augment.views=2", "augment.crop=pad", "augment.padding=1", "data.size=70",
         "data.val_size=24", "trainer.epochs=1", "optim=sgd", "optim.lr=0.5", "loss.margin=0.5"]


def distance(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_accumulated_and_two_ranks_end_with_the_big_batch_weights(tmp_path):
    big, _ = train_here(tmp_path, "big", *PAIRS, "micro_batch=16", "accum=1")
    acc, _ = train_here(tmp_path, "acc", *PAIRS, "micro_batch=4", "accum=4")
    two, _ = train_here(tmp_path, "two", *PAIRS, "devices=2", "micro_batch=4", "accum=2")
    naive, log = train_here(tmp_path, "naive", *PAIRS, "micro_batch=4", "accum=4", "loss.window=false")
    start = train_here(tmp_path, "start", *PAIRS, "micro_batch=16", "trainer.max_steps=1")[0]
    weights = final_weights(big)
    assert distance(final_weights(acc), weights) < 1e-5
    assert distance(final_weights(two), weights) < 1e-5
    assert distance(final_weights(start), weights) > 1e-3  # the weights moved: the equality is not vacuous
    assert distance(final_weights(naive), weights) > 1e-4 and "NOT the big batch's" in log
    steps, evals = read_metrics(acc)
    assert [r["samples"] for r in steps] == [16, 16, 16, 16, 6]
    assert "val_ndcg10" in evals[-1] and evals[-1]["val_loss"] == pytest.approx(read_metrics(big)[1][-1]["val_loss"],
                                                                                  rel=1e-5)
