"""Each training sample's length in tokens, for the window sampler: what micro_tokens cuts by and what the metrics'
padding fraction counts (accutrain.core.token_budget)."""
from __future__ import annotations

from typing import Optional

import torch

from accutrain.core.batches import BatchFormat, FlatCollate, PadCollate
from accutrain.core.token_budget import TokenLengths
from accutrain.data.datasets import Datasets
from accutrain.errors import UserError


def token_lengths(datasets: Datasets, batches: BatchFormat, micro_tokens: Optional[int],
                  needed: Optional[str] = None) -> Optional[TokenLengths]:
    """Token data's lengths: items padded per micro-batch (PadCollate: data=text, data=hf) by their longest 1-D
    tensor (padding-free, FlatCollate: their sum), fixed-width token sequences (data=sequences, which come padded:
    no padding figures) by their width; None for other data, where micro_tokens (or what `needed` names) is one line, as is a budget below the longest sample."""
    train, collate = datasets.train, batches.collate
    first = train[0]
    if isinstance(collate, FlatCollate):  # padding-free: a micro-batch holds its samples' tokens, no more
        lengths = train.lengths() if hasattr(train, "lengths") else torch.tensor(
            [len(train[i]["input_ids"]) for i in range(len(train))])
        tokens = TokenLengths(lengths, None, micro_tokens, free=True)
    elif isinstance(collate, PadCollate) and isinstance(first, dict):
        keys = [key for key in first if key.endswith("input_ids")] or ["input_ids"]  # a text pair: one per text
        if hasattr(train, "lengths") and keys == ["input_ids"]:  # one text per item: its lengths, no item read
            lengths = totals = train.lengths()
        else:
            lengths = torch.tensor([max((len(v) for v in train[i].values() if v.dim() == 1), default=1)
                                    for i in range(len(train))])
            totals = torch.tensor([sum(len(train[i][key]) for key in keys if key in train[i])
                                   for i in range(len(train))])
        tokens = TokenLengths(lengths, collate.length, micro_tokens, rows=len(keys), totals=totals)
    elif len(datasets.sample_shape) == 1 and isinstance(first, (tuple, list)) and not first[0].is_floating_point():
        tokens = TokenLengths(torch.full((len(train),), datasets.sample_shape[0]), datasets.sample_shape[0],
                              micro_tokens, real=False)  # padded already: the budget counts rows × width
    elif micro_tokens is not None or needed:
        raise UserError(f"{needed or f'micro_tokens={micro_tokens}'} cuts micro-batches by tokens; this data's "
                        f"samples are not token sequences (sample shape {tuple(datasets.sample_shape)}): use "
                        "micro_batch=N")
    else:
        return None
    if micro_tokens is not None and micro_tokens < tokens.longest:
        raise UserError(f"micro_tokens={micro_tokens} is less than the longest training sample, {tokens.longest} "
                        f"tokens as a micro-batch holds it: set micro_tokens ≥ {tokens.longest} (or a smaller "
                        "data.max_length)")
    return tokens
