"""What loss=dpo, orpo and kto share as Loss families (accutrain.core.loss): |W| counts samples (a pair is one), the
reference policy (logps.Reference) made when the loss is attached to the model, the evaluation summed per batch,
accutrain-check's reference (the window as one batch), and the check that the data is what the family takes."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
import torch.distributed as tdist
from torch import nn

from accutrain.core.batches import Batch, as_batch
from accutrain.core.gradcache import on
from accutrain.core.losses.logps import Reference, role_inputs
from accutrain.core.losses.precomputed import Splits, Table, prepare_table
from accutrain.core.precision import Precision
from accutrain.errors import UserError


def reduced(tally: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's tally, summed (one all-reduce)."""
    if world > 1:
        tally = tally.clone()
        tdist.all_reduce(tally)
    return tally


@dataclass
class PreferenceLoss:
    """The members loss=dpo, orpo and kto share; a subclass gives `pairs`/its window (`accumulate`), `eval_batch`,
    `eval_width`, `eval_metrics`, `figures_of` and its messages."""

    ignore_index: int = -100
    ref: Optional[Reference] = field(default=None, repr=False)  # made by attach(): the base, or a frozen copy
    precompute: bool = False  # loss.reference=precompute: π_ref's log-probabilities taken before training (prepare)
    table: Optional[Table] = field(default=None, repr=False)  # … and kept here (core/losses/precomputed.py)
    name = "preference"
    elements = False
    tokens = False
    min_window = 1
    whole_window = False
    output = "logits"
    item_keys = ("input_ids",)  # the keys an item of the family's data has
    wanted = ""  # what that data is, for the message
    reference_free = False

    def target(self, labels: torch.Tensor) -> torch.Tensor:
        return labels

    def terms(self, micro_batches: Iterable) -> int:
        """|W|: the samples (a pair is one)."""
        return sum(len(as_batch(b)) for b in micro_batches)

    def reference_logps(self, model: nn.Module, batch: Batch, role: str, inputs: dict[str, torch.Tensor],
                        labels: torch.Tensor, precision: Precision) -> torch.Tensor:
        """The reference policy's summed log-probabilities of the sequences `inputs` (role's), without gradient."""
        if self.table is not None:
            return self.table.logps(inputs, labels)
        if self.precompute and self.ref is None:  # before prepare(): micro_batch=auto's trial steps, at the weights
            self.ref = Reference(model, live=True)  # as built (the reference itself); prepare() drops it
        if self.ref is None:
            raise UserError(f"loss={self.name}: the reference model was not made (the loss was not attached to the "
                            "model before training)")
        return self.ref.logps(model, inputs, labels, self.ignore_index, precision.inputs, precision.autocast)

    # --- evaluation (summed per batch; KTO's takes its reference point first) --------------------------------------
    def evaluate(self, model: nn.Module, loader: Iterable, device: torch.device, precision: Precision,
                 world: int) -> torch.Tensor:
        bare = getattr(model, "module", model)
        training = bare.training
        bare.eval()
        sums = torch.zeros(self.eval_width(), dtype=torch.float64, device=device)
        try:
            for batch in loader:
                sums += self.eval_batch(bare, on(as_batch(batch), device), precision)
        finally:
            bare.train(training)
        return sums

    # --- the rest of the protocol ------------------------------------------------------------------------------
    def reference(self, model: nn.Module, batch: Batch, device: torch.device, precision: Precision) -> torch.Tensor:
        """accutrain-check's reference: the whole window as one micro-batch."""
        return self.accumulate(model, [batch], len(as_batch(batch)), device, precision=precision)

    def probe(self, batch: Batch) -> Batch:
        """One sequence per row (a pair's chosen; a feedback record's prompt + completion), its labels the target."""
        role = self.item_keys[0].rsplit(".", 1)[0] if "." in self.item_keys[0] else ""
        self.check_keys(batch, "")
        labels = batch.inputs[f"{role}.labels" if role else "completion.labels"]
        return Batch(role_inputs(batch.inputs, role), labels, batch.stand_in)

    def check_keys(self, batch: Batch, data: str) -> None:
        """One line when the data's items are not the family's records."""
        keys = list(batch.inputs) if isinstance(batch.inputs, Mapping) else []
        if any(key not in keys for key in self.item_keys):
            have = ", ".join(keys) if keys else f"inputs of shape {tuple(getattr(batch.inputs, 'shape', ()))}"
            raise UserError(f"loss={self.name} trains on {self.wanted}; this data{f' ({data})' if data else ''} "
                            f"gives {have}: give such records (data=text data.train=<.jsonl>, or data=hf), or another "
                            "loss")

    def check(self, model: nn.Module, batch: Batch, data: str) -> None:
        """The data holds what the family takes, and the model gives one logit per token of its vocabulary."""
        self.check_keys(batch, data)
        probe = self.probe(batch)
        with torch.no_grad():
            output = probe.forward(getattr(model, "module", model))
        shape = getattr(output, "shape", None)
        if shape is None or len(shape) != 3 or shape[2] != probe.target.shape[1]:
            raise UserError(f"loss={self.name} needs a causal language model's logits per token (batch, vocabulary, "
                            f"length): model=hf_causal_lm; this model returns {shape}")

    def attach(self, model: nn.Module) -> list[str]:
        """The reference policy: the base with its adapter disabled (model.adapter=lora), else a frozen copy."""
        if self.reference_free or self.precompute:  # precompute: prepare() takes it from the model as built
            return []
        self.ref = Reference(model)
        if self.ref.copy is not None:
            return [f"loss={self.name}: the reference policy is {self.ref.describe()}; with model.adapter=lora it is "
                    "the base with the adapter disabled, no copy"]
        return []

    def prepare(self, model: nn.Module, splits: Splits, device: torch.device, precision: Precision) -> list[str]:
        """loss.reference=precompute: every sequence's reference log-probability, from the model as built (before
        the first step; the base with its adapter disabled), kept in the run directory or read back from it."""
        if not self.precompute:
            return []
        live = Reference(model, live=True)
        roles = [key.rsplit(".", 1)[0] for key in self.item_keys if key.endswith(".input_ids")]

        def logps(batch: Batch) -> list:
            batch, found = on(batch, device), []
            for role in roles:
                inputs, labels = role_inputs(batch.inputs, role), batch.inputs[f"{role}.labels"]
                found.append((inputs, labels, live.logps(model, inputs, labels, self.ignore_index, precision.inputs,
                                                         precision.autocast)))
            return found

        self.table, lines = prepare_table(splits, logps, self.name, device)
        self.ref = None
        return lines

    def figures(self) -> dict[str, torch.Tensor]:
        return self.measured

    def components(self) -> dict[str, Any]:
        return {}

