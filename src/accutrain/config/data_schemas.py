"""The schemas of the `data/` group: each option's `_target_` (a factory returning an accutrain.data.Datasets) and
its keyword arguments; accutrain.config.train registers them with the others."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from accutrain.config.schemas import MISSING


# --- data/ --------------------------------------------------------------------------------------------
# `_target_` returns an accutrain.data.Datasets.
@dataclass
class DataConfig:
    _target_: str = MISSING


@dataclass
class DigitsData(DataConfig):
    _target_: str = "accutrain.data.digits"
    test: int = 0  # training images held out as a test split, drawn by the seed (0: no test stage)


@dataclass
class SyntheticData(DataConfig):
    _target_: str = "accutrain.data.synthetic"
    size: int = 1000  # training samples
    val_size: int = 200
    image_size: int = 16
    num_classes: int = 10
    channels: int = 3
    noise: float = 1.0
    seed: int = "${seed}"
    target: str = "classes"  # classes | regression (num_classes floats) | multilabel (multi-hot over num_classes)
    test: int = 0  # generated test samples (0: no test stage)


@dataclass
class TorchvisionData(DataConfig):
    _target_: str = "accutrain.data.torchvision_dataset"
    name: str = MISSING  # cifar10 | mnist
    root: str = "data"
    download: bool = False
    test: bool = False  # true: the test split is the test stage's, validation val_size training images (by the seed)
    val_size: int = 5000  # with test: the training images held out for validation


@dataclass
class SequenceData(DataConfig):
    _target_: str = "accutrain.data.sequences"
    size: int = 2000  # training sequences
    val_size: int = 200
    vocab: int = 24
    min_length: int = 4
    max_length: int = 32  # sequences are padded to this; padded positions are ignored by the loss
    seed: int = "${seed}"
    pad_target: int = "${loss.ignore_index}"
    test: int = 0  # generated test sequences (0: no test stage)


@dataclass
class TextData(DataConfig):
    _target_: str = "accutrain.data.text.text_data"
    train: str = MISSING  # a .txt file (a sample per non-empty line) or .jsonl (text, or prompt/response[, label])
    val: Optional[str] = None  # the held-out file; null: val_fraction of train, held out by the seed
    val_fraction: float = 0.1
    tokenizer: str = "bytes"  # bytes (built in: UTF-8 bytes, no download) | a Hugging Face tokenizer name or path
    max_length: int = 512  # tokens per sample (longer ones are truncated), or per block with packing
    packing: Any = False  # true: whole documents per block, each attending to itself | concat | false
    padding: str = "longest"  # longest: a micro-batch is padded to its own longest sample | max_length
    text_field: str = "text"
    prompt_field: str = "prompt"  # with response_field: the prompt is masked out of the loss
    response_field: str = "response"
    label_field: Optional[str] = "label"  # records carrying it make a sequence classification set
    anchor_field: str = "anchor"  # records with an anchor and a positive are pairs (loss=contrastive)
    positive_field: str = "positive"
    negative_field: Any = "negative"  # a field of one text or a list of texts (mined negatives), or several fields
    seed: int = "${seed}"
    ignore_index: int = "${loss.ignore_index}"
    test: Optional[str] = None  # a test file, evaluated at the end (null: no test stage)
    truncation: str = "drop"  # a record max_length leaves with no trained token: drop (listed in train.log) | error


@dataclass
class HFColumns:
    """data.columns: which column holds each role (a role whose column is absent is not used)."""

    text: str = "text"  # language modelling; with label: sequence classification
    prompt: str = "prompt"  # with response: the prompt is masked out of the loss
    response: str = "response"
    messages: str = "messages"  # chat records: [{role, content}, …], the loss on the assistant's tokens
    label: str = "label"
    anchor: str = "anchor"  # with positive: text pairs (and negatives: triples) for loss=contrastive
    positive: str = "positive"
    negative: Any = "negative"  # a column of one text or a list of texts (mined negatives), or a list of columns
    chosen: str = "chosen"  # with prompt and rejected: preference pairs (loss=dpo, orpo)
    rejected: str = "rejected"
    completion: str = "completion"  # with prompt and label (true/false): feedback records (loss=kto)


@dataclass
class HFData(DataConfig):
    _target_: str = "accutrain.data.hf_data.hf_data"
    train: str = MISSING  # a .json/.jsonl/.csv/.parquet file, a save_to_disk directory, or a dataset name (cached)
    val: Optional[str] = None  # the same for held-out records; null: val_fraction of train, held out by the seed
    val_fraction: float = 0.1
    split: str = "train"  # the split of a dataset name or a DatasetDict directory that train reads
    val_split: str = "validation"  # … and that val reads
    tokenizer: str = "bytes"  # bytes (built in, with a simple chat template) | a Hugging Face tokenizer name or path
    max_length: int = 512
    packing: Any = False  # as data=text's
    padding: str = "longest"
    columns: HFColumns = field(default_factory=HFColumns)
    cache_dir: Optional[str] = None  # where datasets caches what it reads and tokenizes; null: its default
    seed: int = "${seed}"
    ignore_index: int = "${loss.ignore_index}"
    test: Optional[str] = None  # test records (as train is read), evaluated at the end (null: no test stage)
    test_split: str = "test"  # the split of a dataset name or a DatasetDict directory that test reads
    truncation: str = "drop"  # a record max_length leaves with no trained token: drop (listed in train.log) | error
    chat_template: Optional[str] = None  # a Jinja file (or the template) for chat records; null: the tokenizer's
    streaming: bool = False  # read train as a stream (IterableDataset): windows cut from a seeded shuffle buffer
    buffer_size: int = 1000  # with streaming: the shuffle buffer's records


@dataclass
class ImageFolderData(DataConfig):
    _target_: str = "accutrain.data.image_folder"
    root: str = MISSING
    image_size: int = 224
    channels: int = 3
    test: Optional[str] = None  # a test folder (<class>/<image>), under root or a path (null: no test stage)
