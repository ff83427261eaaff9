"""loss=contrastive: InfoNCE with in-batch negatives over the WHOLE window's embeddings (every micro-batch, every
rank), which gradient caching (accutrain.core.gradcache) makes exact under any split.

A sample is a row of texts or views embedded by the model: an anchor, its positive, and zero or more mined (hard)
negatives — (N, R, D) embeddings, R = 2 + negatives. Images make it from two random views of each image
(augment.views=2: inputs (N, 2, …)); text pairs and triples (data.columns.anchor / positive / negative) from one
tokenized text per role (inputs `anchor.input_ids`, `positive.input_ids`, `negative.0.input_ids`, …, each role
embedded by the model on its own). Embeddings are compared by cosine similarity × a scale (1 / loss.temperature, or
a learnt exp(logit_scale)). Sample i's loss over a set of N samples: the cross-entropy of its anchor against every
candidate of the set — every sample's positive and every sample's negatives, N × (R - 1) — its own positive the
target; symmetric (CLIP), the mean of that and its positive against every anchor. Each sample's loss has the whole
set in its denominator: that is why a sum over micro-batches is not the big batch's loss, and why the window is seen
whole. loss.mask_duplicates leaves out of an anchor's candidates those whose text equals its positive's (another
sample's copy of it: a false negative), by the candidates' keys (a hash of each text; for image views, the class).
The similarity matrix of a window of N samples is N × N(R − 1) floats (4 bytes each: 64 MiB at N = 4,096 with R = 2,
512 MiB with R = 9, about three times that with its softmax and gradient); it is never held whole: the loss and its
gradient are taken a block of anchors at a time (accutrain.core.gradcache.blocks: 4 MiB of similarities each), so
the window's memory is its embeddings (N × R × D floats) and one block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from accutrain.core.gradcache import wide
from accutrain.core.losses import contrastive_spec as spec
from accutrain.core.losses.window import WindowLoss, retrieval_sums

HEAD = "contrastive_logit_scale"  # the learnt temperature, as a parameter of the model (stepped, checkpointed)


class Temperature(nn.Module):
    """The learnt scale of the similarities, as CLIP learns it: logit_scale = log(1 / τ), the scale exp(·) capped
    at 100."""

    def __init__(self, temperature: float) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / temperature)))

    def scale(self) -> torch.Tensor:
        return self.logit_scale.exp().clamp(max=100.0)


@dataclass
class ContrastiveLoss(WindowLoss):
    """The loss of `loss=contrastive`. `window`: the loss over the whole window (exact); false: over each
    micro-batch alone (the naive accumulation, for comparison). A WindowLoss: its window is two passes
    (accutrain.core.gradcache) and its evaluation takes the whole held-out split as one candidate set."""

    temperature: float = 0.07
    symmetric: bool = True
    learn_temperature: bool = False
    window: bool = True
    mask_duplicates: bool = False
    head: Optional[Temperature] = field(default=None, repr=False)  # learn_temperature: set by attach()
    name = "contrastive"
    task = "contrastive"
    monitor = "val_ndcg10"

    def scale(self) -> torch.Tensor | float:
        return self.head.scale() if self.head is not None else 1.0 / self.temperature

    # --- the maths -------------------------------------------------------------------------------------------
    def logits(self, embeddings: torch.Tensor, rows: Optional[slice] = None, keys: Optional[torch.Tensor] = None
               ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(anchors of `rows` × every candidate, each anchor's positive's column, positives of `rows` × every anchor
        — symmetric only): scaled cosine similarities, duplicates of each positive masked out with `keys`."""
        z = F.normalize(wide(embeddings), dim=-1)
        n, r = z.shape[0], z.shape[1]
        rows = rows or slice(0, n)
        candidates = z[:, 1:].flatten(0, 1)  # sample j's positive at column j·(r − 1), its negatives after it
        positive = torch.arange(n, device=z.device)[rows] * (r - 1)
        forward = z[rows, 0] @ candidates.T * self.scale()
        backward = z[rows, 1] @ z[:, 0].T * self.scale() if self.symmetric else None
        if self.mask_duplicates and keys is not None:
            own = keys[:, 0][rows]  # each anchor's positive's key
            same = (own[:, None] == keys.flatten()[None, :])
            same[torch.arange(len(own), device=z.device), positive] = False  # its own positive stays the target
            forward = forward.masked_fill(same, float("-inf"))
            if backward is not None:  # another anchor whose positive is a copy of this one is not a negative
                twins = own[:, None] == keys[:, 0][None, :]
                twins[torch.arange(len(own), device=z.device), torch.arange(n, device=z.device)[rows]] = False
                backward = backward.masked_fill(twins, float("-inf"))
        return forward, positive, backward

    def per_sample(self, embeddings: torch.Tensor, rows: Optional[slice] = None, keys: Optional[torch.Tensor] = None
                   ) -> torch.Tensor:
        """Each sample's InfoNCE loss against every candidate of `embeddings` (N, R, D); `rows`: only those samples'
        losses (the candidates stay all of them)."""
        forward, positive, backward = self.logits(embeddings, rows, keys)
        loss = F.cross_entropy(forward, positive, reduction="none")
        if backward is not None:
            own = torch.arange(len(embeddings), device=forward.device)[rows or slice(0, len(embeddings))]
            loss = (loss + F.cross_entropy(backward, own, reduction="none")) / 2
        return loss

    def eval_rows(self, embeddings: torch.Tensor, rows: slice, keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float64 [summed loss, samples, recall@1, recall@10, reciprocal rank@10, NDCG@10] of the samples `rows`,
        every candidate of `embeddings` (the held-out split's, gathered from every rank) the corpus: the rank of a
        sample's positive among them (its duplicates masked with loss.mask_duplicates) decides the retrieval
        metrics; with one relevant candidate, NDCG@10 is 1 / log2(1 + rank) within the top 10."""
        with torch.no_grad():
            loss = self.per_sample(embeddings, rows, keys)
            forward, positive, _ = self.logits(embeddings, rows, keys)
            sums = [loss.double().sum(), torch.tensor(float(len(loss)), dtype=torch.float64, device=loss.device),
                    *retrieval_sums(forward, positive)]
        return torch.stack(sums)

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        """val_loss (over the whole held-out split as one set) and the retrieval metrics of each held-out anchor
        against every held-out candidate: val_recall1, val_recall10, val_mrr10, val_ndcg10."""
        loss, n, hits1, hits10, rr10, ndcg10 = sums
        return {"val_loss": loss / n, "val_recall1": hits1 / n, "val_recall10": hits10 / n, "val_mrr10": rr10 / n,
                "val_ndcg10": ndcg10 / n}

    def attach(self, model: nn.Module) -> list[str]:
        """A learnt temperature becomes a parameter of the model (`contrastive_logit_scale`): the optimizer steps it,
        checkpoints hold it, DDP reduces it."""
        if self.learn_temperature:
            first = next(model.parameters())
            self.head = Temperature(self.temperature).to(device=first.device, dtype=torch.float32)
            model.register_parameter(HEAD, self.head.logit_scale)  # not a module: an nn.Sequential would call it
        return super().attach(model)


def contrastive(temperature: float = 0.07, symmetric: bool = True, learn_temperature: bool = False,
                window: bool = True, mask_duplicates: bool = False, ignore_index: int = -100) -> ContrastiveLoss:
    """loss=contrastive's factory (`loss._target_`); ignore_index is unused (the data's padding default reads it)."""
    spec.temperature(dict(temperature=temperature))
    return ContrastiveLoss(temperature, symmetric, learn_temperature, window, mask_duplicates)
