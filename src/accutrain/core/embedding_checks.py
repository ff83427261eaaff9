"""What the start-up check asks of an embedding model (loss=contrastive on text): two different texts of the first
window do not embed identically — a model that cannot tell them apart (first-token pooling on a model that attends
causally, a pooling that reads only padding) learns nothing from them, silently."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch

from accutrain.errors import UserError


def texts_of(inputs: Mapping[str, torch.Tensor], names: Sequence[str]) -> list[tuple[str, tuple[int, ...]]]:
    """Each sample's texts, in the order of the embeddings (N, R, D): (its role and sample, its real tokens)."""
    out = []
    count = len(next(iter(inputs.values())))
    for n in range(count):
        for role in names:
            ids = inputs[f"{role}.input_ids"][n]
            mask = inputs.get(f"{role}.attention_mask")
            real = ids[mask[n].bool()] if mask is not None else ids
            out.append((f"the {role} of sample {n}", tuple(real.tolist())))
    return out


def check_distinct(embeddings: torch.Tensor, inputs: Any, roles: Callable[[Any], list[tuple[str, Any]]]) -> None:
    """One line when two different texts of the batch have the same embedding (to float precision); `roles`: the
    batch's text roles in the embeddings' order (contrastive.roles)."""
    if not isinstance(inputs, Mapping) or embeddings.dim() != 3:
        return  # image views: a view may well embed as another
    flat = embeddings.detach().float().flatten(0, 1)
    texts = texts_of(inputs, [name for name, _ in roles(inputs)])
    scale = max(1.0, float(flat.abs().max()))
    close = torch.cdist(flat, flat) <= 1e-5 * scale
    for i, j in close.triu(diagonal=1).nonzero().tolist():
        if texts[i][1] != texts[j][1]:
            raise UserError(f"the model embeds two different texts of the first window identically ({texts[i][0]} "
                            f"and {texts[j][0]}): its embedding does not see what tells them apart, and nothing can "
                            "be learned from it — model.pooling=cls on a model that attends causally sees only the "
                            "first token: use model.pooling=last or mean")
