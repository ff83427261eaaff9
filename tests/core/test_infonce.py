"""loss=contrastive's formula itself, against a hand-written float64 InfoNCE (no tensor tricks: a loop over anchors,
log-sum-exp by hand): the loss and its gradient with mined negatives, one-sided and symmetric, with duplicates
masked; and the retrieval metrics against ranks counted by hand."""
import math

import pytest
import torch

from accutrain.core.batches import Batch
from accutrain.core.gradcache import accumulate_window_loss, one_pass
from accutrain.core.losses.contrastive import ContrastiveLoss

SCALE = 1 / 0.1


def cosine(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return (u * v).sum() / (u.norm() * v.norm())


def reference(z: torch.Tensor, symmetric: bool, keys: torch.Tensor = None) -> torch.Tensor:
    """Σ_i loss_i over N samples of rows (anchor, positive, negatives…): anchor i against every positive and every
    negative of the set, its own positive the target; symmetric: the mean of that and positive i against every
    anchor. With `keys`, a candidate whose key is anchor i's positive's (but its positive itself) is left out."""
    n, r = z.shape[0], z.shape[1]
    total = torch.zeros((), dtype=torch.float64)
    for i in range(n):
        scores, target = [], None
        for j in range(n):
            for k in range(1, r):
                if j == i and k == 1:
                    target = len(scores)
                elif keys is not None and keys[j, k - 1] == keys[i, 0]:
                    continue
                scores.append(SCALE * cosine(z[i, 0], z[j, k]))
        forward = -(scores[target] - torch.logsumexp(torch.stack(scores), 0))
        if not symmetric:
            total = total + forward
            continue
        back = [SCALE * cosine(z[i, 1], z[j, 0]) for j in range(n)
                if j == i or keys is None or keys[j, 0] != keys[i, 0]]
        own = sum(1 for j in range(i) if keys is None or keys[j, 0] != keys[i, 0])
        backward = -(back[own] - torch.logsumexp(torch.stack(back), 0))
        total = total + (forward + backward) / 2
    return total


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("negatives", [0, 1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_the_loss_and_its_gradient_are_the_hand_written_infonce(symmetric, negatives, masked):
    g = torch.Generator().manual_seed(negatives + 7 * symmetric)
    z = torch.randn(9, 2 + negatives, 5, generator=g, dtype=torch.float64)
    keys = torch.randint(0, 1000, (9, 1 + negatives), generator=g)
    if masked:  # sample 4's positive is a copy of sample 1's; sample 6 has a negative that is a copy of it too
        keys[4, 0] = keys[1, 0]
        if negatives:
            keys[6, 1] = keys[1, 0]
    loss = ContrastiveLoss(0.1, symmetric, mask_duplicates=masked)
    ours = z.detach().clone().requires_grad_()
    theirs = z.detach().clone().requires_grad_()
    got = loss.per_sample(ours, keys=keys).sum()
    expected = reference(theirs, symmetric, keys if masked else None)
    got.backward()
    expected.backward()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-10, atol=1e-12)


def test_masking_changes_the_loss_only_where_a_duplicate_is():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(6, 3, 4, generator=g, dtype=torch.float64)
    keys = torch.arange(12).reshape(6, 2)
    loss = ContrastiveLoss(0.1, mask_duplicates=True)
    plain = loss.per_sample(z, keys=keys)
    keys[2, 0] = keys[0, 0]  # sample 2's positive is sample 0's text
    masked = loss.per_sample(z, keys=keys)
    assert torch.equal(plain[[1, 3, 4, 5]], masked[[1, 3, 4, 5]])
    assert (masked[[0, 2]] < plain[[0, 2]]).all()  # one candidate fewer in their denominators


def test_mined_negatives_in_micro_batches_give_the_window_gradient():
    """Gradient caching with triples (anchor, positive, two negatives), cut 4 | 4 | 3: the one-pass gradient."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double()
    x = torch.randn(11, 4, 6, dtype=torch.float64)  # 11 samples of 4 rows: embedded as image views are
    y = torch.randint(0, 50, (11, 3))
    loss = ContrastiveLoss(0.1, mask_duplicates=True)
    one_pass(model, Batch(x, y), 11, loss, torch.device("cpu"))
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    accumulate_window_loss(model, [Batch(a, b) for a, b in zip(x.split(4), y.split(4))], 11, torch.device("cpu"),
                           loss)
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-10, atol=1e-13)


def test_retrieval_metrics_are_the_ranks_counted_by_hand():
    g = torch.Generator().manual_seed(5)
    z = torch.randn(30, 3, 4, generator=g, dtype=torch.float64)
    z[:, 1] = z[:, 0] + 0.8 * z[:, 1]  # positives near their anchors: some first, some further down
    loss = ContrastiveLoss(0.1)
    sums = loss.eval_rows(z, slice(0, 30))
    ranks = []
    for i in range(30):
        target = cosine(z[i, 0], z[i, 1])
        better = sum(int(cosine(z[i, 0], z[j, k]) > target) for j in range(30) for k in (1, 2))
        ranks.append(1 + better)
    metrics = loss.eval_metrics(sums.tolist())
    assert metrics["val_recall1"] == pytest.approx(sum(r == 1 for r in ranks) / 30)
    assert metrics["val_recall10"] == pytest.approx(sum(r <= 10 for r in ranks) / 30)
    assert metrics["val_mrr10"] == pytest.approx(sum(1 / r for r in ranks if r <= 10) / 30)
    assert metrics["val_ndcg10"] == pytest.approx(sum(1 / math.log2(1 + r) for r in ranks if r <= 10) / 30)
    assert metrics["val_loss"] == pytest.approx(float(reference(z, True)) / 30)
    assert 0 < metrics["val_recall1"] < metrics["val_recall10"] < 1  # the metrics are not at a bound: they test
