"""data=hf's items, read on demand from the tokenized records' memory-mapped Arrow files (what `Dataset.map` wrote and
caches): host memory holds, per record, a few integers of bookkeeping (its row, its length) — never its tokens — so
it stays flat in the number of records. Items are data=text's: {input_ids, attention_mask, labels[,
document_ids]}, and packing (data/packing.py) is laid out from the records' lengths alone, each block read when
asked."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset


class ArrowItems(Dataset):
    """The records `rows` of a tokenized table (columns input_ids, labels, length; class for classification), as
    items: one per record, or (`packing`) per block of `max_length` tokens — whole documents (documents) or the
    records end to end, cut (concat)."""

    def __init__(self, table: Any, rows: np.ndarray, max_length: int, packing: Optional[str], ignore_index: int,
                 classes: bool = False) -> None:
        self.table = table.with_format("numpy", columns=["input_ids", "labels", *(("class",) if classes else ())])
        self.rows, self.max_length, self.packing = rows.astype(np.int64), max_length, packing
        self.ignore_index, self.classes = ignore_index, classes
        lengths = np.asarray(table.data.column("length").to_numpy(), dtype=np.int64)[self.rows]
        self.record_lengths = lengths
        if packing == "documents":  # a new block where the next document would not fit (data/packing.py's pack)
            self.starts = document_blocks(np.minimum(lengths, max_length), max_length)
        elif packing == "concat":
            self.ends = np.concatenate([[0], np.cumsum(lengths)])  # each record's end in the stream of tokens
            total = int(self.ends[-1])
            self.blocks = total // max_length + (total % max_length > 1)  # a last block of one token is dropped

    def __len__(self) -> int:
        if self.packing == "documents":
            return len(self.starts) - 1
        return self.blocks if self.packing == "concat" else len(self.rows)

    def lengths(self) -> torch.Tensor:
        """Every item's length in tokens, from the records' lengths (no item is read)."""
        if self.packing == "documents":
            cum = np.concatenate([[0], np.cumsum(np.minimum(self.record_lengths, self.max_length))])
            return torch.from_numpy(cum[self.starts[1:]] - cum[self.starts[:-1]])
        if self.packing == "concat":
            total = int(self.ends[-1])
            return torch.tensor([min(self.max_length, total - b * self.max_length) for b in range(self.blocks)])
        return torch.from_numpy(self.record_lengths.copy())

    def truncated(self, i: int) -> bool:
        """Whether item `i` is a record cut at max_length (a packed block is never said to be)."""
        return not self.packing and bool(self.table.data.column("truncated")[int(self.rows[i])].as_py())

    def record(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        row = self.table[int(self.rows[position])]
        return row["input_ids"], (row["class"] if self.classes else row["labels"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"item {i} of {len(self)}")
        if self.packing == "documents":
            return self.documents(int(self.starts[i]), int(self.starts[i + 1]))
        if self.packing == "concat":
            return self.concatenated(i)
        ids, labels = self.record(i)
        return item(ids, labels)

    def documents(self, first: int, end: int) -> dict[str, torch.Tensor]:
        """Records first … end − 1 as one block; each document's first label after the block's first ignored."""
        ids, labels, documents = [], [], []
        for number, position in enumerate(range(first, end), 1):
            doc_ids, doc_labels = self.record(position)
            doc_ids, doc_labels = doc_ids[: self.max_length], np.array(doc_labels[: self.max_length])
            if number > 1 and len(doc_labels):
                doc_labels[0] = self.ignore_index  # never predicted from the previous document's end
            ids.append(doc_ids)
            labels.append(doc_labels)
            documents.append(np.full(len(doc_ids), number))
        block = item(np.concatenate(ids), np.concatenate(labels))
        block["document_ids"] = torch.from_numpy(np.concatenate(documents).astype(np.int64))
        return block

    def concatenated(self, b: int) -> dict[str, torch.Tensor]:
        """Tokens [b × max_length, (b + 1) × max_length) of the records end to end."""
        start, stop = b * self.max_length, min((b + 1) * self.max_length, int(self.ends[-1]))
        first = int(np.searchsorted(self.ends, start, side="right")) - 1
        ids, labels = [], []
        position = first
        while position < len(self.rows) and self.ends[position] < stop:
            doc_ids, doc_labels = self.record(position)
            lo = max(0, start - int(self.ends[position]))
            hi = min(len(doc_ids), stop - int(self.ends[position]))
            ids.append(doc_ids[lo:hi])
            labels.append(doc_labels[lo:hi])
            position += 1
        return item(np.concatenate(ids), np.concatenate(labels))


def document_blocks(lengths: np.ndarray, max_length: int) -> np.ndarray:
    """Where each block of whole documents starts (positions in the records, and the end): a new block begins when
    the next document would not fit."""
    starts, filled = [0], 0
    for position, length in enumerate(lengths.tolist()):
        if filled and filled + length > max_length:
            starts.append(position)
            filled = 0
        filled += length
    starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)


def item(ids: np.ndarray, labels: Any) -> dict[str, torch.Tensor]:
    """{input_ids, attention_mask, labels} of int64 tensors."""
    input_ids = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                labels=torch.as_tensor(np.asarray(labels, dtype=np.int64)))
