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
from contextlib import nullcontext
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Callable, ContextManager, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from accutrain.core.batches import Batch, as_batch
from accutrain.core.embedding_checks import check_distinct
from accutrain.core.gradcache import accumulate_window_loss, evaluate_window, one_pass, wide
from accutrain.core.precision import Precision
from accutrain.errors import UserError

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
class ContrastiveLoss:
    """The loss of `loss=contrastive`. `window`: the loss over the whole window (exact); false: over each
    micro-batch alone (the naive accumulation, for comparison). A Loss (accutrain.core.loss) whose window is two
    passes (accutrain.core.gradcache) and whose evaluation takes the whole held-out split as one candidate set."""

    temperature: float = 0.07
    symmetric: bool = True
    learn_temperature: bool = False
    window: bool = True
    mask_duplicates: bool = False
    head: Optional[Temperature] = field(default=None, repr=False)  # learn_temperature: set by attach()
    name = "contrastive"
    elements = False
    tokens = False
    task = "contrastive"
    ignore_index = -100
    monitor = "val_ndcg10"
    min_window = 2  # one pair has no negative: its loss is 0 whatever the weights
    whole_window = True
    output = "embeddings"  # the model returns one embedding per input

    def scale(self) -> torch.Tensor | float:
        return self.head.scale() if self.head is not None else 1.0 / self.temperature

    def target(self, labels: torch.Tensor) -> torch.Tensor:
        return labels

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

    def embed(self, model: nn.Module, batch: Batch, cast: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
              ) -> torch.Tensor:
        return embed(model, batch, cast)

    def pieces(self, model: nn.Module, batch: Batch, cast: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
               ) -> list[tuple[slice, Callable[[], torch.Tensor]]]:
        """Pass 2's forwards of a micro-batch: a text sample's roles one at a time (only one role's activations alive
        at once: an anchor, positive and negative cost what one text does), image views together."""
        if not isinstance(batch.inputs, Mapping):
            return [(slice(None), lambda: embed(model, batch, cast))]
        n = len(batch.target)
        return [(slice(j, j + 1), lambda inputs=inputs: one_per_input(
                    model(**{k: cast(v) for k, v in inputs.items()}), n)[:, None])
                for j, (_, inputs) in enumerate(roles(batch.inputs))]

    def keys(self, batch: Batch) -> torch.Tensor:
        """Each candidate's key (N, R − 1): the data's text keys for text pairs, the class for image views. A copy:
        kept for the whole window, the batch's own target (allocated beside its inputs) would keep the heap from
        reusing their memory — measured, +840 MiB over a window of 4,096 image pairs."""
        keys = batch.target.to(torch.int64, copy=True)
        return keys if keys.dim() == 2 else keys[:, None]

    def empty_rows(self, device: torch.device) -> torch.Tensor:
        return torch.zeros((0, 2, 1), device=device)

    def eval_rows(self, embeddings: torch.Tensor, rows: slice, keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float64 [summed loss, samples, recall@1, recall@10, reciprocal rank@10, NDCG@10] of the samples `rows`,
        every candidate of `embeddings` (the held-out split's, gathered from every rank) the corpus: the rank of a
        sample's positive among them (its duplicates masked with loss.mask_duplicates) decides the retrieval
        metrics; with one relevant candidate, NDCG@10 is 1 / log2(1 + rank) within the top 10."""
        with torch.no_grad():
            loss = self.per_sample(embeddings, rows, keys)
            forward, positive, _ = self.logits(embeddings, rows, keys)
            target = forward.gather(1, positive[:, None])
            rank = 1 + (forward > target).sum(1).double()  # ties count in the positive's favour
            top10 = rank <= 10
            sums = [loss.double().sum(), torch.tensor(float(len(loss)), dtype=torch.float64, device=loss.device),
                    (rank <= 1).double().sum(), top10.double().sum(), (top10 / rank).sum(),
                    (top10 / torch.log2(1 + rank)).sum()]
        return torch.stack(sums)

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        """val_loss (over the whole held-out split as one set) and the retrieval metrics of each held-out anchor
        against every held-out candidate: val_recall1, val_recall10, val_mrr10, val_ndcg10."""
        loss, n, hits1, hits10, rr10, ndcg10 = sums
        return {"val_loss": loss / n, "val_recall1": hits1 / n, "val_recall10": hits10 / n, "val_mrr10": rr10 / n,
                "val_ndcg10": ndcg10 / n}

    # --- the Loss protocol ---------------------------------------------------------------------------------------
    def terms(self, micro_batches: Iterable[Batch | Sequence[torch.Tensor]]) -> int:
        return sum(len(as_batch(b)) for b in micro_batches)

    def accumulate(self, model: nn.Module, micro_batches: Iterable[Batch | Sequence[torch.Tensor]], terms: int,
                   device: torch.device, *, world: int = 1, no_sync: Callable[[], ContextManager] = nullcontext,
                   precision: Optional[Precision] = None, observe: Optional[Callable[[int], None]] = None
                   ) -> torch.Tensor:
        """Two passes (gradient caching); `observe` (the noise scale's) never comes: the refusal table refuses it."""
        return accumulate_window_loss(model, micro_batches, terms, device, self, world=world, no_sync=no_sync,
                                      precision=precision)

    def evaluate(self, model: nn.Module, loader: Iterable, device: torch.device, precision: Precision,
                 world: int) -> torch.Tensor:
        return evaluate_window(model, loader, device, precision, self, world)

    def reference(self, model: nn.Module, batch: Batch, device: torch.device, precision: Precision) -> torch.Tensor:
        return one_pass(model, batch, len(as_batch(batch)), self, device, precision)

    def probe(self, batch: Batch) -> Batch:
        """The batch as the model takes it, one input per row: every view of image pairs (each sample's target
        repeated); the anchors of text pairs."""
        if isinstance(batch.inputs, Mapping):
            anchor = {key: value for key, value in roles(batch.inputs)[0][1].items()}
            return Batch(anchor, batch.target[:, 0] if batch.target.dim() == 2 else batch.target, batch.stand_in)
        views = batch.inputs.shape[1]
        return Batch(batch.inputs.flatten(0, 1), batch.target.repeat_interleave(views, 0), batch.stand_in)

    def notes(self, batch: Batch) -> list[str]:
        return []

    def check(self, model: nn.Module, batch: Batch, data: str) -> None:
        """The pairs reach the model as pairs, an embedding per view, two different texts embedded apart."""
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                check_distinct(embed(model, batch), batch.inputs, roles)
        finally:
            model.train(training)

    def attach(self, model: nn.Module) -> list[str]:
        """A learnt temperature becomes a parameter of the model (`contrastive_logit_scale`): the optimizer steps it,
        checkpoints hold it, DDP reduces it."""
        if self.learn_temperature:
            first = next(model.parameters())
            self.head = Temperature(self.temperature).to(device=first.device, dtype=torch.float32)
            model.register_parameter(HEAD, self.head.logit_scale)  # not a module: an nn.Sequential would call it
        if not self.window:
            return ["loss.window=false: each micro-batch's contrastive loss has only its own samples as negatives, so "
                    "the accumulated step is NOT the big batch's (for comparison only; loss.window=true is exact)"]
        return []

    def figures(self) -> dict[str, torch.Tensor]:
        return {}

    def summary(self, figures: dict[str, float]) -> str:
        return ""

    def components(self) -> dict[str, ContrastiveLoss]:
        return {}


def roles(inputs: Mapping[str, torch.Tensor]) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """A text sample's roles in order (anchor, positive, negative.0, …) with each one's model inputs: the keys
    `<role>.<input>` of the batch's mapping, the role's prefix taken off."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in inputs.items():
        role, _, name = key.rpartition(".")
        found.setdefault(role, {})[name] = value
    order = {"anchor": 0, "positive": 1}
    return sorted(found.items(), key=lambda item: (order.get(item[0], 2), item[0].split(".")[-1].zfill(6)))


def embed(model: nn.Module, batch: Batch, cast: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> torch.Tensor:
    """The micro-batch's embeddings (N, R, D): image views through the model as one batch of N × R, or each text
    role (anchor, positive, negatives) through the model on its own."""
    x = batch.inputs
    if isinstance(x, Mapping):
        parts = roles(x)
        if [role for role, _ in parts[:2]] != ["anchor", "positive"] or any(not role for role, _ in parts):
            raise UserError(f"loss=contrastive needs an anchor and a positive per sample (inputs anchor.*, "
                            f"positive.*); this data's inputs are {', '.join(x)}: set data.columns.anchor and "
                            "data.columns.positive (docs/embeddings.md)")
        out = [one_per_input(model(**{k: cast(v) for k, v in inputs.items()}), len(batch.target)) for _, inputs in
               parts]
        return torch.stack(out, 1)
    if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.shape[1] < 2:
        raise UserError("loss=contrastive needs pairs per sample: two views of each image (inputs (samples, 2, …): "
                        "set augment.views=2, with a random augment=) or text pairs (data.columns.anchor, "
                        "data.columns.positive)")
    return one_per_input(model(cast(x.flatten(0, 1))), len(x) * x.shape[1]).unflatten(0, (len(x), x.shape[1]))


def one_per_input(out: Any, n: int) -> torch.Tensor:
    """The model's output if it is one embedding per input, (n, dim); else one line."""
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or len(out) != n:
        raise UserError(f"loss=contrastive needs an embedding per input, (samples, dim), from the model; it returns "
                        f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__} for {n} inputs")
    return out


def contrastive(temperature: float = 0.07, symmetric: bool = True, learn_temperature: bool = False,
                window: bool = True, mask_duplicates: bool = False, ignore_index: int = -100) -> ContrastiveLoss:
    """loss=contrastive's factory (`loss._target_`); ignore_index is unused (the data's padding default reads it)."""
    if not temperature > 0:
        raise UserError(f"loss.temperature={temperature} is not valid: expected a positive temperature (e.g. 0.07)")
    return ContrastiveLoss(temperature, symmetric, learn_temperature, window, mask_duplicates)
