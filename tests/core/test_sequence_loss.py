"""loss.normalize=sequences: the window's loss is the mean over its sequences of each sequence's mean over its
tokens (after the shift, less ignore_index), whatever the split into micro-batches."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accutrain.core.batches import Batch
from accutrain.core.losses.cross_entropy import SummedLoss, make_loss
from accutrain.core.options import Normalize
from accutrain.core.step import accumulate

VOCAB = 11


def window():
    """8 sequences of 2–9 tokens padded to 9 (labels -100 there), one whose only real token is its first (after the
    shift it has no target: it adds 0 and still counts as a sequence), and a masked prompt in another."""
    g = torch.Generator().manual_seed(0)
    lengths = [2, 9, 5, 1, 7, 3, 8, 4]
    ids = torch.randint(VOCAB, (8, 9), generator=g)
    labels = ids.clone()
    for i, n in enumerate(lengths):
        labels[i, n:] = -100
    labels[1, :4] = -100  # a prompt
    return ids, labels


def reference_gradient(model, ids, labels):
    """∇ of mean_s mean_t ℓ_st, written out."""
    model.zero_grad()
    logits = model(ids).transpose(1, 2)
    target = F.pad(labels[:, 1:], (0, 1), value=-100)
    per_token = F.cross_entropy(logits, target, reduction="none", ignore_index=-100)
    means = per_token.sum(1) / (target != -100).sum(1).clamp(min=1)
    means.mean().backward()
    return [p.grad.clone() for p in model.parameters()]


class TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 6), nn.Linear(6, VOCAB)

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)))


@pytest.mark.parametrize("sizes", [[8], [4, 4], [1] * 8, [3, 5], [2, 1, 5]])
def test_the_per_sequence_mean_is_the_same_under_any_split(sizes):
    torch.manual_seed(0)
    model = TokenModel()
    ids, labels = window()
    expected = reference_gradient(model, ids, labels)
    loss = make_loss(Normalize.sequences, -100, shift_labels=True)
    assert loss.per_sequence and not loss.elements and loss.terms([Batch(ids, labels)]) == 8  # |W|: the sequences
    model.zero_grad()
    parts, start = [], 0
    for n in sizes:
        parts.append(Batch(ids[start:start + n], labels[start:start + n]))
        start += n

    def layout(logits, target):
        return loss(logits.transpose(1, 2), target)

    accumulate(model, parts, terms=8, device=torch.device("cpu"), loss=layout)
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-5, atol=1e-7)


def test_it_differs_from_the_token_mean_and_weighs_each_sequence_alike():
    ids, labels = window()
    logits = TokenModel()(ids).transpose(1, 2)
    per_sequence = SummedLoss(True, -100, True, per_sequence=True)(logits, labels) / 8
    tokens = SummedLoss(True, -100, True)(logits, labels) / SummedLoss(True, -100, True).terms([Batch(ids, labels)])
    assert not torch.allclose(per_sequence, tokens)
    short = SummedLoss(True, -100, True, per_sequence=True)(logits[:1], labels[:1])  # one target: its token's loss
    assert torch.allclose(short, F.cross_entropy(logits[:1, :, 0], labels[:1, 1]))


@pytest.mark.parametrize("normalize, shift, monitored", [
    (Normalize.sequences, True, "val_loss"), (Normalize.tokens, True, "val_loss"), (Normalize.samples, False, "val_acc"),
])
def test_a_language_model_follows_its_loss_however_it_is_normalised(normalize, shift, monitored):
    """trainer.monitor=auto: a per-sequence mean over tokens is still a language model's loss, not a classifier's."""
    assert make_loss(normalize, -100, shift).monitor == monitored
