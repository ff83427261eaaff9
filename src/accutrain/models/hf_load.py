"""A Hugging Face model or tokenizer loaded: transformers imported when asked for (one line saying how to install
it), a model pretrained (a name or a folder) or initialised at random from a config, and what the hub cannot give in
one line (offline, a name that does not exist, a gated repository)."""
from __future__ import annotations

import difflib
import logging
import os
from typing import Any, Optional

import torch
from torch import nn

from accutrain.errors import UserError
from accutrain.models import adapters
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
