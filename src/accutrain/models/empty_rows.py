"""A micro-batch of zero rows through a Hugging Face model, which cannot take one (its attention reshapes by -1).
Zero rows is a rank's empty share of a short window where every rank must still forward and backward (strategy=fsdp:
its all-gathers and reduce-scatters are in both), and an evaluation rank left without samples. The model runs one
row of token 0 instead, and its outputs are cut back to zero rows: every unit's collectives happen, and the
gradient that row sends back is exact zeros (the loss of zero rows is an empty sum)."""
from __future__ import annotations

from typing import Any, Mapping

import torch

from accutrain.core.chunked_ce import Projection


def no_rows(inputs: Mapping[str, Any]) -> bool:
    """Whether the batch's inputs have zero rows."""
    ids = inputs.get("input_ids")
    return isinstance(ids, torch.Tensor) and ids.shape[0] == 0


def one_row(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """One row of token 0, as long as the batch's rows (the loss compares outputs and targets of that length)."""
    return {"input_ids": inputs["input_ids"].new_zeros(1, *inputs["input_ids"].shape[1:])}


def cut(output: Any) -> Any:
    """The outputs of `one_row` cut back to zero rows: logits, a Projection's hidden states, and any auxiliary
    outputs (router logits, one row per token, cut to none; a scalar × 0)."""
    if isinstance(output, tuple):
        return tuple(cut(o) for o in output)
    if isinstance(output, dict):
        return {name: cut(value) for name, value in output.items()}
    if isinstance(output, Projection):
        return Projection(output.hidden[:0], output.weight, output.bias, output.fused)
    if isinstance(output, torch.Tensor):
        return output[:0] if output.dim() else output * 0
    return output
