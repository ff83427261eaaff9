"""Blocks packed by documents (data.packing=true) as a Hugging Face causal LM takes them: `document_ids` (1, 2, …
per document of a row, 0 on padding) become position ids that restart at 0 with each document and a block-diagonal
causal mask, so each document attends to itself only and gets the logits it would get alone.

The mask is 4-D, (batch, 1, query, key), in the form the model's attention implementation takes as it is: boolean
(True: attend) for sdpa and flex, additive floats (0 or the dtype's lowest) for eager. Flash-attention
implementations take no such mask: they get the position ids alone, from which transformers finds the documents
(its variable-length path). A padding position attends to the padding before it (its rows are never empty, so no
NaN), and no real token attends to padding.
"""
from __future__ import annotations

from typing import Any

import torch


def positions(documents: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document (a run of equal ids: the padding after the last one too)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    previous = torch.nn.functional.pad(documents, (1, 0), value=-1)[:, :-1]
    starts = torch.where(documents != previous, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - starts


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """(batch, 1, length, length) booleans: query i may attend to key j ≤ i of its own document."""
    index = torch.arange(documents.shape[1], device=documents.device)
    same = documents[:, :, None] == documents[:, None, :]
    return (same & (index[:, None] >= index[None, :]))[:, None]


def document_inputs(inputs: dict[str, Any], attn_implementation: str, dtype: torch.dtype) -> dict[str, Any]:
    """The model's keyword inputs for a packed batch: `document_ids` replaced by position_ids and a 4-D mask (or by
    position_ids alone for flash attention)."""
    inputs = dict(inputs)
    documents = inputs.pop("document_ids")
    inputs["position_ids"] = positions(documents)
    inputs.pop("attention_mask", None)
    if "flash" in attn_implementation:
        return inputs
    mask = document_mask(documents)
    if attn_implementation == "eager":
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    inputs["attention_mask"] = mask
    return inputs
