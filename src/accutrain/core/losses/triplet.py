"""loss=triplet: the batch-hard triplet margin loss over the WHOLE window (every micro-batch, every rank), exact under
any split by gradient caching (accutrain.core.losses.window).

Sample i's loss, over a window of N samples with anchors a_i, positives p_i and mined negatives n_ik (zero or more):

    loss_i = max(0, margin + d(a_i, p_i) − min_{c ∈ C_i} d(a_i, c))

where C_i is every candidate of the window but a_i's own positive — the other samples' positives and every mined
negative — so each anchor meets the hardest negative of the whole window (Hermans et al. 2017, "In Defense of the
Triplet Loss", batch-hard, with the window as the batch). d is the cosine distance 1 − cos, or the euclidean ‖a − b‖.
The minimum depends on every other sample: a micro-batch alone would find a softer negative, which is why the window
is seen whole. Held out: val_loss over the split as one set, and the retrieval metrics of each anchor's positive
ranked by distance among every candidate of the split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from accutrain.core.gradcache import wide
from accutrain.core.losses import triplet_spec as spec
from accutrain.core.losses.window import WindowLoss, retrieval_sums


@dataclass
class TripletLoss(WindowLoss):
    """loss=triplet (a WindowLoss). `window`: false takes each micro-batch's own hardest negatives (for comparison)."""

    margin: float = 0.2
    distance: str = "cosine"
    window: bool = True
    name = "triplet"
    task = "contrastive"
    monitor = "val_ndcg10"

    def distances(self, embeddings: torch.Tensor, rows: Optional[slice] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the anchors of `rows` × every candidate of the window, each anchor's positive's column): d(a_i, c)."""
        z = wide(embeddings)
        n, r = z.shape[0], z.shape[1]
        rows = rows or slice(0, n)
        anchors, candidates = z[rows, 0], z[:, 1:].flatten(0, 1)  # sample j's positive at column j·(r − 1)
        if self.distance == "cosine":
            d = 1 - F.normalize(anchors, dim=-1) @ F.normalize(candidates, dim=-1).T
        else:  # ‖a − c‖ from the Gram matrix, clamped at 0 against rounding (and its gradient kept finite)
            squared = anchors.square().sum(-1, keepdim=True) - 2 * anchors @ candidates.T + \
                candidates.square().sum(-1)[None, :]
            d = squared.clamp_min(1e-12).sqrt()
        return d, torch.arange(n, device=z.device)[rows] * (r - 1)

    def per_sample(self, embeddings: torch.Tensor, rows: Optional[slice] = None, keys: Optional[torch.Tensor] = None
                   ) -> torch.Tensor:
        d, positive = self.distances(embeddings, rows)
        own = d.gather(1, positive[:, None])[:, 0]
        hardest = d.scatter(1, positive[:, None], float("inf")).amin(1)  # every candidate but the own positive
        return (self.margin + own - hardest).clamp_min(0)

    def eval_rows(self, embeddings: torch.Tensor, rows: slice, keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float64 [summed loss, samples, recall@1, recall@10, reciprocal rank@10, NDCG@10] of the samples `rows`,
        every candidate of the held-out split ranked by its distance to the anchor."""
        with torch.no_grad():
            loss = self.per_sample(embeddings, rows, keys)
            d, positive = self.distances(embeddings, rows)
            sums = [loss.double().sum(), torch.tensor(float(len(loss)), dtype=torch.float64, device=loss.device),
                    *retrieval_sums(-d, positive)]
        return torch.stack(sums)

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        loss, n, hits1, hits10, rr10, ndcg10 = sums
        return {"val_loss": loss / n, "val_recall1": hits1 / n, "val_recall10": hits10 / n, "val_mrr10": rr10 / n,
                "val_ndcg10": ndcg10 / n}


def triplet(margin: float = 0.2, distance: str = "cosine", window: bool = True, ignore_index: int = -100
            ) -> TripletLoss:
    """loss=triplet's factory (`loss._target_`); ignore_index is unused (the data's padding default reads it)."""
    spec.ranges(dict(margin=margin, distance=distance))
    return TripletLoss(float(margin), distance, window)
