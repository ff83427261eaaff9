"""`model=hf_causal_lm` and `model=hf_seq_cls`: Hugging Face transformers models (the `hf` extra), pretrained or
randomly initialised from a config, called with the batch's mapping (input_ids, attention_mask) and returning
their logits in cross_entropy's layout (a causal LM: its hidden states and head, models/heads.py); accutrain computes the summed loss itself (the model's own `loss` is a
mean per micro-batch). transformers is imported here only, when one of these models is asked for.
"""
from __future__ import annotations

import difflib
import inspect
import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from accutrain.config.model_traits import CAUSAL_LM, LOSS_DEFAULTS
from accutrain.errors import UserError
from accutrain.models import adapters, empty_rows, heads, hf_keys, moe, neftune, packed
from accutrain.models import kernels as kernels_module
from accutrain.models.adapters import first_line
from accutrain.models.hf_dropout import set_dropout_config, set_dropout_modules

log = logging.getLogger("accutrain")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def require_transformers(what: str) -> Any:
    """The transformers package, or one line saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise UserError(f"{what} needs the transformers package: pip install 'accutrain[hf]'") from None
    transformers.utils.logging.disable_progress_bar()  # no loading/saving bars in accutrain's log
    return transformers


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


def load(auto_class: str, name_or_path: Optional[str] = None, pretrained: bool = True,
         config: Optional[dict] = None, dropout: Optional[float] = None, dtype: str = "float32",
         attn_implementation: Optional[str] = None, trust_remote_code: bool = False, revision: Optional[str] = None,
         num_labels: Optional[int] = None, vocab_size: Optional[int] = None, pad_token_id: Optional[int] = None,
         eos_token_id: Optional[int] = None, quantize: Optional[str] = None) -> nn.Module:
    """The Hugging Face model as configured: `name_or_path`'s weights (pretrained) or its architecture, or
    `config` (with its model_type) randomly initialised; `config` overrides, dropout set, the data's pad token."""
    what = {"AutoModelForCausalLM": "model=hf_causal_lm", "AutoModel": "model=hf_encoder"}.get(auto_class,
                                                                                             "model=hf_seq_cls")
    transformers = require_transformers(what)
    if dtype not in DTYPES:
        raise UserError(f"model.dtype={dtype} is not valid: expected one of {', '.join(DTYPES)}")
    if dropout is not None and not 0 <= dropout < 1:
        raise UserError(f"model.dropout={dropout} is not valid: expected a probability in [0, 1) or null")
    overrides = dict(config or {})
    hub = dict(trust_remote_code=trust_remote_code, revision=revision)
    if name_or_path:
        hf_config = from_hub(transformers.AutoConfig, name_or_path, **hub)
    elif "model_type" not in overrides:
        raise UserError(f"{what} needs model.name_or_path=<a Hub name or a local directory>, or a config to "
                        "initialise at random: +model.config.model_type=gpt2 (and its sizes, e.g. "
                        "+model.config.n_layer=2)")
    else:
        try:
            hf_config = transformers.AutoConfig.for_model(overrides.pop("model_type"))
        except ValueError as e:
            raise UserError(f"model.config.model_type: {first_line(e)}") from None
    random_init = not (name_or_path and pretrained)
    if random_init and vocab_size and "vocab_size" not in overrides:
        overrides["vocab_size"] = vocab_size  # the data's tokenizer
    for key, value in overrides.items():
        if not hasattr(hf_config, key):  # a config takes any attribute: a misspelt key would do nothing
            close = difflib.get_close_matches(key, list(hf_config.to_dict()), n=1)
            raise UserError(f"model.config.{key}: {type(hf_config).__name__} has no such key"
                            + (f" (did you mean {close[0]}?)" if close else ""))
        setattr(hf_config, key, value)
    if num_labels is not None:
        hf_config.num_labels = num_labels
    for key, value in (("pad_token_id", pad_token_id), ("eos_token_id", eos_token_id), ("bos_token_id", eos_token_id)):
        if value is not None and (key == "pad_token_id" or random_init) and key not in overrides:
            setattr(hf_config, key, value)  # GPT-2's classifier pools at the last token that is not padding
    if dropout is not None:
        set_dropout_config(hf_config, dropout)
    auto = getattr(transformers, auto_class)
    options = dict(dtype=DTYPES[dtype], attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
    if quantize and random_init:
        raise UserError(f"model.quantize={quantize} quantizes pretrained weights as they load: give model.name_or_path "
                        "(pretrained), or drop model.quantize for a randomly initialised model")
    try:
        if random_init:
            model = auto.from_config(hf_config, **{**options, "dtype": DTYPES[dtype.replace("auto", "float32")]})
        else:
            extra = dict(ignore_mismatched_sizes=True) if num_labels is not None else {}  # a new head
            model = from_hub(auto, name_or_path, config=hf_config, revision=revision, **options, **extra,
                             **adapters.quantization_config(quantize, transformers))
    except (ValueError, ImportError) as e:  # a config this auto class has no model for, an attention backend…
        raise UserError(f"{what}: {first_line(e)}") from None
    if dropout is not None:
        set_dropout_modules(model, dropout)
    embeddings = model.get_input_embeddings()
    if vocab_size and embeddings is not None and embeddings.num_embeddings < vocab_size:
        log.info(f"the tokenizer has {vocab_size} tokens, the model's embedding {embeddings.num_embeddings}: "
                 "resized (new rows are initialised at random)")
        model.resize_token_embeddings(vocab_size)
    return model


def from_hub(loader: Any, name_or_path: str, key: str = "model.name_or_path", **kwargs: Any) -> Any:
    """`loader.from_pretrained(name_or_path)`, its failures in one line naming `key` (no download without network)."""
    if name_or_path.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(name_or_path)):
        raise UserError(f"{key}={name_or_path}: no such directory")
    try:
        return loader.from_pretrained(os.path.expanduser(name_or_path), **kwargs)
    except (OSError, ValueError) as e:  # not cached and no network, no such repository, no files there
        raise UserError(f"{key}={name_or_path} could not be loaded ({first_line(e)}): give a local directory (a "
                        "save_pretrained output), or download it once with network access (HF_HUB_OFFLINE=1 skips "
                        "the network)") from None


def export(model: nn.Module, tokenizer: Any, directory: Path, merged: bool = False) -> Path:
    """save_pretrained of the model (and the data's tokenizer) into `directory`: from_pretrained loads it back (an
    adapter: PEFT's from_pretrained onto the base model; `merged`: the model with its adapter merged in)."""
    model.save_pretrained(directory, merged=merged)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
    return directory
