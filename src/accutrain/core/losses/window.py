"""The base of a loss over the whole window's embeddings: a subclass writes each sample's loss with every sample of
the window a candidate (`per_sample`), and inherits the Loss protocol's members — the window's two passes by gradient
caching (accutrain.core.gradcache: exact under any split of the window into micro-batches and ranks), the held-out
split evaluated as one set, accutrain-check's one-batch reference, the probe, the start-up check.

A sample is a row of embeddings (N, R, D): an anchor, its positive and zero or more mined negatives — text pairs and
triples (inputs `anchor.*`, `positive.*`, `negative.0.*`, …, each role embedded by the model on its own), or two
random views of each image (augment.views=2: inputs (N, 2, …)). loss=contrastive and loss=triplet are built on it, and
so can a user's family (`loss=custom loss._target_=mypkg.MyLoss`: docs/losses.md)."""
from __future__ import annotations

import abc
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Iterable, Optional, Sequence

import torch
from torch import nn

from accutrain.core.batches import Batch, as_batch
from accutrain.core.embedding_checks import check_distinct
from accutrain.core.gradcache import accumulate_window_loss, evaluate_window, one_pass
from accutrain.core.loss import Defaults
from accutrain.core.precision import Precision
from accutrain.errors import UserError

Cast = Callable[[torch.Tensor], torch.Tensor]


