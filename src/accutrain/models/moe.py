"""Hugging Face mixture-of-experts models (model=hf_causal_lm with a Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, … config or
checkpoint): what the model says of its router (accutrain.core.routing.Routing, which loss=moe reads), and its
router's outputs when a forward asks for them (the loss protocol's auxiliary outputs, `aux=(…)`):

- `router_logits`: each router layer's logits, taken from the router modules as they return them — the modules
  transformers itself records `router_logits` from (the model's `_can_record_outputs`) — while that forward runs,
  and not again during activation checkpointing's recomputation in backward. Taken so, not through the model's
  `output_router_logits`, which also makes the model compute its own balancing loss from the attention mask —
  and that fails on a block packed by documents (its mask is 4-D) and counts padding without a mask (flash).
- `aux_loss`: the model's own balancing loss (`output_router_logits=True`), for loss.router_aux=model.

A config that asks for output_router_logits by default is not followed when nothing needs it: accutrain passes no
labels, so the model's own loss would be computed for nothing. A dense model has no routing (None)."""
from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional

from torch import nn

from accutrain.core.routing import Routing

EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")  # the configs' names for the experts per layer


def recorded(model: nn.Module) -> list[tuple[type, int, Optional[str]]]:
    """(module class, index in its output, layer name) of what the model records as `router_logits`."""
    specs = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    found = []
    for spec in specs if isinstance(specs, list) else [specs] if specs is not None else []:
        target = spec if isinstance(spec, type) else getattr(spec, "target_class", None)
        if target is not None:
            found.append((target, getattr(spec, "index", 0), getattr(spec, "layer_name", None)))
    return found


class RouterTap:
    """Forward hooks on the model's router modules that keep their logits while `recording()` is open."""

    def __init__(self, model: nn.Module) -> None:
        self.taken: Optional[list] = None
        self.index = 0
        for target, index, layer in recorded(model):
            for name, module in model.named_modules():
                if isinstance(module, target) and (layer is None or f".{layer.strip('.')}." in f".{name}."):
                    module.register_forward_hook(self.keep)
                    self.index = index

    def keep(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.taken is not None:
            self.taken.append(output[self.index] if isinstance(output, (tuple, list)) else output)

    @contextmanager
    def recording(self) -> Iterator[list]:
        self.taken = []
        try:
            yield self.taken
        finally:
            self.taken = None


def routing_of(model: nn.Module) -> Optional[Routing]:
    """The router of a Hugging Face model (`model`: the bare transformers model), from its config: experts per layer,
    top-k, its balancing loss's own coefficient, whether its router logits can be taken and whether it computes a
    balancing loss of its own; None if dense."""
    config = getattr(model, "config", None)
    experts = next((getattr(config, key) for key in EXPERTS if isinstance(getattr(config, key, None), int)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not experts or experts < 2 or not isinstance(top_k, int):
        return None
    own = "output_router_logits" in inspect.signature(model.forward).parameters
    coef = config.to_dict().get("router_aux_loss_coef")
    return Routing(experts, top_k, float(coef or 0.0), type(model).__name__, bool(recorded(model)), own)


class Router:
    """A mixture of experts' router outputs for the forwards that ask (HFAdapter.forward's `aux`)."""

    def __init__(self, model: nn.Module, routing: Routing) -> None:
        self.routing = routing
        self.tap = RouterTap(model) if routing.returns_logits else None

    def call(self, model: Callable[..., Any], inputs: dict[str, Any], aux: tuple[str, ...]
             ) -> tuple[Any, dict[str, Any]]:
        """model(**inputs) and the auxiliary outputs `aux` of that forward (None for one it cannot give)."""
        options = {"output_router_logits": "aux_loss" in aux} if self.routing.own_loss else {}
        taking = self.tap is not None and "router_logits" in aux
        with self.tap.recording() if taking else nullcontext() as taken:
            output = model(**inputs, **options)
        extra = {name: getattr(output, name, None) for name in aux}
        if taking:
            extra["router_logits"] = tuple(taken)
        return output, extra


def router_of(model: nn.Module) -> Optional[Router]:
    """The router of a mixture of experts (`model`: the bare transformers model), None for a dense model."""
    routing = routing_of(model)
    return Router(model, routing) if routing is not None else None


def forward(model: Callable[..., Any], router: Optional[Router], inputs: dict[str, Any], aux: tuple[str, ...]
            ) -> tuple[Any, dict[str, Any]]:
    """The output of `model` (the model, or a call of its parts: model.logits=chunked) for `inputs`, and the
    auxiliary outputs `aux` (none asked: {}; a dense model's: None)."""
    if router is None:
        output = model(**inputs)
        return output, {name: getattr(output, name, None) for name in aux}
    return router.call(model, inputs, aux)
