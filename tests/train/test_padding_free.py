"""data.padding=free: a micro-batch's samples end to end in one row of real tokens, each document with its own
positions and attention — every document's logits and loss, and the weights, those of the padded micro-batches."""
import random

import pytest
import torch
from conftest import final_weights, read_metrics, train_here

from accutrain.core.batches import FlatCollate, PadCollate
from accutrain.core.chunked_ce import logits_of
from accutrain.core.losses.cross_entropy import SummedLoss
from accutrain.core.token_budget import TokenLengths

DOCS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15], [16], [17, 18, 19]]


def items(docs, blocks=False):
    if blocks:  # a packed block of two documents (data.packing=true): its second's first label already ignored
        ids = docs[0] + docs[1]
        return [dict(input_ids=torch.tensor(ids), labels=torch.tensor(docs[0] + [-100] + docs[1][1:]),
                     document_ids=torch.tensor([1] * len(docs[0]) + [2] * len(docs[1])))]
    return [dict(input_ids=torch.tensor(d), attention_mask=torch.ones(len(d), dtype=torch.int64),
                 labels=torch.tensor(d)) for d in docs]


def test_the_samples_lie_end_to_end_each_document_numbered_its_first_label_ignored():
    batch = FlatCollate()(items(DOCS[:2]) + items(DOCS[2:4], blocks=True) + items(DOCS[4:]))
    assert batch.inputs["input_ids"].tolist() == [sum(DOCS, [])]
    assert batch.inputs["document_ids"].tolist() == [[1] * 5 + [2] * 2 + [3] * 4 + [4] + [5] * 3]
    starts = {0, 5, 7, 11, 12}
    assert batch.target.tolist() == [[-100 if i in starts else t for i, t in enumerate(sum(DOCS, []))]]
    assert batch.spans == (5, 2, 5, 3) and len(batch) == 4  # samples: two documents, a block, a document
    halves = batch.split(2)
    assert [len(h) for h in halves] == [2, 2] and halves[1].inputs["input_ids"].tolist() == [sum(DOCS[2:], [])]
    assert len(batch.head(0)) == 0 and batch.head(1).target.shape == (1, 5)


def test_a_padding_free_budget_counts_real_tokens():
    lengths = torch.tensor([3, 9, 4, 9, 1, 7, 2, 5])
    free = TokenLengths(lengths, budget=20, free=True)
    chunks = free.cut(list(range(8)))
    assert [[int(lengths[p]) for p in c] for c in chunks] == [[9, 9], [7, 5, 4, 3], [2, 1]]  # ≤ 20 real tokens
    assert free.padding([[1, 3, 4]]) == (19, 19)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_each_document_gets_its_padded_logits_and_loss(kind, attention):
    pytest.importorskip("transformers")
    from accutrain.models.hf import causal_lm

    config = (dict(model_type="gpt2", n_layer=2, n_head=2, n_embd=16, n_positions=32) if kind == "gpt2" else
              dict(model_type="llama", num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   hidden_size=16, intermediate_size=32, max_position_embeddings=32))
    torch.manual_seed(0)
    model = causal_lm(32, config=config, dropout=0.0, attn_implementation=attention).eval()
    loss = SummedLoss(elements=True, shift_labels=True)
    pad = PadCollate(dict(input_ids=0, attention_mask=0, labels=-100))(items(DOCS))
    flat = FlatCollate()(items(DOCS))
    with torch.no_grad():
        padded_out = model(**{k: v for k, v in pad.items() if k != "labels"})
        flat_out = model(**flat.inputs)
    start = 0
    for row, doc in enumerate(DOCS):
        torch.testing.assert_close(logits_of(flat_out)[0, :, start : start + len(doc)],
                                   logits_of(padded_out)[row, :, : len(doc)], atol=1e-5, rtol=1e-5)
        start += len(doc)
    assert loss.terms([flat]) == loss.terms([(None, pad["labels"])]) == sum(len(d) - 1 for d in DOCS)
    torch.testing.assert_close(loss(flat_out, flat.target), loss(padded_out, pad["labels"]), atol=1e-5, rtol=1e-6)


GPT2 = ["model=hf_causal_lm", "+model.config.model_type=gpt2", "+model.config.n_layer=2", "+model.config.n_head=2",
        "+model.config.n_embd=32", "+model.config.n_positions=64", "model.dropout=0"]


def lm(tmp_path, *args):
    path = tmp_path / "lm.txt"
    if not path.exists():
        r = random.Random(3)
        words = "the cat sat on a mat and dog ran far away big small red blue".split()
        path.write_text("\n".join(" ".join(r.choice(words) for _ in range(r.randint(1, 12))) for _ in range(41)))
    return [*GPT2, "data=text", f"data.train={path}", "data.val_fraction=0.1", "data.max_length=64", "optim=sgd",
            "optim.lr=0.3", "optim.momentum=0", "trainer.epochs=2", "trainer.progress=false", *args]


def close(a, b):
    for key, value in final_weights(a).items():
        torch.testing.assert_close(value, final_weights(b)[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
def test_padding_free_micro_batches_take_the_padded_steps_with_a_budget_and_with_packing(tmp_path):
    pytest.importorskip("transformers")
    padded, _ = train_here(tmp_path, "padded", *lm(tmp_path, "micro_batch=4", "accum=4"))
    free, log = train_here(tmp_path, "free", *lm(tmp_path, "data.padding=free", "micro_tokens=160",
                                                 "global_batch=16"))
    two, _ = train_here(tmp_path, "two", *lm(tmp_path, "data.padding=free", "micro_tokens=160", "devices=2",
                                             "micro_batch=4", "accum=2"))
    for run in (free, two):
        close(run, padded)
    steps, budget = read_metrics(padded)[0], read_metrics(free)[0]
    assert [r["input_tokens"] for r in budget] == [r["input_tokens"] for r in steps]
    assert [r["elements"] for r in budget] == [r["elements"] for r in steps]
    assert all(r["pad_fraction"] == 0 for r in budget) and any(r["pad_fraction"] > 0.2 for r in steps)
    assert "data.padding=free: each micro-batch is one row" in log
    packed, _ = train_here(tmp_path, "packed", *lm(tmp_path, "data.packing=true", "micro_batch=2", "accum=2"))
    packed_free, _ = train_here(tmp_path, "packed_free", *lm(tmp_path, "data.packing=true", "data.padding=free",
                                                             "micro_batch=4"))
    close(packed_free, packed)
    assert [r["val_loss"] for r in read_metrics(packed_free)[1]] == pytest.approx(
        [r["val_loss"] for r in read_metrics(packed)[1]], rel=1e-5)