class WindowLoss(Defaults, abc.ABC):
    """A family whose sample's loss depends on the whole window. Subclasses give `per_sample(embeddings, rows,
    keys)` — each sample's loss (of `rows`, default all) against every row of `embeddings` (N, R, D) — and may give
    `eval_rows`/`eval_metrics` (default: val_loss over the held-out split as one set) and the traits below."""

    name = "window"  # for messages: loss=<name>
    task = "custom"  # what its evaluation measures (accutrain.config.families: task → metrics)
    monitor = "val_loss"
    whole_window = True
    caches_window = True  # the window's embeddings are kept between the two passes
    output = "embeddings"  # the model returns one embedding per input
    min_window = 2  # a window of one sample has no other sample to compare with
    pairs = True
    elements = False
    tokens = False
    ignore_index = -100
    window = True  # False: each micro-batch's own loss (the naive accumulation, for comparison)
    head: Optional[nn.Module] = None  # a learnt scale with a `logit_scale` parameter (loss=contrastive's), or None

    @abc.abstractmethod
    def per_sample(self, embeddings: torch.Tensor, rows: Optional[slice] = None, keys: Optional[torch.Tensor] = None
                   ) -> torch.Tensor:
        """Each sample's loss (of `rows`, default all; keys: each candidate's, from `keys()`) with every row of
        `embeddings` (N, R, D) a candidate."""

    def target(self, labels: torch.Tensor) -> torch.Tensor:
        return labels

    # --- what gradient caching needs (accutrain.core.gradcache.WindowObjective) ------------------------------------
    def embed(self, model: nn.Module, batch: Batch, cast: Cast = lambda t: t) -> torch.Tensor:
        return embed(model, batch, cast, self.name)

    def pieces(self, model: nn.Module, batch: Batch, cast: Cast = lambda t: t
               ) -> list[tuple[slice, Callable[[], torch.Tensor]]]:
        """Pass 2's forwards of a micro-batch: a text sample's roles one at a time (only one role's activations alive
        at once), image views together."""
        if not isinstance(batch.inputs, Mapping):
            return [(slice(None), lambda: self.embed(model, batch, cast))]
        n = len(batch.target)
        return [(slice(j, j + 1), lambda inputs=inputs: one_per_input(
                    model(**{k: cast(v) for k, v in inputs.items()}), n, self.name)[:, None])
                for j, (_, inputs) in enumerate(roles(batch.inputs))]

    def keys(self, batch: Batch) -> torch.Tensor:
        """Each candidate's key (N, R − 1): the data's text keys for text pairs, the class for image views. A copy:
        kept for the whole window, the batch's own target would keep the heap from reusing its inputs' memory."""
        keys = batch.target.to(torch.int64, copy=True)
        return keys if keys.dim() == 2 else keys[:, None]

    def empty_rows(self, device: torch.device) -> torch.Tensor:
        return torch.zeros((0, 2, 1), device=device)

    def eval_rows(self, embeddings: torch.Tensor, rows: slice, keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float64 [summed loss, samples] of the samples `rows`, every sample of the held-out split a candidate."""
        with torch.no_grad():
            loss = self.per_sample(embeddings, rows, keys)
        return torch.stack([loss.double().sum(), torch.tensor(float(len(loss)), dtype=torch.float64,
                                                               device=loss.device)])

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        return {"val_loss": sums[0] / sums[1]}

    # --- the Loss protocol (accutrain.core.loss) -------------------------------------------------------------------
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

    def check(self, model: nn.Module, batch: Batch, data: str) -> None:
        """The pairs reach the model as pairs, an embedding per input, two different texts embedded apart."""
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                check_distinct(self.embed(model, batch), batch.inputs, roles)
        finally:
            model.train(training)

    def attach(self, model: nn.Module) -> list[str]:
        if not self.window:
            return [f"loss.window=false: each micro-batch's loss={self.name} has only its own samples as candidates, "
                    "so the accumulated step is NOT the big batch's (for comparison only; loss.window=true is exact)"]
        return []



def retrieval_sums(scores: torch.Tensor, positive: torch.Tensor) -> list[torch.Tensor]:
    """Summed recall@1, recall@10, reciprocal rank@10 and NDCG@10 of anchors whose scores against every candidate
    are `scores` (higher: nearer) and whose positive is column `positive`: the rank of the positive among the
    candidates (ties count in its favour); with one relevant candidate, NDCG@10 is 1 / log2(1 + rank) in the top 10."""
    rank = 1 + (scores > scores.gather(1, positive[:, None])).sum(1).double()
    top10 = rank <= 10
    return [(rank <= 1).double().sum(), top10.double().sum(), (top10 / rank).sum(),
            (top10 / torch.log2(1 + rank)).sum()]


def roles(inputs: Mapping[str, torch.Tensor]) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """A text sample's roles in order (anchor, positive, negative.0, …) with each one's model inputs: the keys
    `<role>.<input>` of the batch's mapping, the role's prefix taken off."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in inputs.items():
        role, _, name = key.rpartition(".")
        found.setdefault(role, {})[name] = value
    order = {"anchor": 0, "positive": 1}
    return sorted(found.items(), key=lambda item: (order.get(item[0], 2), item[0].split(".")[-1].zfill(6)))


def embed(model: nn.Module, batch: Batch, cast: Cast = lambda t: t, name: str = "contrastive") -> torch.Tensor:
    """The micro-batch's embeddings (N, R, D): image views through the model as one batch of N × R, or each text
    role (anchor, positive, negatives) through the model on its own."""
    x = batch.inputs
    if isinstance(x, Mapping):
        parts = roles(x)
        if [role for role, _ in parts[:2]] != ["anchor", "positive"] or any(not role for role, _ in parts):
            raise UserError(f"loss={name} needs an anchor and a positive per sample (inputs anchor.*, positive.*); "
                            f"this data's inputs are {', '.join(x)}: set data.columns.anchor and "
                            "data.columns.positive (docs/embeddings.md)")
        out = [one_per_input(model(**{k: cast(v) for k, v in inputs.items()}), len(batch.target), name)
               for _, inputs in parts]
        return torch.stack(out, 1)
    if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.shape[1] < 2:
        raise UserError(f"loss={name} needs pairs per sample: two views of each image (inputs (samples, 2, …): set "
                        "augment.views=2, with a random augment=) or text pairs (data.columns.anchor, "
                        "data.columns.positive)")
    return one_per_input(model(cast(x.flatten(0, 1))), len(x) * x.shape[1], name).unflatten(0, (len(x), x.shape[1]))


def one_per_input(out: Any, n: int, name: str = "contrastive") -> torch.Tensor:
    """The model's output if it is one embedding per input, (n, dim); else one line."""
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or len(out) != n:
        raise UserError(f"loss={name} needs an embedding per input, (samples, dim), from the model; it returns "
                        f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__} for {n} inputs")
    return out
