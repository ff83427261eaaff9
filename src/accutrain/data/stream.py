"""data=hf with data.streaming=true: the training records read as a stream — the datasets library's IterableDataset
over local files, a save_to_disk directory or a dataset name — each tokenized as it comes by data=hf's own encoding
(its truncation and accounting; a record left with no trained token dropped), never held whole; accutrain's
core/streams.py cuts the windows from it through a seeded shuffle buffer. Every rank reads the whole stream (and
trains on its share of each window). The held-out records (data.val) and the test records are read as data=hf reads
them; the stream's first samples are held, for the checks before training.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any, Iterator, Optional

import numpy as np

from accutrain.data.arrow_items import item
from accutrain.data.datasets import Datasets
from accutrain.data.hf_records import (
    Reading,
    description,
    encoding,
    kept_items,
    task,
    tokenize,
    tokenized_split,
    tokenizer_for,
)
from accutrain.data.hf_sources import load, text_columns
from accutrain.data.records import Where, detail, log_tallies
from accutrain.data.text import Tokenized, tokenized_datasets
from accutrain.errors import UserError

log = logging.getLogger("accutrain")
HEAD = 32  # the stream's first samples, held: what the start-up checks and the model's dry run read


class SampleStream:
    """The training records as a stream of tokenized samples, opened at its beginning or where it stood
    (core.streams.Source); each pass's counts logged at its end."""

    def __init__(self, datasets: Any, r: Reading, arguments: dict[str, Any]) -> None:
        self.datasets, self.r, self.arguments, self.where = datasets, r, arguments, Where(r.train)
        self.buffer_size = r.buffer_size
        self.source: Any = None
        self.counts = dict(row=0, truncated=0, untrained=0)
        self.dropped: list[int] = []  # this pass's rows left with no trained token (listed at its end)

    def open(self, state: Optional[dict]) -> Iterator[dict]:
        """The samples, from `state` (state()'s; None: the beginning)."""
        source = load(self.datasets, self.r.train, self.r.split, self.r.cache_dir, "data.train", streaming=True,
                      text=text_columns(self.r.roles))
        if state is not None:
            source.load_state_dict(state["source"])
        self.source, self.dropped = source, []
        self.counts = dict(state["counts"]) if state is not None else dict(row=0, truncated=0, untrained=0)
        return self.samples(iter(source))

    def state(self) -> dict:
        return dict(source=self.source.state_dict(), counts=dict(self.counts))

    def samples(self, records: Iterator[dict]) -> Iterator[dict]:
        while True:
            try:
                record = next(records)
            except StopIteration:
                break
            except UserError:  # a line of a local file that is not a record: named by its line
                raise
            except Exception as e:  # a malformed line of a file, a network failure
                line = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise UserError(f"data.train={self.r.train}: reading record {self.counts['row']} of the stream "
                                f"failed ({line[:200]})") from None
            row = self.counts["row"]
            self.counts["row"] += 1
            sample = self.encode(record, row)
            if sample is not None:
                yield sample
        self.ended()

    def encode(self, record: dict, row: int) -> Optional[dict]:
        """One record as an item, or None when it is left with no trained token (counted; data.truncation=error:
        refused)."""
        out = tokenize({key: [value] for key, value in record.items()}, [row], where=self.where, **self.arguments)
        self.counts["truncated"] += out["truncated"][0]
        if out["trained"][0] == 0:
            if self.r.truncation == "error":
                raise UserError(f"{self.where(row)} is left with no trained token at data.max_length="
                                f"{self.r.max_length}: raise data.max_length, or set data.truncation=drop to train "
                                "on the others")
            self.counts["untrained"] += 1
            self.dropped.append(row)
            return None
        return item(out["input_ids"][0], out["labels"][0])

    def ended(self) -> None:
        """The pass's counts, its dropped records listed in train.log."""
        for name in self.where.lines(self.dropped).values():
            detail.info(f"data.train: dropped {name}: no trained token left (data.max_length={self.r.max_length})")
        c = self.counts
        log.info(f"data.train={self.r.train}: a pass over the stream ended: {c['row']:,} records read, "
                 f"{c['truncated']:,} truncated at data.max_length={self.r.max_length}, {c['untrained']:,} left with "
                 "no trained token" + (" and dropped (listed in train.log)" if c["untrained"] else ""))


def stream_data(datasets: Any, r: Reading) -> Datasets:
    """data=hf's Datasets for a stream: its first samples as the training split the checks read, the stream itself
    (`stream`) for the windows; the held-out and test records read as data=hf reads them."""
    if r.val is None:
        raise UserError("data.streaming=true reads data.train as a stream, which is not split: give the held-out "
                        "records as data.val=<a file or a dataset name>")
    if r.buffer_size < 1:
        raise UserError(f"data.buffer_size={r.buffer_size} is not valid: expected the number of records the shuffle "
                        "buffer holds, 1 or more (e.g. 1000; 1: no shuffling)")
    if r.packing:
        raise UserError("data.streaming=true cannot pack: packing lays blocks out over the whole training set; "
                        "set data.packing=false")
    text = text_columns(r.roles)
    first = next(iter(load(datasets, r.train, r.split, r.cache_dir, "data.train", streaming=True, text=text)), None)
    if first is None:
        raise UserError(f"data.train={r.train} holds no record")
    if r.roles["anchor"] in first and r.roles["positive"] in first:
        raise UserError("data.streaming=true reads language-modelling records (text, prompt/response, chat); "
                        f"{r.train} holds text pairs (data.columns.anchor and .positive): set data.streaming=false")
    kind = task(list(first), r.roles, r.train)
    if kind == "classes":
        raise UserError("data.streaming=true reads language-modelling records (text, prompt/response, chat); "
                        "classes are named from the whole training set: set data.streaming=false")
    tok, template = tokenizer_for(kind, r.tokenizer, r.chat_template)
    arguments = encoding(r, kind, tok, template, None)
    stream = SampleStream(datasets, r, arguments)
    head = list(itertools.islice(stream.open(None), HEAD))
    if not head:
        raise UserError(f"data.train={r.train}: no record is left with a trained token at "
                        f"data.max_length={r.max_length}: raise data.max_length")
    parts = [tokenized_split(datasets, key, name, load(datasets, name, part_split, r.cache_dir, key, text=text), kind,
                             arguments)
             for key, name, part_split in (("data.val", r.val, r.val_split), ("data.test", r.test, r.test_split))
             if name is not None]
    held = [kept_items(table, np.arange(len(table)), tally, r, kind, split)
            for (table, tally, _), split in zip(parts, ("held-out", "test"))]
    log_tallies([t for _, t, _ in parts], [w for _, _, w in parts], r.truncation, r.max_length, lm=True)
    made = tokenized_datasets([Tokenized(head), *held], tok, None, r.max_length, r.padding, r.ignore_index,
                              description(r, kind, template, None).replace(" (", " (a stream, shuffle buffer "
                              f"{r.buffer_size}; ", 1))
    return dataclasses.replace(made, stream=stream)
