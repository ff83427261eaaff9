"""`model=hf_causal_lm` and `model=hf_seq_cls`: Hugging Face transformers models (the `hf` extra), pretrained or
randomly initialised from a config, called with the batch's mapping (input_ids, attention_mask) and returning
their logits in cross_entropy's layout (a causal LM: its hidden states and head, models/heads.py); accutrain computes the summed loss itself (the model's own `loss` is a
mean per micro-batch). transformers is imported here only, when one of these models is asked for.
"""
from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from accutrain.config.model_traits import CAUSAL_LM, LOSS_DEFAULTS
from accutrain.models import adapters, empty_rows, heads, hf_keys, moe, neftune, packed
from accutrain.models import kernels as kernels_module
from accutrain.models.hf_load import load

log = logging.getLogger("accutrain")


class HFAdapter(nn.Module):
    """A Hugging Face model (`.model`) behind accutrain's calling convention. Its state_dict has the model's own
    keys (`transformer.wte.weight`, no `model.` prefix) and loads from them, so a checkpoint's weights load into
    the bare Hugging Face model too."""

    loss_defaults: dict[str, Any] = {}  # what loss.normalize=auto and loss.shift_labels=null become

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT passes **kwargs on
        self.use_cache = "use_cache" in inspect.signature(base.forward).parameters
        self.adapted = hasattr(model, "peft_config")  # model.adapter: the state holds the adapter's entries only
        self.router = moe.router_of(base)  # a mixture of experts' router outputs; None: dense
        self.routing = self.router.routing if self.router is not None else None  # what loss=moe reads
        if self.adapted:
            self.register_state_dict_post_hook(hf_keys.adapter_only)  # before the keys lose their "model." prefix
        self.register_state_dict_post_hook(hf_keys.plain_keys)
        self.register_load_state_dict_pre_hook(hf_keys.inner_keys)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """An adapted model loads exactly its trained entries (another model's, or a full model's, are refused as
        a mismatch); its frozen base stays as the factory built it."""
        if not self.adapted:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        expected = {key[len("model."):] for key in adapters.trained_keys(self)}
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise RuntimeError("Error(s) in loading state_dict for the adapted model: "
                               + (f"missing {', '.join(missing[:3])}; " if missing else "")
                               + (f"unexpected {', '.join(unexpected[:3])}" if unexpected else ""))
        return super().load_state_dict(state_dict, strict=False, assign=assign)

    def forward(self, aux: tuple[str, ...] = (), **inputs: torch.Tensor) -> Any:
        """The logits; with `aux` (e.g. ("router_logits",)), (logits, {name: the model's output of that name}). Zero
        rows give zero rows (models/empty_rows.py)."""
        if empty_rows.no_rows(inputs):
            return empty_rows.cut(self.compute(aux, **empty_rows.one_row(inputs)))
        return self.compute(aux, **inputs)

    def compute(self, aux: tuple[str, ...], **inputs: torch.Tensor) -> Any:
        if self.use_cache:
            inputs["use_cache"] = False  # a training forward needs no key/value cache
        output, extra = moe.forward(self.model, self.router, inputs, aux)
        logits = self.layout(output.logits)
        return (logits, extra) if aux else logits

    def layout(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    @property
    def keyed_module(self) -> nn.Module:
        """The module whose own names are this model's state_dict keys (parallel/state_dicts.py): the HF model."""
        return self.model

    @property
    def max_positions(self) -> Optional[tuple[str, int]]:
        """(the config's key, its value): the positions the model has (n_positions, max_position_embeddings)."""
        for key in ("n_positions", "max_position_embeddings"):
            if isinstance(value := getattr(self.model.config, key, None), int):
                return key, value
        return None

    def save_pretrained(self, directory: Path, merged: bool = False) -> None:
        """save_pretrained of the model; an adapted one writes its adapter as PEFT saves it, or (`merged`) the
        base model with the adapter merged into its weights (which leaves this model merged)."""
        if merged and self.adapted:
            self.model = self.model.merge_and_unload()
            self.adapted = False
        self.model.save_pretrained(directory)


class HFCausalLM(HFAdapter):
    """Logits (batch, vocabulary, length), or (`logits="chunked"`) its last hidden states and head as a
    core.chunked_ce.Projection, which the loss reduces without the full logits (models/heads.py); the labels are the
    inputs, shifted by the loss (loss.shift_labels). Blocks packed by documents (their `document_ids`) get positions
    and attention per document (models/packed.py)."""

    loss_defaults = LOSS_DEFAULTS[CAUSAL_LM]
    packs_documents = True
    logits = "full"  # or chunked: a Projection (heads.choose)
    fused = None  # model.kernels' fused cross-entropy for a Projection

    def compute(self, aux: tuple[str, ...], **inputs: torch.Tensor) -> Any:
        if "document_ids" in inputs:
            base = heads.causal(self.model)
            dtype = next(base.parameters()).dtype
            inputs = packed.document_inputs(inputs, getattr(base.config, "_attn_implementation", None) or "eager",
                                            dtype if dtype.is_floating_point else torch.float32)
        if self.logits == "full" or "aux_loss" in aux:  # the model's own balancing loss: its full forward's
            return super().compute(aux, **inputs)
        if self.use_cache:
            inputs["use_cache"] = False
        output, extra = moe.forward(lambda **kw: heads.project(self.model, kw, self.fused), self.router, inputs, aux)
        return (output, extra) if aux else output

    def layout(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.transpose(1, 2)


class HFSeqCls(HFAdapter):
    """Logits (batch, classes)."""


def causal_lm(num_classes: int, adapter: Optional[str] = None, lora: Optional[dict] = None,
              quantize: Optional[str] = None, neftune_alpha: Optional[float] = None, logits: str = "chunked",
              kernels: Optional[str] = None, **kwargs: Any) -> HFCausalLM:
    """model=hf_causal_lm: AutoModelForCausalLM; a random initialisation takes the data's vocabulary; `adapter`
    (lora, with `lora`'s settings) trains adapters on the frozen (`quantize`d) model; `neftune_alpha`: NEFTune;
    `logits`: chunked (hidden states and head for the loss) or full; `kernels`: liger (models/kernels.py)."""
    adapters.check(adapter, quantize)
    neftune.check(neftune_alpha)
    heads.check(logits)
    kernels_module.check(kernels)
    model = load("AutoModelForCausalLM", num_labels=None, vocab_size=kwargs.pop("vocab_size", num_classes),
                 quantize=quantize, **kwargs)
    kernels_module.apply(model, kernels)
    wrapped = HFCausalLM(adapt(model, "AutoModelForCausalLM", adapter, lora, quantize))
    neftune.attach(wrapped, wrapped.model, neftune_alpha)
    wrapped.logits = heads.choose(wrapped.model, logits, kernels)
    if kernels and wrapped.logits == "chunked":
        wrapped.fused = kernels_module.fused_cross_entropy
    return wrapped


causal_lm.loss_defaults = HFCausalLM.loss_defaults  # type: ignore[attr-defined]  # read before the model is built


def seq_cls(num_classes: int, class_names: Optional[list[str]] = None, adapter: Optional[str] = None,
            lora: Optional[dict] = None, quantize: Optional[str] = None, neftune_alpha: Optional[float] = None,
            **kwargs: Any) -> HFSeqCls:
    """model=hf_seq_cls: AutoModelForSequenceClassification with a head of the data's `num_classes` (named by
    `class_names` in the exported config's id2label); `adapter` and `neftune_alpha` as for causal_lm (the head is
    trained whole)."""
    adapters.check(adapter, quantize)
    neftune.check(neftune_alpha)
    model = load("AutoModelForSequenceClassification", num_labels=num_classes, quantize=quantize, **kwargs)
    if class_names:
        model.config.id2label = dict(enumerate(class_names))
        model.config.label2id = {name: i for i, name in enumerate(class_names)}
    wrapped = HFSeqCls(adapt(model, "AutoModelForSequenceClassification", adapter, lora, quantize))
    neftune.attach(wrapped, wrapped.model, neftune_alpha)
    return wrapped


def adapt(model: nn.Module, auto_class: str, adapter: Optional[str], lora: Optional[dict],
          quantize: Optional[str]) -> nn.Module:
    """The model with `adapter` applied (adapters.apply), or as it is."""
    if adapter is None:
        return model
    adapted = adapters.apply(model, auto_class, lora, quantized=quantize is not None)
    trained = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    log.info(f"model.adapter={adapter}: {trained:,} of {sum(p.numel() for p in adapted.parameters()):,} parameters "
             "trained, the rest frozen; checkpoints hold the trained ones")
    return adapted


def export(model: nn.Module, tokenizer: Any, directory: Path, merged: bool = False) -> Path:
    """save_pretrained of the model (and the data's tokenizer) into `directory`: from_pretrained loads it back (an
    adapter: PEFT's from_pretrained onto the base model; `merged`: the model with its adapter merged in)."""
    model.save_pretrained(directory, merged=merged)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
    return directory
