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
