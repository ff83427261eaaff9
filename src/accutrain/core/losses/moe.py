"""loss=moe: a mixture-of-experts language model's loss — the tokens' cross-entropy, its router's balancing loss
(accutrain.core.routing) and the router z-loss — with the balancing loss over the WHOLE window, exactly.

loss.router_aux says over what the balancing loss is computed:

    window       pass 1 forwards each micro-batch of the window without gradients and keeps only the routing counts
                 C^W (layers × experts) and the window's real tokens |T^W|, all-reduced across ranks once; pass 2 is
                 the ordinary accumulation (the window read again, step.Rereadable, each micro-batch's dropout and
                 router jitter replayed), each micro-batch adding N_E · Σ_i f_i^W · S_i^b / (L·|T^W|): the big
                 batch's balancing loss and its gradient, exactly. The counts are final before any backward, so
                 activation checkpointing's recomputation cannot change them. Cost: about one forward per window.
    micro_batch  each micro-batch balanced alone (its own f and P: the model's own formula on it), weighted by its
                 share of the window's tokens — NOT the big batch's objective (for comparison)
    model        the model's own `aux_loss` as its forward returns it, weighted so — NOT the big batch's either
    off          none

× loss.router_aux_coef (null: the model's own router_aux_loss_coef). The z-loss (ST-MoE), × loss.router_z_coef, is
per token — Σ_t mean_l logsumexp(logits_l(t))² over the tokens the cross-entropy counts, divided by their count
|W| — so it is exact under any split in one pass. The reported `loss` is the cross-entropy alone.

The model: a forward that takes `aux=("router_logits", …)` and then returns (logits, {name: value}) — the loss
protocol's auxiliary outputs (accutrain.core.loss) — and a `routing` attribute (routing.Routing): model=hf_causal_lm
with a mixture-of-experts configuration (models/moe.py), or a model of your own that provides both.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Optional, Sequence

import torch
from torch import nn

from accutrain.core.batches import Batch, stand_in_guard
from accutrain.core.compiled import eager
from accutrain.core.full_ce import logits_given_up
from accutrain.core.gradcache import on, set_rng
from accutrain.core.losses.cross_entropy import SummedLoss, make_loss
from accutrain.core.losses.moe_checks import check_router, routing_of
from accutrain.core.losses.moe_window import Counted, count_window, empty_tally, figures_of, outputs
from accutrain.core.options import Normalize, RouterAux
from accutrain.core.precision import Precision
from accutrain.core.routing import Routing, balancing, describe_load, route, token_rows
from accutrain.core.step import FP32, evaluate, micro_steps, rereadable
from accutrain.errors import UserError

Batches = Iterable[Batch | Sequence[torch.Tensor]]
NOT_THE_BIG_BATCH = ("loss.router_aux={} balances each micro-batch alone, so the accumulated step is NOT the big "
                     "batch's (for comparison only; loss.router_aux=window balances the whole window, exactly)")


@dataclass
class RouterBalancedLoss:
    """The loss of `loss=moe` (a Loss: accutrain.core.loss). `ce` is the tokens' cross-entropy; `routing` the model's
    router (from the model at build); `ce_weight` 0 leaves the balancing alone (accutrain-check's component)."""

    ce: SummedLoss
    router_aux: RouterAux = RouterAux.window
    aux_coef: Optional[float] = None  # null: the model's own router_aux_loss_coef (set by check)
    z_coef: float = 0.0
    routing: Optional[Routing] = None  # the model's router: set by check, from the model
    ce_weight: float = 1.0
    layers: int = 0  # router layers: set from the first samples (check)
    measured: dict = field(default_factory=dict, repr=False)  # the last window's figures (device tensors)
    name = "moe"
    output = "logits"
    elements = True
    tokens = True
    task = "classification"
    monitor = "val_loss"
    min_window = 1

    @property
    def whole_window(self) -> bool:
        return self.router_aux is RouterAux.window

    @property
    def ignore_index(self) -> int:
        return self.ce.ignore_index

    @property
    def wanted(self) -> tuple[str, ...]:
        return ("router_logits", "aux_loss") if self.router_aux is RouterAux.model else ("router_logits",)

    def target(self, labels: torch.Tensor) -> torch.Tensor:
        return self.ce.target(labels)

    def terms(self, micro_batches: Batches) -> int:
        return self.ce.terms(micro_batches)

    # --- one window ----------------------------------------------------------------------------------------------
    def accumulate(self, model: nn.Module, micro_batches: Batches, terms: int, device: torch.device, *,
                   world: int = 1, no_sync: Callable[[], ContextManager] = nullcontext,
                   precision: Optional[Precision] = None, observe: Optional[Callable[[int], None]] = None
                   ) -> torch.Tensor:
        """.grad = ∇(the window's cross-entropy / |W| + coef · its balancing loss + coef_z · its z-loss); returns
        this rank's summed cross-entropy (float64, on the device). router_aux=window: two passes (above)."""
        precision = precision or FP32
        two = self.whole_window and self.aux_coef != 0  # a weight of 0 needs no window's counts
        window = rereadable(micro_batches) if two else micro_batches
        counted = count_window(self, model, window, device, precision, world) if two else None
        replay = iter(counted.states) if counted is not None else None
        scale = world / terms  # DDP averages the ranks' gradients: × world undoes that mean
        total = torch.zeros((), dtype=torch.float64, device=device)
        tally = empty_tally(self, device)
        for batch, synchronises in micro_steps(window.again() if counted is not None else window):
            with nullcontext() if synchronises else no_sync(), (
                    stand_in_guard(model, device) if batch.stand_in else nullcontext()), eager(model, len(batch)):
                batch = on(batch, device)
                if replay is not None and not batch.stand_in:
                    set_rng(next(replay), device)  # the k-th real micro-batch of pass 2 is pass 1's k-th
                with precision.autocast():
                    logits, aux = outputs(model, batch, precision.inputs, self.wanted)
                with logits_given_up():  # read no more (core/full_ce.py)
                    ce_sum = self.ce(logits, batch.target)
                del logits
                objective, seen = self.objective(ce_sum, aux, batch, counted, scale, world)
                precision.backward(objective, 0.0 if batch.stand_in else 1.0)
                if observe is not None:
                    observe(len(batch))
            if not batch.stand_in:
                total += ce_sum.detach()
                tally = [t + s for t, s in zip(tally, seen)]
        if counted is not None:
            set_rng(counted.after, device)  # where one pass would have left the RNG
        self.measured = figures_of(self, tally, terms, world)
        return total

    def objective(self, ce_sum: torch.Tensor, aux: dict[str, Any], batch: Batch, counted: Optional[Counted],
                  scale: float, world: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One micro-batch's share of the window's objective (× world, for DDP's mean) and what it adds to the
        window's figures: [counts, summed probabilities, tokens, the balancing term it optimised × its tokens, z]."""
        target = self.ce.target(batch.target)
        counted_rows = (target != self.ce.ignore_index).reshape(-1)
        routed = route(self.router_logits(aux), self.routing.top_k, token_rows(batch.inputs), counted_rows)
        n = counted_rows.sum()
        if self.router_aux is RouterAux.window and counted is not None:
            balance = balancing(counted.counts, routed.probs, counted.tokens) * world
        elif self.router_aux is RouterAux.micro_batch:
            balance = balancing(routed.counts, routed.probs, routed.tokens) * n * scale
        elif self.router_aux is RouterAux.model:
            balance = aux["aux_loss"] * n * scale
        else:
            balance = None
        objective = ce_sum * (self.ce_weight * scale)
        if self.z_coef:
            objective = objective + self.z_coef * routed.z * scale
        if balance is not None and self.aux_coef:
            objective = objective + self.aux_coef * balance
        optimised = balance.detach().double() / scale if balance is not None and \
            self.router_aux is not RouterAux.window else torch.zeros((), dtype=torch.float64, device=n.device)
        return objective, [routed.counts, routed.probs.detach().double(), routed.tokens, optimised,
                           routed.z.detach().double()]

    def router_logits(self, aux: dict[str, Any]) -> Sequence[torch.Tensor]:
        logits = aux.get("router_logits") if isinstance(aux, dict) else None
        if not logits:
            raise UserError(f"loss=moe: the model's forward returned no router logits ({type(logits).__name__}); "
                            "a mixture of experts must return each router layer's logits when asked (aux=)")
        self.layers = self.layers or len(logits)
        return logits

    # --- the rest of the protocol ----------------------------------------------------------------------------
    def evaluate(self, model: nn.Module, loader: Iterable, device: torch.device, precision: Precision,
                 world: int) -> torch.Tensor:
        return evaluate(model, loader, device, precision, self.ce)

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        return self.ce.eval_metrics(sums)

    def reference(self, model: nn.Module, batch: Batch, device: torch.device, precision: Precision) -> torch.Tensor:
        """The whole window as one batch: its own balancing loss is the window's (one pass suffices)."""
        one = self if self.router_aux is not RouterAux.window else dataclasses.replace(
            self, router_aux=RouterAux.micro_batch)
        return one.accumulate(model, [batch], self.ce.reference_terms(batch), device, precision=precision)

    def probe(self, batch: Batch) -> Batch:
        return batch

    def notes(self, batch: Batch) -> list[str]:
        if self.router_aux in (RouterAux.micro_batch, RouterAux.model) and self.aux_coef:
            return [NOT_THE_BIG_BATCH.format(self.router_aux.value)]
        return []

    def figures(self) -> dict[str, torch.Tensor]:
        return self.measured

    def summary(self, figures: dict[str, float]) -> str:
        load = describe_load(figures, self.routing.experts) if self.routing is not None else ""
        window = figures.get("router_aux_window")
        return ", ".join(filter(None, [load, f"balancing loss over the window {window:.4f}"
                                       if window is not None else ""]))

    def components(self) -> dict[str, RouterBalancedLoss]:
        """The balancing loss alone (coefficient 1, no cross-entropy or z-loss): accutrain-check compares its
        gradient too, which the cross-entropy's would otherwise swamp."""
        if self.router_aux is RouterAux.off:
            return {}
        return {"router balancing": dataclasses.replace(self, ce_weight=0.0, aux_coef=1.0, z_coef=0.0,
                                                        measured={})}

    def attach(self, model: nn.Module) -> list[str]:
        if self.router_aux in (RouterAux.micro_batch, RouterAux.model) and self.aux_coef:
            return [NOT_THE_BIG_BATCH.format(self.router_aux.value)]
        return []

    def prepare(self, model: nn.Module, splits: Any, device: torch.device, precision: Precision) -> list[str]:
        return []

    def check(self, model: nn.Module, batch: Batch, data: str) -> None:
        """The targets and the cross-entropy's gradient (as loss=cross_entropy checks them), then the router: the
        model routes, returns its router logits, and (window, micro_batch) its own balancing loss is the formula
        evaluated here — or one line saying which of these fails."""
        self.ce.check(model, batch, data)
        self.routing = routing_of(model)
        if self.aux_coef is None:
            self.aux_coef = self.routing.coef
        self.layers = check_router(self.routing, self.router_aux, model, batch)


def moe(router_aux: RouterAux | str = "window", router_aux_coef: Optional[float] = None, router_z_coef: float = 0.0,
        ignore_index: int = -100, shift_labels: Optional[bool] = None, label_smoothing: float = 0.0,
        model_defaults: Optional[dict] = None) -> RouterBalancedLoss:
    """loss=moe's factory (`loss._target_`); the model lends its router (`routing`) and its own coefficient when the
    loss checks it (check), and its factory's defaults (shifted labels) here."""
    ce = make_loss(Normalize.tokens, ignore_index, shift_labels, model_defaults, label_smoothing)
    coef = None if router_aux_coef is None else float(router_aux_coef)
    return RouterBalancedLoss(ce, RouterAux(router_aux), coef, float(router_z_coef))
