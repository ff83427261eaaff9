"""Embedding training on text triples (query, passage, mined negative) with a Hugging Face encoder (a tiny random
BERT built from a config: no download): micro_batch=4 accum=4, and two gloo ranks, end with the weights of
micro_batch=16 (AdamW, clipping, float32, no dropout) while loss.window=false does not; micro_tokens cuts the same
windows by tokens; the export loads in sentence-transformers and gives accutrain's embeddings."""
import json
import subprocess
import sys

import pytest
import torch
from conftest import final_weights, read_metrics, train_here

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

TOPICS = ["cat", "dog", "car", "tree", "boat", "moon", "rain", "bread", "chess", "piano", "river", "glass"]
BERT = ["model=hf_encoder", "+model.config.model_type=bert", "+model.config.num_hidden_layers=2",
        "+model.config.hidden_size=32", "+model.config.num_attention_heads=2", "+model.config.intermediate_size=64",
        "+model.config.max_position_embeddings=128", "model.dropout=0"]


def triples(n: int) -> str:
    """n records of (query, passage, hard negative) of varied lengths: a passage shares its query's topic, the
    negative another's."""
    lines = []
    for i in range(n):
        topic, other = TOPICS[i % len(TOPICS)], TOPICS[(i * 5 + 3) % len(TOPICS)]
        extra = " and more" * (i % 4)
        lines.append(json.dumps({"query": f"what is a {topic}, {i}?", "passage": f"a {topic} is a thing{extra}, {i}",
                                 "hard": f"a {other} is a thing, {i}"}))
    return "\n".join(lines) + "\n"


@pytest.fixture
def data(tmp_path):
    (tmp_path / "triples.jsonl").write_text(triples(45))
    return ["data=text", f"data.train={tmp_path / 'triples.jsonl'}", "data.anchor_field=query",
            "data.positive_field=passage", "data.negative_field=hard", "data.max_length=64", "loss=contrastive",
            "loss.temperature=0.1", "optim=adamw", "optim.lr=0.003", "trainer.grad_clip=0.5", "trainer.epochs=2",
            "seed=1"]


def distance(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_triples_accumulated_on_one_and_two_ranks_end_with_the_big_batchs_weights(tmp_path, data):
    # 41 training triples (4 of 45 held out): windows of 16, 16 and 9 (micro-batches of 4), two epochs
    big, _ = train_here(tmp_path, "big", *BERT, *data, "micro_batch=16")
    acc, log = train_here(tmp_path, "acc", *BERT, *data, "micro_batch=4", "accum=4")
    two, _ = train_here(tmp_path, "two", *BERT, *data, "devices=2", "micro_batch=4", "accum=2")
    naive, _ = train_here(tmp_path, "naive", *BERT, *data, "micro_batch=4", "accum=4", "loss.window=false")
    start, _ = train_here(tmp_path, "start", *BERT, *data, "micro_batch=16", "trainer.max_steps=1")
    weights = final_weights(big)
    assert "1 negative per anchor" in log and [r["samples"] for r in read_metrics(acc)[0]] == [16, 16, 9] * 2
    assert distance(final_weights(acc), weights) < 1e-5
    assert distance(final_weights(two), weights) < 1e-5
    assert distance(final_weights(naive), weights) > 1e-4  # the naive accumulation: another objective
    assert distance(final_weights(start), weights) > 1e-3  # the weights moved: the equality is not vacuous
    evals = read_metrics(acc)[1][-1]
    assert {"val_recall1", "val_recall10", "val_mrr10", "val_ndcg10"} <= set(evals)
    assert evals["val_ndcg10"] == pytest.approx(read_metrics(big)[1][-1]["val_ndcg10"], rel=1e-5)


def test_a_token_budget_cuts_the_same_windows_longest_first(tmp_path, data):
    """The same windows, cut by padded tokens (each sample: its anchor, positive and negative) instead of samples:
    the same steps to float rounding (SGD: AdamW's normalised first steps would magnify the rounding of a window
    whose rows come in another order)."""
    sgd = [*data, "optim=sgd", "optim.lr=0.05"]
    by_samples, _ = train_here(tmp_path, "samples", *BERT, *sgd, "micro_batch=4", "global_batch=16")
    by_tokens, log = train_here(tmp_path, "tokens", *BERT, *sgd, "micro_tokens=600", "global_batch=16")
    assert distance(final_weights(by_tokens), final_weights(by_samples)) < 1e-6
    steps = read_metrics(by_tokens)[0]
    assert [r["samples"] for r in steps] == [16, 16, 9] * 2 and all(0 <= r["pad_fraction"] < 1 for r in steps)


def test_the_export_loads_in_sentence_transformers_with_accutrains_embeddings(tmp_path, data):
    st = pytest.importorskip("sentence_transformers")
    run_dir, _ = train_here(tmp_path, "run", *BERT, *data, "micro_batch=12", "trainer.epochs=1",
                            "trainer.export=hf", "model.pooling=cls")
    loading = subprocess.run([sys.executable, "-c", "import sys; from sentence_transformers import "
                              "SentenceTransformer; from transformers import AutoModel; SentenceTransformer(sys.argv[1], "
                              "device='cpu'); AutoModel.from_pretrained(sys.argv[1])", str(run_dir / "hf")],
                             capture_output=True, text=True, check=True)  # as a user's own process loads it
    assert "MISSING" not in loading.stderr and "pooler" not in loading.stderr, loading.stderr  # every weight is there
    exported = st.SentenceTransformer(str(run_dir / "hf"), device="cpu")
    texts = ["what is a cat, 3?", "a dog is a thing and more, 7", "a moon is a thing, 11"]
    theirs = exported.encode(texts, convert_to_tensor=True)

    from accutrain.data.tokenizer import ByteTokenizer
    from accutrain.models.hf_encoder import encoder

    model = encoder(config={"model_type": "bert", "num_hidden_layers": 2, "hidden_size": 32,
                            "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128},
                    pooling="cls", dropout=0.0, vocab_size=259, pad_token_id=256).eval()
    model.load_state_dict(final_weights(run_dir))
    ours = torch.stack([model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0]
                        for ids in ByteTokenizer()(texts)["input_ids"]])
    assert torch.nn.functional.cosine_similarity(theirs, ours.detach()).min() >= 0.9999
    from transformers import AutoModel

    assert AutoModel.from_pretrained(str(run_dir / "hf")).config.hidden_size == 32  # and transformers loads it
