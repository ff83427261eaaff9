"""`model=hf_encoder`: a Hugging Face model as a text embedder for loss=contrastive — an encoder (BERT, RoBERTa,
ModernBERT, …) or a decoder (last-token pooling) loaded with AutoModel, pretrained or randomly initialised from a
config, its token states pooled (`pooling`: mean over the real tokens, the first token, or the last real token —
found from the attention mask, so either padding side works) and L2-normalised (`normalize`). The first token of a
model that attends causally (a decoder) sees nothing after it: `cls` pooling is refused for one. Adapters
(`adapter=lora`) as for the other Hugging Face models. Exported (trainer.export=hf) as a folder that
sentence-transformers' `SentenceTransformer(path)` loads with the same pooling and normalisation, and
transformers' `AutoModel` too.
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from accutrain.errors import UserError
from accutrain.models import adapters
from accutrain.models.hf import HFAdapter, adapt
from accutrain.models.hf_load import load

POOLING = ("mean", "cls", "last")


class HFEncoder(HFAdapter):
    """Pooled, optionally normalised embeddings (batch, hidden) of a Hugging Face AutoModel."""

    def __init__(self, model: nn.Module, pooling: str, normalize: bool, max_length: Optional[int] = None) -> None:
        super().__init__(model)
        self.pooling, self.normalize, self.max_length = pooling, normalize, max_length
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.positions = "position_ids" in inspect.signature(base.forward).parameters
        self.set_aside: dict[str, nn.Module] = {}  # the base's unused pooler (encoder()): exported, never trained

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                **inputs: torch.Tensor) -> torch.Tensor:
        if attention_mask is None:
            if self.pooling != "cls":
                raise UserError(f"model.pooling={self.pooling} needs each input's attention_mask, to tell its real "
                                "tokens from the padding; this data gives input_ids alone: use data=text or data=hf, "
                                "or model.pooling=cls")
            attention_mask = torch.ones_like(input_ids)
        if self.use_cache:
            inputs["use_cache"] = False
        if self.positions and "position_ids" not in inputs:  # each text's own positions from 0, either padding side
            inputs["position_ids"] = (attention_mask.cumsum(1) - 1).clamp(min=0)
        states = self.model(input_ids=input_ids, attention_mask=attention_mask, **inputs).last_hidden_state
        pooled = pool(states, attention_mask, self.pooling)
        return F.normalize(pooled, dim=-1) if self.normalize else pooled

    def save_pretrained(self, directory: Path, merged: bool = False) -> None:
        """save_pretrained of the model (an adapter: PEFT's files, or `merged` into the weights), and the module
        files sentence-transformers reads: modules.json, 1_Pooling/config.json, 2_Normalize/ (when normalised),
        sentence_bert_config.json, config_sentence_transformers.json. The pooler set aside goes back into the
        model's files, so that its loaders (AutoModel, sentence-transformers) find every weight they expect."""
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        device = next(base.parameters()).device
        for name, module in self.set_aside.items():
            setattr(base, name, module.to(device))
        try:
            super().save_pretrained(directory, merged=merged)
        finally:
            for name in self.set_aside:
                setattr(base, name, None)
        directory = Path(directory)
        modules = [dict(idx=0, name="0", path="", type="sentence_transformers.models.Transformer"),
                   dict(idx=1, name="1", path="1_Pooling", type="sentence_transformers.models.Pooling")]
        if self.normalize:
            modules.append(dict(idx=2, name="2", path="2_Normalize", type="sentence_transformers.models.Normalize"))
            (directory / "2_Normalize").mkdir(parents=True, exist_ok=True)
        (directory / "1_Pooling").mkdir(parents=True, exist_ok=True)
        write_json(directory / "modules.json", modules)
        write_json(directory / "1_Pooling" / "config.json", {
            "word_embedding_dimension": self.hidden_size(), "pooling_mode_cls_token": self.pooling == "cls",
            "pooling_mode_mean_tokens": self.pooling == "mean", "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": self.pooling == "last", "include_prompt": True})
        write_json(directory / "sentence_bert_config.json", {"max_seq_length": self.max_length or 512,
                                                             "do_lower_case": False})
        write_json(directory / "config_sentence_transformers.json", {"prompts": {}, "default_prompt_name": None,
                                                                     "similarity_fn_name": "cosine"})

    def hidden_size(self) -> int:
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return int(base.config.hidden_size)


def pool(states: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """(batch, hidden) from token states (batch, length, hidden): the mean over the real tokens, the first token, or
    the last real token (the last 1 of the attention mask: right or left padding alike)."""
    if pooling == "cls":
        return states[:, 0]
    if pooling == "last":
        length = mask.shape[1]
        last = length - 1 - mask.flip(1).to(torch.int64).argmax(1)
        return states[torch.arange(len(states), device=states.device), last]
    weights = mask.to(states.dtype).unsqueeze(-1)
    return (states * weights).sum(1) / weights.sum(1).clamp(min=1)


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def encoder(name_or_path: Optional[str] = None, pretrained: bool = True, config: Optional[dict] = None,
            pooling: str = "mean", normalize: bool = True, dropout: Optional[float] = None, dtype: str = "float32",
            attn_implementation: Optional[str] = None, trust_remote_code: bool = False, revision: Optional[str] = None,
            adapter: Optional[str] = None, lora: Optional[dict] = None, quantize: Optional[str] = None,
            vocab_size: Optional[int] = None, pad_token_id: Optional[int] = None, max_length: Optional[int] = None
            ) -> HFEncoder:
    """model=hf_encoder: AutoModel pooled into embeddings; a random initialisation takes the data's vocabulary and
    padding token; `adapter` (lora) trains adapters on the frozen (`quantize`d) model; `max_length` (the data's)
    is what the exported sentence-transformers model truncates to."""
    if pooling not in POOLING:
        raise UserError(f"model.pooling={pooling} is not valid: expected one of {', '.join(POOLING)}")
    adapters.check(adapter, quantize)
    model = load("AutoModel", name_or_path, pretrained, config, dropout, dtype, attn_implementation,
                 trust_remote_code, revision, vocab_size=vocab_size, pad_token_id=pad_token_id, quantize=quantize)
    if pooling == "cls" and attends_causally(model):
        raise UserError(f"model.pooling=cls on {name_or_path or (config or {}).get('model_type', 'this model')}: "
                        "it attends causally (a decoder), so its first token's state never sees the rest of the text "
                        "and every text that begins alike embeds identically: use model.pooling=last (or mean)")
    pooler = getattr(model, "pooler", None)
    if pooler is not None:  # BERT's own pooler: unused here (the embedding is `pooling`'s), and a layer without
        model.pooler = None  # gradient would stall DDP's reduction on several devices; set aside for the export
    wrapped = HFEncoder(adapt(model, "AutoModel", adapter, lora, quantize), pooling, normalize, max_length)
    wrapped.set_aside = {"pooler": pooler} if pooler is not None else {}
    return wrapped


def attends_causally(model: nn.Module) -> bool:
    """Whether the model's first token's state is blind to the tokens after it (a decoder's causal attention): two
    texts that share only their first token give it the same state."""
    first = next(model.parameters(), None)
    if first is None or first.device.type == "meta":
        return False
    vocab = int(getattr(model.config, "vocab_size", 8) or 8)
    ids = torch.tensor([[1, 2, 3, 4], [1, 5, 6, 7]], device=first.device) % vocab
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            states = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state.float()
    except Exception:  # a model that takes more than token ids (an encoder-decoder): the start-up check still asks
        return False
    finally:
        model.train(training)
    return torch.allclose(states[0, 0], states[1, 0], rtol=1e-5, atol=1e-6)
