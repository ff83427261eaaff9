"""loss=moe's checks of the model, once at build (before training; a refusal is one line): the model routes (its
`routing`), its forward returns each router layer's logits when asked (`aux=`), and — for loss.router_aux=window and
micro_batch, which evaluate the balancing formula themselves — the model's own balancing loss on the first samples
is that formula (accutrain.core.routing), so that the window's loss is the model's own objective over the window."""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn

from accutrain.core.batches import Batch
from accutrain.core.options import RouterAux
from accutrain.core.routing import Routing, balancing, route, token_rows
from accutrain.errors import UserError

DENSE = ("loss=moe balances the router of a mixture-of-experts model, and this model has none (a dense model): use "
         "loss=cross_entropy, or a mixture-of-experts configuration (e.g. +model.config.model_type=mixtral, "
         "qwen2_moe, qwen3_moe, olmoe)")
PACKED = ("loss.router_aux=model takes the model's own balancing loss, which reads a block packed by documents "
          "(data.packing=true) as one sequence and its 4-D attention mask as padding: use loss.router_aux=window, "
          "which counts each document's tokens")


def routing_of(model: Optional[nn.Module]) -> Routing:
    """The model's router, or one line: a dense model, or one whose forward cannot return its router logits."""
    routing = getattr(model, "routing", None) if model is not None else None
    if routing is None:
        raise UserError(DENSE)
    if not routing.returns_logits:
        raise UserError(f"loss=moe: the model ({routing.name}) routes each token to {routing.top_k} of "
                        f"{routing.experts} experts, but its forward does not return its router logits (transformers "
                        "records none for it), so its routing cannot be counted: use loss=cross_entropy")
    return routing


def check_router(routing: Routing, mode: RouterAux, model: nn.Module, batch: Batch) -> int:
    """The first samples through the model asking for its router's outputs (evaluation mode: no dropout or router
    jitter), their shape, and its own balancing loss against the formula's (loss.router_aux=`mode`); returns the
    number of router layers."""
    packed = isinstance(batch.inputs, Mapping) and "document_ids" in batch.inputs
    if packed and mode is RouterAux.model:
        raise UserError(PACKED)
    if mode is not RouterAux.off and not routing.own_loss:
        raise UserError(f"loss.router_aux={mode.value}: the model ({routing.name}) computes no balancing "
                        "loss of its own (its forward takes no output_router_logits), so there is no formula of its "
                        "own to evaluate: use loss.router_aux=off (its expert load is still measured; "
                        "loss.router_z_coef applies)")
    own = routing.own_loss and not packed  # its own formula reads a 2-D attention mask only
    wanted = ("router_logits", "aux_loss") if own else ("router_logits",)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = ask(model, batch, wanted)
    finally:
        model.train(training)
    aux = out[1] if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping) else None
    logits = aux.get("router_logits") if aux is not None else None
    if not logits or not all(isinstance(t, torch.Tensor) for t in logits):
        raise UserError("loss=moe: asked for its router logits (aux=('router_logits',)), the model's forward returned "
                        f"{type(out).__name__ if aux is None else type(logits).__name__}, not (logits, "
                        "{'router_logits': one tensor per router layer}): its routing cannot be counted")
    experts = routing.experts
    for layer in logits:
        if layer.dim() != 2 or layer.shape[-1] != experts:
            raise UserError(f"loss=moe: the model's router logits have shape {tuple(layer.shape)}, not (tokens, "
                            f"{experts} experts)")
    theirs = aux.get("aux_loss")
    if mode is RouterAux.model and theirs is None:
        raise UserError("loss.router_aux=model takes the model's own balancing loss (aux_loss), and its forward "
                        "returns none: use loss.router_aux=window")
    if mode in (RouterAux.window, RouterAux.micro_batch) and isinstance(theirs, torch.Tensor):
        same_formula(mode, logits, routing, batch, float(theirs))
    return len(logits)


def ask(model: nn.Module, batch: Batch, wanted: tuple[str, ...]) -> Any:
    """The model's forward asked for `wanted` auxiliary outputs; one line if it takes no `aux` keyword."""
    try:
        return batch.forward(functools.partial(model, aux=wanted))
    except TypeError as e:
        if "aux" not in str(e):
            raise
        raise UserError(f"loss=moe needs the model's router logits, and its forward takes no aux= keyword ({e}): a "
                        "model of your own returns (logits, {'router_logits': …}) when called with "
                        "aux=('router_logits',)") from None


def same_formula(mode: RouterAux, logits: Any, routing: Routing, batch: Batch, theirs: float) -> None:
    """The formula over these router logits equals the model's own balancing loss (float32: to 1e-4; half
    precision, whose softmax the model takes in its own dtype: to 2e-2)."""
    routed = route(logits, routing.top_k, token_rows(batch.inputs))
    ours = float(balancing(routed.counts, routed.probs, routed.tokens))
    tolerance = 1e-4 if logits[0].dtype in (torch.float32, torch.float64) else 2e-2
    if not math.isclose(ours, theirs, rel_tol=tolerance, abs_tol=1e-6):
        raise UserError(f"loss.router_aux={mode.value}: the model's own balancing loss on the first samples is "
                        f"{theirs:.6g}, Switch's formula over its router logits {ours:.6g} — its formula is another, "
                        "which accutrain cannot evaluate over the window: use loss.router_aux=model (its own, per "
                        "micro-batch)")
