"""loss=contrastive by gradient caching (core/gradcache.py): two passes over micro-batches give the gradient of
ONE differentiable pass over the whole window — with a short tail, a learnt temperature, and dropout replayed."""
import pytest
import torch
from torch import nn

from accutrain.core.batches import Batch
from accutrain.core.gradcache import accumulate_window_loss, one_pass
from accutrain.core.losses.contrastive import ContrastiveLoss, Temperature
from accutrain.core.losses.window import embed

CPU = torch.device("cpu")


def encoder(dropout=0.0, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 6)).double()


def window(n=22):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 2, 12, generator=g, dtype=torch.float64), torch.zeros(n, dtype=torch.int64)


def grads(model, loss):
    found = [p.grad.clone() for p in model.parameters()]
    return found + ([loss.head.logit_scale.grad.clone()] if loss.head is not None else [])


def zero(model, loss):
    model.zero_grad(set_to_none=True)
    if loss.head is not None:
        loss.head.logit_scale.grad = None


def two_pass(model, loss, x, y, size, device=CPU):
    zero(model, loss)
    chunks = [Batch(a, b) for a, b in zip(x.split(size), y.split(size))]
    total = accumulate_window_loss(model, chunks, len(y), device, loss)
    return grads(model, loss), total


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("learn", [False, True])
def test_two_passes_equal_one_pass_over_the_window(symmetric, learn):
    model, (x, y) = encoder(), window()
    loss = ContrastiveLoss(0.1, symmetric, learn)
    if learn:
        loss.head = Temperature(0.1).double()
        with torch.no_grad():
            loss.head.logit_scale += 0.3  # away from its start: the scale enters the gradient
    zero(model, loss)
    summed = one_pass(model, Batch(x, y), len(y), loss, CPU)
    expected = grads(model, loss)
    for size in (8, 5, 22):  # 8, 8, 6 | 5, 5, 5, 5, 2 | the window whole
        got, total = two_pass(model, loss, x, y, size)
        torch.testing.assert_close(total, summed, rtol=1e-12, atol=1e-12)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-13)


def test_naive_per_micro_batch_loss_is_not_the_big_batchs():
    model, (x, y) = encoder(), window()
    exact = two_pass(model, ContrastiveLoss(0.1), x, y, 8)[0]
    naive = two_pass(model, ContrastiveLoss(0.1, window=False), x, y, 8)[0]
    whole = two_pass(model, ContrastiveLoss(0.1, window=False), x, y, 22)[0]  # one micro-batch: the same
    torch.testing.assert_close(whole[0], exact[0], rtol=1e-10, atol=1e-13)
    relative = torch.linalg.vector_norm(naive[0] - exact[0]) / torch.linalg.vector_norm(exact[0])
    assert relative > 0.05


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_dropout_is_replayed_the_second_pass_sees_the_first_pass_masks(device):
    """With dropout on, the window's gradient equals ONE differentiable pass over the same micro-batches drawing
    the same masks (forwarded in turn from the same random state; on a GPU, CUDA's generator's)."""
    device = torch.device(device)
    model, (x, y) = encoder(dropout=0.5).to(device), window()
    x, y = x.to(device), y.to(device)
    loss = ContrastiveLoss(0.1)
    state = torch.get_rng_state if device.type == "cpu" else torch.cuda.get_rng_state
    torch.manual_seed(7)
    got, _ = two_pass(model, loss, x, y, 8, device)
    after = state()

    zero(model, loss)
    torch.manual_seed(7)
    out = torch.cat([embed(model, Batch(a, b)) for a, b in zip(x.split(8), y.split(8))])
    (loss.per_sample(out).sum() / len(y)).backward()
    for g, e in zip(got, grads(model, loss)):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-13)
    assert torch.equal(state(), after)  # the stream goes on as if each micro-batch ran once

    torch.manual_seed(8)  # other masks: another gradient (the test is not blind to dropout)
    other, _ = two_pass(model, loss, x, y, 8, device)
    assert not torch.allclose(other[0], got[0])
