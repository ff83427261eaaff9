"""loss=contrastive: InfoNCE with in-batch negatives over the WHOLE window's embeddings (every micro-batch, every
rank), which gradient caching (accutrain.core.gradcache) makes exact under any split.

A sample is a pair of views (augment.views=2), its input (N, 2, …); the model embeds each view, and the embeddings
are compared by cosine similarity × a scale (1 / loss.temperature, or a learnt exp(logit_scale)). The loss of
sample i over a set of N samples: one-sided, the cross-entropy of view 0 of i against view 1 of all N (its own is the
positive, the other N - 1 the negatives); symmetric (CLIP), the mean of that and the same with the views swapped.
Each sample's loss has the whole set in its denominator: that is why a sum over micro-batches is not the big
batch's loss, and why the window must be seen whole. The similarity matrix is N × N floats for a window of N
samples (4 bytes × N²: 16 MiB at N = 2,048; 1 GiB at 16,384); it is not chunked.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from accutrain.core.batches import Batch, as_batch
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
    head: Optional[Temperature] = field(default=None, repr=False)  # learn_temperature: set by attach()
    name = "contrastive"
    elements = False
    tokens = False
    task = "contrastive"
    ignore_index = -100
    monitor = "val_loss"
    min_window = 2  # one pair has no negative: its loss is 0 whatever the weights
    whole_window = True

    def scale(self) -> torch.Tensor | float:
        return self.head.scale() if self.head is not None else 1.0 / self.temperature

    def target(self, labels: torch.Tensor) -> torch.Tensor:
        return labels

    # --- the maths -------------------------------------------------------------------------------------------
    def per_sample(self, embeddings: torch.Tensor, rows: Optional[slice] = None) -> torch.Tensor:
        """Each sample's InfoNCE loss against every sample of `embeddings` (N, 2, D) as negatives; `rows`: only
        those samples' losses (the candidates stay all N)."""
        z = F.normalize(wide(embeddings), dim=-1)
        a, b = z[:, 0], z[:, 1]
        rows = rows or slice(0, len(z))
        positives = torch.arange(len(z), device=z.device)[rows]
        logits = a[rows] @ b.T * self.scale()
        loss = F.cross_entropy(logits, positives, reduction="none")
        if self.symmetric:
            loss = (loss + F.cross_entropy(b[rows] @ a.T * self.scale(), positives, reduction="none")) / 2
        return loss

    def embed(self, model: nn.Module, batch: Batch, cast: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
              ) -> torch.Tensor:
        return embed(model, batch, cast)

    def empty_rows(self, device: torch.device) -> torch.Tensor:
        return torch.zeros((0, 2, 1), device=device)

    def eval_rows(self, embeddings: torch.Tensor, rows: slice) -> torch.Tensor:
        """float64 [summed loss, samples, view-1 retrieved first for view 0] of the samples `rows`, every sample of
        `embeddings` (the held-out split's, gathered from every rank) a candidate."""
        with torch.no_grad():
            loss = self.per_sample(embeddings, rows)
            z = F.normalize(wide(embeddings), dim=-1)
            hits = (z[rows, 0] @ z[:, 1].T).argmax(1) == torch.arange(len(z), device=z.device)[rows]
        return torch.stack([loss.double().sum(), torch.tensor(float(len(loss)), dtype=torch.float64,
                                                              device=loss.device), hits.double().sum()])

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        """val_loss (over the whole held-out split as one set) and val_recall1 (view 1 of a sample is the nearest
        of all the split's view 1s to its view 0)."""
        return {"val_loss": sums[0] / sums[1], "val_recall1": sums[2] / sums[1]}

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
        """A batch of pairs of views as a batch of single views (each sample's target repeated)."""
        return Batch(batch.inputs.flatten(0, 1), batch.target.repeat_interleave(2, 0), batch.stand_in)

    def notes(self, batch: Batch) -> list[str]:
        return []

    def check(self, model: nn.Module, batch: Batch, data: str) -> None:
        """The pairs reach the model as pairs, and the model returns an embedding per view."""
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                embed(model, batch)
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

    def __call__(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Σ of the micro-batch's losses with its own samples as the only negatives: loss.window=false's loss."""
        return self.per_sample(pairs(embeddings)).sum()


def pairs(output: torch.Tensor) -> torch.Tensor:
    """The model's output for a micro-batch of pairs, (N, 2, D)."""
    if output.dim() != 3 or output.shape[1] != 2:
        raise UserError(f"loss=contrastive needs pairs: an embedding per view, (samples, 2, dim), not "
                        f"{tuple(output.shape)}; set augment.views=2")
    return output


def embed(model: nn.Module, batch: Batch, cast: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> torch.Tensor:
    """The micro-batch's embeddings (N, 2, D): both views through the model as one batch of 2N."""
    x = batch.inputs
    if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.shape[1] != 2:
        raise UserError("loss=contrastive needs pairs of views per sample (inputs of shape (samples, 2, …)): set "
                        "augment.views=2 (with a random augment=) for image data")
    out = model(cast(x.flatten(0, 1)))
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise UserError(f"loss=contrastive needs an embedding per input, (samples, dim), from the model; it returns "
                        f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
    return out.unflatten(0, (len(x), 2))


def contrastive(temperature: float = 0.07, symmetric: bool = True, learn_temperature: bool = False,
                window: bool = True, ignore_index: int = -100) -> ContrastiveLoss:
    """loss=contrastive's factory (`loss._target_`); ignore_index is unused (the data's padding default reads it)."""
    if not temperature > 0:
        raise UserError(f"loss.temperature={temperature} is not valid: expected a positive temperature (e.g. 0.07)")
    return ContrastiveLoss(temperature, symmetric, learn_temperature, window)
