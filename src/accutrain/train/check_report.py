"""What accutrain-check reports: the comparison per parameter group and its verdict (`Check`), and the causes it finds
in the model — BatchNorm in training mode, dropout, any other module whose output for a sample depends on the rest of
its batch."""
from __future__ import annotations

import copy
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from accutrain.core.batches import Batch, as_batch
from accutrain.models.norms import REMEDIES, batchnorm_layers
from accutrain.models.pitfalls import dropout_layers
from accutrain.train import memory


@dataclass
class Check:
    window: int  # samples in the window
    micro_batch: int
    micro_batches: int
    precision: str
    groups: dict[str, float]  # relative difference of the gradient, per parameter group (top-level module)
    overall: float
    tolerance: float
    reference_on: str  # where the one-batch gradient was computed
    causes: list[str] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=dict)  # relative difference of a part of the loss alone

    @property
    def faithful(self) -> bool:
        return max([self.overall, *self.parts.values()]) <= self.tolerance

    def lines(self) -> list[str]:
        out = [f"first window: {self.window} samples in {self.micro_batches} micro-batches of up to "
               f"{self.micro_batch} (precision {self.precision}); one-batch reference computed on "
               f"{self.reference_on}",
               f"{'parameter group':<28} relative difference of the gradient"]
        out += [f"  {name:<26} {diff:.2e}" for name, diff in
                {**self.groups, "overall": self.overall, **{f"{k} alone": v for k, v in self.parts.items()}}.items()]
        if self.faithful:
            out.append(f"verdict: faithful — the accumulated step is the big batch's step (within "
                       f"{self.tolerance:.0e} at precision {self.precision})")
        else:
            where, worst = max([("", self.overall), *((f" in its {k}", v) for k, v in self.parts.items())],
                               key=lambda named: named[1])  # the whole, or a part of the loss alone
            out.append(f"verdict: NOT faithful — the accumulated step differs from the big batch's by {worst:.1e}"
                       f"{where} (tolerance {self.tolerance:.0e} at precision {self.precision})")
        if self.causes:
            out.append("causes found:" if not self.faithful else "noted:")
            out += [f"  - {cause}" for cause in self.causes]
        return out


def cpu_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `model` on the CPU, its floating tensors in `dtype`, made without a second copy on the model's
    device (after an out-of-memory there is no room for one) and without its gradients."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        cpu = t.detach().to("cpu", copy=True)  # converted on the CPU, below: no temporary on the device
        cpu = cpu.to(dtype) if cpu.is_floating_point() else cpu
        memo[id(t)] = nn.Parameter(cpu, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else cpu
    return copy.deepcopy(model, memo)


def causes(model: nn.Module, micro: list[Batch], big: Batch, seen: int, window: int) -> list[str]:
    """What in the model makes (or could make) the accumulated step differ from the big batch's; `seen`:
    the samples one BatchNorm statistic covers (a micro-batch, or every device's with SyncBatchNorm)."""
    found = []
    norms = [name for name, _ in batchnorm_layers(model, training_only=True)]
    if norms:
        found.append(f"{len(norms)} BatchNorm layers in training mode: each normalises a micro-batch of "
                     f"{seen} samples with that micro-batch's statistics, not the window's {window}. "
                     f"Remedies: {REMEDIES}")
    dropout = dropout_layers(model)
    if dropout:
        found.append(f"{len(dropout)} dropout layers in training mode ({', '.join(dropout[:4])}"
                     f"{', …' if len(dropout) > 4 else ''}): their random masks depend on how the window is cut; "
                     "the step matches the big batch's in distribution, not draw for draw")
    probe = micro[0] if len(micro[0]) >= 2 else big.head(2)  # a micro-batch: it fits
    try:
        others = [n for n in batch_dependent_modules(model, probe) if n not in norms]
    except Exception as e:
        if not memory.is_oom(e):
            raise
        others = []
        found.append("(the search for other batch-dependent modules ran out of memory and was skipped)")
    if others:
        found.append(f"modules whose output for a sample depends on the other samples of its batch: "
                     f"{', '.join(others[:6])}{', …' if len(others) > 6 else ''}")
    return found


@torch.no_grad()
def batch_dependent_modules(model: nn.Module, batch: Batch | tuple) -> list[str]:
    """Modules whose output for the first half of a batch changes when the second half is left out (each run on
    its own recorded input, dropout off); only the innermost such modules are named."""
    probe = cpu_copy(model, torch.float32)
    for name in dropout_layers(probe):
        probe.get_submodule(name).eval()
    batch = as_batch(batch).apply(lambda t: t.to("cpu").float() if t.is_floating_point() else t.to("cpu"))
    n, recorded = len(batch.target), {}
    hooks = [m.register_forward_hook(functools.partial(_record, recorded, name), with_kwargs=True)
             for name, m in probe.named_modules() if name]
    try:
        batch.forward(probe)
    finally:
        for hook in hooks:
            hook.remove()
    k = max(1, n // 2)
    flagged = []
    for name, (args, kwargs) in recorded.items():
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if n < 2 or not tensors or any(t.dim() == 0 or len(t) != n for t in tensors):
            continue  # not batch-first: cannot be probed this way
        module = probe.get_submodule(name)
        whole = _first_tensor(module(*args, **kwargs))
        part = _first_tensor(module(*_head(args, k), **{key: _head(v, k) for key, v in kwargs.items()}))
        if whole is None or part is None or len(whole) != n:
            continue
        scale = whole[:k].abs().max().clamp_min(1e-6)
        if not torch.allclose(whole[:k], part, rtol=1e-3, atol=1e-4 * float(scale)):
            flagged.append(name)
    return [f for f in flagged if not any(other.startswith(f + ".") for other in flagged)]


def _record(store: dict, name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    store.setdefault(name, (args, kwargs))


def _head(value: Any, k: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[:k]
    if isinstance(value, tuple):
        return tuple(_head(v, k) for v in value)
    return value


def _first_tensor(output: Any) -> Optional[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None
