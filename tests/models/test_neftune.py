"""NEFTune (model.neftune_alpha): noise on the input embeddings in training, drawn per sample from (seed, epoch,
sample) over the sample's own tokens, so that any split of the window adds the same noise — and it does add some."""
import json

import pytest
import torch
from conftest import assert_one_line_user_error, final_weights, train_here

from accutrain.errors import UserError

pytest.importorskip("transformers")
pytest.importorskip("datasets")

CHATS = [{"messages": [{"role": "user", "content": f"{i} plus {i % 5}?" + " please" * (i % 4)},
                       {"role": "assistant", "content": f"{i + i % 5}."}]} for i in range(40)]
GPT2 = ["model=hf_causal_lm", "+model.config.model_type=gpt2", "+model.config.n_layer=1", "+model.config.n_head=2",
        "+model.config.n_embd=32", "+model.config.n_positions=128", "model.dropout=0"]


def test_a_samples_noise_is_its_own_whatever_its_batch():
    from accutrain.models.hf import causal_lm

    model = causal_lm(50, config=dict(model_type="gpt2", n_layer=1, n_head=2, n_embd=16, n_positions=32), dropout=0,
                      neftune_alpha=5.0, logits="full")  # the logits themselves compared
    assert model.sample_seeds
    ids = torch.randint(50, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # a shorter sample, padded
    seeds = torch.tensor([11, 22, 33])
    model.train()
    batch = model(input_ids=ids, attention_mask=mask, sample_seed=seeds)
    for row in range(3):
        n = int(mask[row].sum())
        alone = model(input_ids=ids[row : row + 1, :n], attention_mask=mask[row : row + 1, :n],
                      sample_seed=seeds[row : row + 1])
        torch.testing.assert_close(alone[0], batch[row, :, :n], rtol=1e-5, atol=1e-5)  # its own noise, anywhere
    clean = model(input_ids=ids, attention_mask=mask)  # no seeds (held-out batches): no noise
    assert not torch.allclose(clean, batch, atol=1e-3)
    again = model(input_ids=ids, attention_mask=mask, sample_seed=seeds)
    assert torch.equal(again, batch)  # the same seeds, the same noise
    model.eval()
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask, sample_seed=seeds), clean)
    with pytest.raises(UserError) as info:
        causal_lm(50, config=dict(model_type="gpt2", n_layer=1, n_embd=16), neftune_alpha=-1)
    assert_one_line_user_error(info.value, "model.neftune_alpha=-1 is not valid")


@pytest.mark.slow
def test_neftune_takes_the_same_steps_under_any_split_and_differs_from_no_noise(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CHATS))  # 36 trained: windows of 16, 16 and 4
    args = [*GPT2, "data=hf", f"data.train={path}", f"data.cache_dir={tmp_path / 'cache'}", "data.max_length=64",
            "optim=sgd", "optim.lr=0.5", "optim.momentum=0", "trainer.epochs=1", "trainer.progress=false"]
    big, _ = train_here(tmp_path, "big", *args, "model.neftune_alpha=5", "micro_batch=16")
    split, _ = train_here(tmp_path, "split", *args, "model.neftune_alpha=5", "micro_batch=4", "accum=4")
    plain, _ = train_here(tmp_path, "plain", *args, "micro_batch=16")
    noisy, exact, clean = final_weights(big), final_weights(split), final_weights(plain)
    for key, value in noisy.items():
        torch.testing.assert_close(exact[key], value, rtol=1e-5, atol=1e-5, msg=key)
    assert max((noisy[k] - clean[k]).abs().max().item() for k in noisy) > 1e-3
