"""Sequences' log-probabilities for the preference losses (loss=dpo, orpo, kto): each sequence's summed log-probability
of its completion tokens under the model (its labels shifted, ignore_index left out), and the gradient of any function
of those sums through one weighted pass over the tokens.

A preference loss is a function f of per-sequence sums s_b = Σ_t log p(y_bt). Its gradient is Σ_b (∂f/∂s_b) ∇s_b, so a
micro-batch's backward is that of the surrogate Σ_b c_b s_b with c_b = ∂f/∂s_b taken from the detached sums: the same
gradient, exactly, whether the model hands the loss its full logits or (model.logits=chunked) its last hidden states
and head (core/chunked_ce.py: the logits a chunk of tokens at a time, never all at once)."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from accutrain.core.chunked_ce import Projection, chunk_size, summed_linear_cross_entropy
from accutrain.core.summing import shift_left


def role_inputs(inputs: Mapping[str, torch.Tensor], role: str) -> dict[str, torch.Tensor]:
    """The model's inputs of one role of a preference item (`chosen.input_ids` → input_ids; role "": unprefixed)."""
    prefix = f"{role}." if role else ""
    return {name: inputs[prefix + name] for name in ("input_ids", "attention_mask")}


def targets(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The tokens each position predicts (the labels shifted left: a causal LM's)."""
    return shift_left(labels, ignore_index)


@torch.no_grad()
def sequence_logps(output: Any, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Each row's summed log-probability of its targets (float64, (batch,)), without gradient: from full logits
    (batch, classes, length), or a Projection a row at a time."""
    kept = target != ignore_index
    picked = target.masked_fill(~kept, 0)
    if isinstance(output, Projection):  # a chunk of tokens' logits at a time, never the whole (batch, length, V)
        hidden, flat = output.hidden.reshape(-1, output.hidden.shape[-1]), picked.reshape(-1)
        token = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
        step = chunk_size(len(flat), hidden.shape[1], output.weight.shape[0])
        for start in range(0, len(flat), step):
            logits = F.linear(hidden[start : start + step], output.weight, output.bias).float()
            token[start : start + step] = logits.log_softmax(-1).gather(-1, flat[start : start + step, None])[:, 0]
        return (token.reshape(target.shape) * kept).double().sum(-1)
    token = output.float().log_softmax(1).gather(1, picked[:, None]).squeeze(1)
    return (token * kept).double().sum(-1)


def weighted_logps(output: Any, target: torch.Tensor, weights: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Σ_b weights_b × (row b's summed log-probability of its targets), with gradient: the surrogate whose backward is
    that of any function of the rows' sums whose derivatives are `weights`."""
    per_token = weights.to(torch.float32)[:, None].expand(target.shape)
    if isinstance(output, Projection):
        return -summed_linear_cross_entropy(output, target, ignore_index, 0.0, per_token.contiguous())
    nll = F.cross_entropy(output.float(), target, ignore_index=ignore_index, reduction="none")
    return -(nll * per_token).sum()


def completion_tokens(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Each row's completion tokens (its targets after the shift that are not ignore_index), float64."""
    return (targets(labels, ignore_index) != ignore_index).sum(-1).double()


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout drawn: the random stream untouched), each module's mode put back after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def adapted_model(model: nn.Module) -> Optional[nn.Module]:
    """The PEFT model inside `model` (model.adapter=lora), whose `disable_adapter()` gives its base; None without."""
    for module in model.modules():
        if hasattr(module, "peft_config") and hasattr(module, "disable_adapter"):
            return module
    return None


class Reference:
    """The reference policy π_ref: the base with its adapter disabled (model.adapter=lora: no second copy), or a
    frozen copy of the model taken before the first step — or (`live`: loss.reference=precompute's pass, before the
    first step) the model itself. `logps(model, inputs, labels, cast)` are its sequences' log-probabilities, without
    gradient, in eval mode."""

    def __init__(self, model: nn.Module, live: bool = False) -> None:
        self.adapter = adapted_model(model)
        self.copy: Optional[nn.Module] = None
        if self.adapter is None and not live:
            import copy

            self.copy = copy.deepcopy(model).requires_grad_(False).eval()

    @property
    def bytes(self) -> int:
        """The memory the reference takes beside the model (its copy's weights and buffers)."""
        if self.copy is None:
            return 0
        return sum(t.numel() * t.element_size() for t in [*self.copy.parameters(), *self.copy.buffers()])

    def describe(self) -> str:
        if self.copy is None:
            return "the base model with its LoRA adapter disabled (no second copy)"
        return f"a frozen copy of the model ({self.bytes / 2**20:,.1f} MiB more memory)"

    @torch.no_grad()
    def logps(self, model: nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor, ignore_index: int,
              cast: Callable[[torch.Tensor], torch.Tensor], autocast: Callable[[], Any]) -> torch.Tensor:
        bare = getattr(model, "module", model)
        target = targets(labels, ignore_index)
        if self.copy is not None:
            with autocast():
                output = self.copy(**{k: cast(v) for k, v in inputs.items()})
            return sequence_logps(output, target, ignore_index)
        with evaluating(bare), self.adapter.disable_adapter() if self.adapter else nullcontext(), autocast():
            output = bare(**{k: cast(v) for k, v in inputs.items()})
        return sequence_logps(output, target, ignore_index)
