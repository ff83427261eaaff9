"""model=hf_encoder: the pooled embedding of a text does not depend on how its micro-batch is padded (right or left,
to any length), for mean, first-token and last-token pooling; a pooling that needs the attention mask without one
is one line."""
import pytest
import torch

from accutrain.errors import UserError

pytest.importorskip("transformers")

from accutrain.models.hf_encoder import encoder  # noqa: E402

CONFIG = {"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2,
          "intermediate_size": 32, "max_position_embeddings": 64}
GPT2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 64}


def padded(texts: list[list[int]], side: str, length: int, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(texts), length), pad)
    mask = torch.zeros((len(texts), length), dtype=torch.int64)
    for row, text in enumerate(texts):
        where = slice(0, len(text)) if side == "right" else slice(length - len(text), length)
        ids[row, where], mask[row, where] = torch.tensor(text), 1
    return ids, mask


@pytest.mark.parametrize("pooling, config", [("mean", CONFIG), ("last", GPT2), ("last", CONFIG)])
def test_the_embedding_of_a_text_is_the_same_however_its_batch_is_padded(pooling, config):
    torch.manual_seed(0)
    model = encoder(config=dict(config), pooling=pooling, dropout=0.0, vocab_size=50, pad_token_id=0).eval()
    texts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    alone = torch.stack([model(input_ids=torch.tensor([t]), attention_mask=torch.ones(1, len(t), dtype=torch.long))[0]
                         for t in texts])
    for side in ("right", "left"):  # (positions counted from each text's first real token)
        ids, mask = padded(texts, side, 9)
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask), alone, rtol=1e-5, atol=1e-6)
    assert torch.allclose(alone.norm(dim=-1), torch.ones(2))  # normalize=true


def test_the_first_token_pooling_and_a_missing_attention_mask():
    model = encoder(config=dict(CONFIG), pooling="cls", normalize=False, vocab_size=50).eval()
    ids = torch.tensor([[1, 2, 3]])
    assert model(input_ids=ids).shape == (1, 16)  # the first token needs no mask
    mean = encoder(config=dict(CONFIG), pooling="mean", vocab_size=50).eval()
    with pytest.raises(UserError, match="model.pooling=mean needs each input's attention_mask"):
        mean(input_ids=ids)
    with pytest.raises(UserError, match="model.pooling=max is not valid: expected one of mean, cls, last"):
        encoder(config=dict(CONFIG), pooling="max")


def test_first_token_pooling_on_a_model_that_attends_causally_is_refused_with_the_remedy():
    with pytest.raises(UserError) as info:
        encoder(config=dict(GPT2), pooling="cls", vocab_size=50)
    assert "model.pooling=cls on gpt2: it attends causally" in str(info.value)
    assert "use model.pooling=last" in str(info.value) and "\n" not in str(info.value)
    encoder(config=dict(GPT2), pooling="last", vocab_size=50)  # the remedy
    encoder(config=dict(CONFIG), pooling="cls", vocab_size=50)  # an encoder's first token sees the whole text


def test_two_different_texts_embedded_identically_are_one_line_at_the_start_up_check():
    from accutrain.core.batches import Batch
    from accutrain.core.losses.contrastive import contrastive

    torch.manual_seed(0)
    anchors, positives = [[3, 4, 5], [3, 9, 8]], [[7, 1, 2], [6, 1, 2]]  # the anchors share their first token
    inputs = {}
    for role, texts in (("anchor", anchors), ("positive", positives)):
        inputs[f"{role}.input_ids"], inputs[f"{role}.attention_mask"] = padded(texts, "right", 4)
    batch = Batch(inputs, torch.tensor([[1], [2]]))
    loss = contrastive()
    loss.check(encoder(config=dict(GPT2), pooling="last", vocab_size=50), batch, "x")  # every text its own
    blind = encoder(config=dict(GPT2), pooling="last", vocab_size=50)
    blind.pooling = "cls"  # as a model built elsewhere would pool: the first token of a causal model
    with pytest.raises(UserError) as info:
        loss.check(blind, batch, "x")
    assert "embeds two different texts of the first window identically (the anchor of sample 0 and the anchor of " \
           "sample 1)" in str(info.value) and "\n" not in str(info.value)
