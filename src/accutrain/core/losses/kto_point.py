"""KTO's reference point z0 = max(0, mean over mismatched (prompt, completion) pairs of log π(y'|x) − log π_ref(y'|x))
over a set of feedback samples — a window (every micro-batch, every rank), or the held-out split — without gradient.

The mismatched pairs are drawn from the seed within the set, not within a micro-batch: the set's samples are ordered
by a keyed hash of (seed, their index in the split) and each prompt takes the completion of the sample after it in
that order (the last the first's): a derangement that depends on the set and the seed only, so it is the same under
any split into micro-batches and ranks. A set of one sample has no mismatched pair: z0 = 0."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as tdist

from accutrain.core.batches import Batch

Sample = tuple[int, list[int], list[int]]  # index in its split, the prompt's tokens, the completion's tokens


def samples_of(batch: Batch) -> list[Sample]:
    """A feedback micro-batch's samples as (index, prompt tokens, completion tokens), on the host."""
    ids, mask = batch.inputs["input_ids"].cpu(), batch.inputs["attention_mask"].cpu()
    lengths, prompts = mask.sum(1).tolist(), batch.inputs["prompt.length"].cpu().tolist()
    index = batch.target.cpu().tolist()
    return [(index[b], ids[b, : prompts[b]].tolist(), ids[b, prompts[b] : lengths[b]].tolist())
            for b in range(len(index))]


def gathered(local: list[Sample], world: int) -> list[Sample]:
    """Every rank's samples (one all_gather_object: token lists, on the host)."""
    if world <= 1:
        return list(local)
    everyone: list = [None] * world
    tdist.all_gather_object(everyone, local)
    return [s for part in everyone for s in part]


def order_key(seed: int, index: int) -> bytes:
    return hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()


def partners(samples: list[Sample], seed: int) -> dict[int, list[int]]:
    """Each sample's (by index) mismatched completion: the next one's in the seeded order."""
    ordered = sorted(samples, key=lambda s: (order_key(seed, s[0]), s[0]))
    n = len(ordered)
    return {s[0]: ordered[(k + 1) % n][2] for k, s in enumerate(ordered)} if n > 1 else {}


def mismatched_batch(local: list[Sample], completions: dict[int, list[int]], pad: int, ignore_index: int,
                     device: torch.device) -> Batch:
    """The local samples' prompts, each with its partner's completion, padded: input_ids, attention_mask, labels
    (the completion's tokens, the prompt's ignore_index)."""
    rows = [(prompt, completions[index]) for index, prompt, _ in local]
    longest = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), longest), pad, dtype=torch.int64)
    labels = torch.full((len(rows), longest), ignore_index, dtype=torch.int64)
    mask = torch.zeros((len(rows), longest), dtype=torch.int64)
    for r, (prompt, completion) in enumerate(rows):
        whole = torch.tensor(prompt + completion, dtype=torch.int64)
        ids[r, : len(whole)], mask[r, : len(whole)] = whole, 1
        labels[r, len(prompt) : len(whole)] = whole[len(prompt):]
    return Batch({"input_ids": ids.to(device), "attention_mask": mask.to(device)}, labels.to(device))


@dataclass
class Point:
    """A reference point and what it was taken over: Σ of the mismatched pairs' log-ratios, their count (every
    rank's)."""

    total: torch.Tensor
    count: torch.Tensor

    @property
    def z0(self) -> torch.Tensor:
        return (self.total / self.count.clamp(min=1)).clamp(min=0) if float(self.count) else \
            torch.zeros((), dtype=torch.float64, device=self.total.device)


def reference_point(local: list[Sample], chunk: int, seed: int, world: int, log_ratio: Callable[[Batch], torch.Tensor],
                    pad: int, ignore_index: int, device: torch.device) -> Point:
    """z0 over every rank's samples `local` (this rank's): their mismatched pairs' log-ratios (`log_ratio` of a
    batch: log π − log π_ref per row, without gradient), this rank's taken `chunk` at a time, summed over ranks."""
    completions = partners(gathered(local, world), seed)
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    if completions:
        for start in range(0, len(local), max(1, chunk)):
            part = local[start : start + chunk]
            total += log_ratio(mismatched_batch(part, completions, pad, ignore_index, device)).sum()
            count += len(part)
    if world > 1:
        both = torch.stack([total, count])
        tdist.all_reduce(both)
        total, count = both.unbind()
    return Point(total, count)
