"""data.packing=true: whole documents per block, each with positions from 0 and attention inside itself, so a packed
block gives every document the logits (and the loss) it gets alone; data.packing=concat keeps the old blocks."""
import pytest
import torch
from conftest import assert_one_line_user_error, read_metrics, run_of, train_here

from accutrain.core.batches import PadCollate
from accutrain.core.chunked_ce import logits_of
from accutrain.core.losses.cross_entropy import SummedLoss
from accutrain.data.packing import pack, packing_mode
from accutrain.data.text import as_items
from accutrain.errors import UserError

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "gpt2": dict(model_type="gpt2", n_layer=2, n_head=2, n_embd=32, n_positions=64),
    "llama": dict(model_type="llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  hidden_size=32, intermediate_size=64, max_position_embeddings=64),
}
DOCS = [[5, 9, 12, 7, 2], [3, 8, 2], [11, 4, 6, 10, 13, 2], [14, 15, 16, 17, 18, 19, 20, 2], [21, 2]]


def test_documents_are_packed_whole_with_their_ids_and_no_label_across_a_boundary():
    samples = [(d, list(d)) for d in DOCS]
    blocks = pack(samples, 16, "documents", -100)
    assert [b[0] for b in blocks] == [DOCS[0] + DOCS[1] + DOCS[2], DOCS[3] + DOCS[4]]  # none split, file order
    assert blocks[0][2] == [1] * 5 + [2] * 3 + [3] * 6 and blocks[1][2] == [1] * 8 + [2] * 2
    assert blocks[0][1] == DOCS[0] + [-100] + DOCS[1][1:] + [-100] + DOCS[2][1:]  # a document's first token: ignored
    assert pack([(list(range(30)), list(range(30)))], 16, "documents", -100)[0][0] == list(range(16))  # truncated
    concat = pack(samples, 16, "concat", -100)
    assert [len(b[0]) for b in concat] == [16, 8] and concat[0][0][:6] == DOCS[0] + DOCS[1][:1]
    assert packing_mode(True) == "documents" and packing_mode("concat") == "concat" and packing_mode(False) is None
    with pytest.raises(UserError) as info:
        packing_mode("yes")
    assert_one_line_user_error(info.value, "data.packing=yes is not valid: expected true")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_packed_block_gives_each_document_its_logits_and_loss_alone(kind, attention, device):
    from accutrain.models.hf import causal_lm

    torch.manual_seed(0)
    model = causal_lm(32, config=dict(CONFIGS[kind]), dropout=0.0, attn_implementation=attention).eval().to(device)
    blocks = pack([(d, list(d)) for d in DOCS], 16, "documents", -100)
    batch = PadCollate(dict(input_ids=0, attention_mask=0, labels=-100, document_ids=0))(
        list(as_items(blocks, None, 16).items))
    batch = {key: value.to(device) for key, value in batch.items()}  # on a GPU: sdpa's fused kernels take the mask
    labels = batch.pop("labels")
    with torch.no_grad():
        output = model(**batch)  # model.logits=chunked: hidden states and head (a Projection)
        packed = logits_of(output)  # (batch, vocabulary, length)
        loss = SummedLoss(elements=True, shift_labels=True)
        alone_loss, alone_terms = 0.0, 0
        for row, block in enumerate(blocks):
            start = 0
            for doc in (DOCS[:3] if row == 0 else DOCS[3:]):
                ids = torch.tensor([doc], device=device)
                logits = logits_of(model(input_ids=ids, attention_mask=torch.ones_like(ids)))
                torch.testing.assert_close(packed[row, :, start : start + len(doc)], logits[0], atol=1e-5, rtol=1e-5)
                alone_loss += float(loss(logits, ids))
                alone_terms += loss.terms([(None, ids)])
                start += len(doc)
        # the loss of the packed batch: each document's alone, nothing predicted across a boundary
        assert loss.terms([(None, labels)]) == alone_terms
        torch.testing.assert_close(float(loss(packed, labels)), alone_loss, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(float(loss(output, labels)), alone_loss, atol=1e-4, rtol=1e-5)  # chunked
        # concat-style blocks (no document ids) let the second document attend to the first: different logits
        plain = logits_of(model(input_ids=batch["input_ids"][:1], attention_mask=batch["attention_mask"][:1]))
        assert not torch.allclose(plain[0, :, 5:8], packed[0, :, 5:8], atol=1e-4)


@pytest.mark.slow
def test_packing_from_the_cli_with_micro_tokens_and_a_model_that_cannot_take_it(tmp_path, compose):
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(" ".join(["word"] * (1 + i % 7)) for i in range(60)) + "\n")
    args = ["model=hf_causal_lm", "+model.config.model_type=gpt2", "+model.config.n_layer=2",
            "+model.config.n_head=2", "+model.config.n_embd=32", "+model.config.n_positions=64", "model.dropout=0",
            "data=text", f"data.train={path}", "data.max_length=64", "data.packing=true", "optim=sgd",
            "trainer.epochs=1", "trainer.progress=false"]
    one, log = train_here(tmp_path, "one", *args, "micro_batch=2", "accum=3")
    two, _ = train_here(tmp_path, "two", *args, "micro_tokens=128", "global_batch=6")
    a, b = read_metrics(one)[0], read_metrics(two)[0]
    assert "packed by documents" in log and [r["samples"] for r in a] == [r["samples"] for r in b]
    assert [r["elements"] for r in a] == [r["elements"] for r in b]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
    _, log = train_here(tmp_path, "concat", *args[:-4], "data.packing=concat", "trainer.max_steps=1")
    assert "attention (and the loss) crosses from one document into the next" in log
    from accutrain.dist import World
    from accutrain.train.build import build
    with pytest.raises(UserError) as info:
        build(run_of("model=char_lm", "data=text", f"data.train={path}", "data.packing=true"), World(),
              torch.device("cpu"))
    assert_one_line_user_error(info.value, "data.packing=true keeps each packed document's positions")
    with pytest.raises(UserError) as info:
        build(run_of(*args, "loss.normalize=sequences"), World(), torch.device("cpu"))
    assert_one_line_user_error(info.value, "loss.normalize=sequences averages each sample's tokens")


def test_chat_records_from_data_hf_pack_by_documents(tmp_path):
    pytest.importorskip("datasets")
    import json

    from accutrain.data.hf_data import hf_data
    chats = [{"messages": [{"role": "user", "content": f"{i} plus 1?"}, {"role": "assistant", "content": f"{i + 1}."}]}
             for i in range(12)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    common = dict(val_fraction=0.25, max_length=96, cache_dir=str(tmp_path / "cache"))
    plain, packed = hf_data(str(path), **common), hf_data(str(path), packing=True, **common)
    alone = [x["input_ids"].tolist() for x in plain.train]
    blocks = list(packed.train)
    assert [t for b in blocks for t in b["input_ids"].tolist()] == [t for ids in alone for t in ids]
    assert all(len(b["input_ids"]) <= 96 and len(b["document_ids"]) == len(b["input_ids"]) for b in blocks)
    assert sum(int(b["document_ids"].max()) for b in blocks) == len(alone)  # each conversation whole, numbered
    assert sum(int((b["labels"] != -100).sum()) for b in blocks) == sum(int((x["labels"] != -100).sum())
                                                                       for x in plain.train)
