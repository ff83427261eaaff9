"""Token data's lengths, and `micro_tokens=N`: micro-batches cut by a token budget instead of a sample count.

The window is fixed first, as always (its samples from the seed; |W| from global_batch or micro_batch × accum ×
devices, or packed blocks); the budget only changes how the window is cut. Its samples are ordered longest first
(a stable sort: ties keep the window's order) and taken greedily into micro-batches whose padded size — rows ×
the longest row (or data.padding=max_length's fixed length) — stays within N tokens. The cut is of the whole
window, whatever the number of devices; micro-batch k then runs on rank k % world at micro-step k // world, as a
fixed micro_batch's chunks do, so every device count takes the same micro-batches and the step is the window's.
Sorting only changes which samples share a micro-batch, never the window: the loss is normalised by the window's
terms, so the step is the big batch's to float rounding.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


class TokenLengths:
    """Each training sample's length in tokens (before padding), how a micro-batch pads them (to its longest row,
    or to `padded_to`), and the budget `micro_tokens` (None: micro-batches of micro_batch samples). `real`: the
    lengths are the samples' real tokens (False for samples that come padded: no padding figures). `rows`: the texts
    one sample is (a text pair's anchor, positive and negatives: each padded to its role's longest, so a micro-batch
    of n samples holds at most n × rows × its longest text). `free`: micro-batches are padding-free (data.padding=free,
    one row of the samples end to end): a micro-batch holds the sum of its samples' lengths."""

    def __init__(self, lengths: torch.Tensor, padded_to: Optional[int] = None, budget: Optional[int] = None,
                 real: bool = True, rows: int = 1, totals: Optional[torch.Tensor] = None, free: bool = False) -> None:
        self.lengths, self.padded_to, self.budget, self.real = lengths.to(torch.int64), padded_to, budget, real
        self.rows, self.totals = rows, (totals if totals is not None else lengths * rows).to(torch.int64)
        self.free = free

    def with_budget(self, budget: Optional[int]) -> TokenLengths:
        """The same lengths cut by another budget (micro_tokens=auto's trials, its finding)."""
        return TokenLengths(self.lengths, self.padded_to, budget, self.real, self.rows, self.totals, self.free)

    def held(self, lengths: Sequence[int]) -> int:
        """The tokens a micro-batch of samples of `lengths` holds: rows × its padded width, or their sum
        (padding-free)."""
        return sum(lengths) if self.free else len(lengths) * self.width(lengths)

    @property
    def longest(self) -> int:
        """The longest sample as a micro-batch holds it (padded_to with data.padding=max_length), all its rows."""
        return self.rows * (self.padded_to or int(self.lengths.max()))

    def width(self, lengths: Sequence[int]) -> int:
        """The padded tokens of one sample in a micro-batch of samples of `lengths`: its rows × their padded
        length."""
        return self.rows * (self.padded_to or max(lengths, default=0))

    def cut(self, samples: Sequence[int]) -> list[list[int]]:
        """A window's `samples` (dataset indices) as micro-batches within the budget: lists of positions in
        `samples`, longest samples first. A sample over the budget alone is refused before training (build)."""
        lengths = self.lengths[torch.as_tensor(list(samples), dtype=torch.int64)].tolist()
        order = sorted(range(len(lengths)), key=lambda p: -lengths[p])
        chunks: list[list[int]] = []
        current: list[int] = []
        held = 0  # the tokens `current` holds
        for p in order:  # longest first: the first row of each micro-batch sets its width
            more = self.held([lengths[p]]) if not current else held + lengths[p] if self.free else \
                self.width([lengths[current[0]]]) * (len(current) + 1)
            if current and more > self.budget:
                chunks.append(current)
                current, more = [], self.held([lengths[p]])
            current.append(p)
            held = more
        if current:
            chunks.append(current)
        return chunks

    def padding(self, micro_batches: Sequence[Sequence[int]]) -> tuple[int, int]:
        """(tokens, padded tokens) of micro-batches of dataset indices: the real tokens and rows × width (padding-free:
        the real tokens again)."""
        real = padded = 0
        for indices in micro_batches:
            if not indices:
                continue
            at = torch.as_tensor(list(indices), dtype=torch.int64)
            real += int(self.totals[at].sum())  # every text's real tokens
            padded += int(self.totals[at].sum()) if self.free else self.held(self.lengths[at].tolist())
        return real, padded
