"""`accutrain-check --show-sample[=N]`: one training sample as the model reads it, the tokens the loss counts marked
— what chat and prompt masking (and packing) made of a record — without building the model."""
from __future__ import annotations

import itertools
from typing import Any

import torch

from accutrain.config.targets import instantiate, run_arguments
from accutrain.config.train import TrainConfig
from accutrain.data import checks as data_checks
from accutrain.errors import UserError

OPEN, CLOSE = "⟦", "⟧"  # around the tokens counted in the loss
CUT = "✂"  # where a record longer than data.max_length was cut


def decode(tok: Any, ids: list[int]) -> str:
    """The text of `ids`: the tokenizer's decode, or for the byte tokenizer its bytes (<pad>, <eos>, <unk> named)."""
    if hasattr(tok, "decode"):
        return tok.decode(ids)
    names = {256: "<pad>", 257: "<eos>", 258: "<unk>"}
    out, pending = [], bytearray()
    for i in ids:
        if i < 256:
            pending.append(i)
            continue
        out.append(pending.decode("utf-8", errors="replace"))
        pending = bytearray()
        out.append(names.get(i, f"<{i}>"))
    return "".join(out) + pending.decode("utf-8", errors="replace")


def show_sample(cfg: TrainConfig, index: int) -> str:
    """Training sample `index` of the configured data, rendered with the tokens whose label is not
    loss.ignore_index between ⟦ and ⟧ (the targets the loss predicts, each from the token before it), a line per
    packed document boundary."""
    supplied = run_arguments("data", cfg.data, dict(seed=cfg.seed))
    with torch.random.fork_rng(devices=[]):
        datasets, _ = data_checks.prepare(instantiate("data", cfg.data.node(supplied)), cfg)
    train, tok = datasets.train, datasets.tokenizer
    if datasets.stream is not None:  # a stream: its sample `index` in the order it is read (before the shuffle)
        item = next(itertools.islice(datasets.stream.open(None), index, None), None) if index >= 0 else None
        if item is None:
            raise UserError(f"--show-sample={index}: the stream holds fewer samples")
        of = "the stream (in the order it is read, before its shuffle buffer)"
    elif not 0 <= index < len(train):
        raise UserError(f"--show-sample={index}: the training split has {len(train)} samples (0 to {len(train) - 1})")
    else:
        item, of = train[index], str(len(train))
    if tok is not None and isinstance(item, dict) and ("chosen.input_ids" in item or "completion.labels" in item):
        return preference_sample(item, tok, cfg.loss.get("ignore_index", -100),
                                 f"training sample {index} of {of}, data {datasets.description}")
    cut = datasets.stream is None and hasattr(train, "truncated") and train.truncated(index)
    if tok is None or not isinstance(item, dict) or "input_ids" not in item or item["labels"].dim() != 1:
        raise UserError("--show-sample shows a language-modelling sample of tokenized text (data=text, data=hf); "
                        f"this data ({cfg.data.target}) has none")
    ids, labels = item["input_ids"].tolist(), item["labels"].tolist()
    counted = [label != cfg.loss.get("ignore_index", -100) for label in labels]
    documents = item.get("document_ids")
    starts = {0} if documents is None else {i for i in range(len(ids)) if i == 0 or documents[i] != documents[i - 1]}
    rendered: list[str] = []
    run: list[int] = []
    flag = False

    def flush() -> None:
        if run:
            body = decode(tok, run)
            rendered.append(f"{OPEN}{body}{CLOSE}" if flag else body)
            run.clear()

    for position, token in enumerate(ids):
        if position in starts and position:
            flush()
            rendered.append(f"\n── document {int(documents[position])} ──\n")
        if counted[position] != flag:
            flush()
            flag = counted[position]
        run.append(token)
    flush()
    head = (f"training sample {index} of {of}, data {datasets.description}\n{len(ids)} tokens, "
            f"{sum(counted)} counted in the loss, between {OPEN} and {CLOSE}; the rest is context"
            + (f"; {len(starts)} packed documents" if documents is not None else "")
            + (f"\ntruncated: the record is longer than data.max_length={len(ids)}, cut at {CUT}: what follows "
               "it in the record is not trained on" if cut else ""))
    rendered += [f"{CUT}[cut at data.max_length={len(ids)}]"] if cut else []
    return head + "\n" + "".join(rendered)


def marked(tok: Any, ids: list[int], counted: list[bool]) -> str:
    """The tokens' text, the runs of counted ones between ⟦ and ⟧."""
    out = []
    for flag, run in itertools.groupby(zip(ids, counted), key=lambda pair: pair[1]):
        body = decode(tok, [token for token, _ in run])
        out.append(f"{OPEN}{body}{CLOSE}" if flag else body)
    return "".join(out)


def preference_sample(item: dict, tok: Any, ignore_index: int, head: str) -> str:
    """A preference record as the loss reads it: a pair's chosen and rejected sequences (or a feedback record's
    completion, with its label), the completion tokens whose log-probabilities the loss takes between ⟦ and ⟧."""
    if "chosen.input_ids" in item:
        roles = [("chosen", item["chosen.input_ids"], item["chosen.labels"]),
                 ("rejected", item["rejected.input_ids"], item["rejected.labels"])]
    else:
        label = "desirable" if int(item["desirable"]) else "undesirable"
        roles = [(f"completion ({label})", item["input_ids"], item["completion.labels"])]
    parts = [head]
    for role, ids, labels in roles:
        counted = [label != ignore_index for label in labels.tolist()]
        parts.append(f"── {role}: {len(ids)} tokens, {sum(counted[1:])} in its log-probability, between {OPEN} and "
                     f"{CLOSE} ──\n{marked(tok, ids.tolist(), counted)}")
    return "\n".join(parts)
