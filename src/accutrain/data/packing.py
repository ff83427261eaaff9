"""data.packing: language-modelling samples packed into blocks of max_length tokens, the windows then drawn over
the blocks (the seed still fixes them first).

- `true` (documents): whole documents (a sample, ending with its EOS; one longer than a block is truncated to it,
  as without packing) placed end to end in file order, a new block begun when the next would not fit. Each block
  carries `document_ids` (1, 2, … per document; 0 on padding), from which the model (models/hf.py) gives every
  document positions from 0 and attention inside itself only: a packed block gives each document the logits it
  would get alone. The first token of every document but the block's first has its label set to ignore_index, so
  the shifted loss never predicts one document's first token from the previous document's EOS — what a document
  alone never does either.
- `concat`: the samples end to end, cut every max_length tokens (documents split across blocks, attention and the
  loss crossing from one document into the next): the former `packing=true`.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from accutrain.errors import UserError

log = logging.getLogger("accutrain")

Sample = tuple  # (ids, labels) or, packed by documents, (ids, labels, document ids)


def packing_mode(packing: Any) -> Optional[str]:
    """data.packing as "documents" (true), "concat", or None (false); anything else is one line."""
    if isinstance(packing, bool):
        return "documents" if packing else None
    if packing == "concat":
        return "concat"
    raise UserError(f"data.packing={packing} is not valid: expected true (whole documents per block, each attending "
                    "to itself only), concat (the samples end to end, attention crossing documents) or false")


def packing_name(mode: Optional[str]) -> str:
    """The data.packing value that gives `mode`."""
    return {"documents": "true", "concat": "concat", None: "false"}[mode]


def pack(samples: list[Sample], length: int, mode: str, ignore_index: int) -> list[Sample]:
    """The samples packed into blocks of at most `length` tokens, as `mode` (packing_mode) says."""
    if mode == "concat":
        ids = [t for sample, _ in samples for t in sample]
        labels = [t for _, sample_labels in samples for t in sample_labels]
        return [(ids[i : i + length], labels[i : i + length]) for i in range(0, len(ids), length)
                if len(ids) - i > 1]
    blocks: list[Sample] = []
    ids: list[int] = []
    labels: list[int] = []
    documents: list[int] = []
    for sample, sample_labels in samples:
        sample, sample_labels = list(sample[:length]), list(sample_labels[:length])
        if ids and len(ids) + len(sample) > length:
            blocks.append((ids, labels, documents))
            ids, labels, documents = [], [], []
        if ids and sample_labels:
            sample_labels[0] = ignore_index  # never predicted from the previous document's end
        number = (documents[-1] + 1) if documents else 1
        ids, labels, documents = ids + sample, labels + sample_labels, documents + [number] * len(sample)
    if ids:
        blocks.append((ids, labels, documents))
    return blocks


def describe(mode: Optional[str]) -> str:
    """The packing for the data's description; a note in the log when attention crosses documents."""
    if mode == "concat":
        log.info("data.packing=concat: samples are concatenated and cut into blocks, so attention (and the loss) "
                 "crosses from one document into the next; data.packing=true keeps each document to itself")
        return ", packed (concat)"
    return ", packed by documents" if mode == "documents" else ""
