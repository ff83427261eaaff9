"""`model.adapter=lora` (the `peft` extra) and `model.quantize=4bit` (QLoRA: CUDA and bitsandbytes) for the Hugging
Face models: the base model frozen, LoRA matrices trained. peft is imported here only, when an adapter is asked for.

An adapted model's state_dict holds only what training changes — the adapter's parameters (and any module PEFT
trains whole, such as a classifier head) — so checkpoints hold those and the optimizer state for them; the frozen
base weights come back from the model factory and the seed, as they were built the first time.
"""
from __future__ import annotations

import difflib
import importlib.util
import warnings
from typing import Any, Optional

import torch
from torch import nn

from accutrain.errors import UserError

ADAPTERS = ("lora",)
QUANTIZE = ("4bit",)
TASKS = {"AutoModelForCausalLM": "CAUSAL_LM", "AutoModelForSequenceClassification": "SEQ_CLS",
         "AutoModel": "FEATURE_EXTRACTION"}


def require_peft(what: str) -> Any:
    """The peft package, or one line saying how to install it."""
    try:
        import peft
    except ImportError:
        raise UserError(f"{what} needs the peft package: pip install 'accutrain[peft]'") from None
    return peft


def check(adapter: Optional[str], quantize: Optional[str]) -> None:
    """Refuse an unknown adapter or quantization, and 4-bit without CUDA and bitsandbytes, in one line."""
    if adapter is not None and adapter not in ADAPTERS:
        raise UserError(f"model.adapter={adapter} is not valid: expected one of {', '.join(ADAPTERS)} or null")
    if quantize is None:
        return
    if quantize not in QUANTIZE:
        raise UserError(f"model.quantize={quantize} is not valid: expected one of {', '.join(QUANTIZE)} or null")
    if adapter is None:
        raise UserError(f"model.quantize={quantize} trains nothing without an adapter: add model.adapter=lora (QLoRA)")
    if not torch.cuda.is_available():
        raise UserError(f"model.quantize={quantize} (QLoRA) needs a CUDA GPU and bitsandbytes; this machine has no "
                        "CUDA device: drop model.quantize to train LoRA on the unquantized weights")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError(f"model.quantize={quantize} needs the bitsandbytes package: pip install bitsandbytes")


def quantization_config(quantize: Optional[str], transformers: Any) -> dict[str, Any]:
    """from_pretrained's keyword for `quantize` (NF4 weights, bf16 compute), or none."""
    if quantize is None:
        return {}
    return dict(quantization_config=transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True))


def apply(model: nn.Module, auto_class: str, lora: Optional[dict], quantized: bool) -> nn.Module:
    """`model` with LoRA adapters (peft.get_peft_model) of `lora`'s r, alpha, dropout and target_modules (null:
    PEFT's defaults for the architecture); its base weights frozen. Unknown target modules are one line."""
    peft = require_peft("model.adapter=lora")
    options = {k: v for k, v in dict(lora or {}).items() if v is not None}
    keys = {"r": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "target_modules": "target_modules"}
    for key in options:
        if key not in keys:
            raise UserError(f"model.lora.{key} is not a LoRA setting: expected one of {', '.join(keys)}")
    if "target_modules" in options and isinstance(options["target_modules"], str):
        options["target_modules"] = [options["target_modules"]]
    elif "target_modules" in options:
        options["target_modules"] = list(options["target_modules"])
    config = peft.LoraConfig(task_type=TASKS[auto_class], **{keys[k]: v for k, v in options.items()})
    if quantized:
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    try:
        with warnings.catch_warnings():  # GPT-2's Conv1D: PEFT sets fan_in_fan_out itself, and says so
            warnings.filterwarnings("ignore", message="fan_in_fan_out")
            warnings.filterwarnings("ignore", category=FutureWarning)
            return peft.get_peft_model(model, config)
    except ValueError as e:
        if "target_modules" not in options:  # PEFT knows no default for this architecture
            raise UserError(f"model.adapter=lora: {first_line(e)}; name the layers: model.lora.target_modules="
                            f"[{','.join(linear_names(model)[:4])}]") from None
        raise UserError(unknown_targets(options["target_modules"], model, e)) from None


def unknown_targets(targets: list[str], model: nn.Module, error: Exception) -> str:
    """The line for target modules that match no layer: the names that do exist, a close one suggested."""
    names = linear_names(model)
    missing = [t for t in targets if t not in names]
    close = difflib.get_close_matches(missing[0], names, n=1) if missing else []
    return (f"model.lora.target_modules={'[' + ','.join(targets) + ']'}: "
            + (f"no layer named {', '.join(missing)}" if missing else first_line(error))
            + f" in this model (its linear layers: {', '.join(names)})"
            + (f"; did you mean {close[0]}?" if close else ""))


def linear_names(model: nn.Module) -> list[str]:
    """The last name part of every layer LoRA can adapt (Linear, Embedding, Conv, GPT-2's Conv1D), once each."""
    kinds = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)
    names: dict[str, None] = {}
    for name, module in model.named_modules():
        if name and (isinstance(module, kinds) or type(module).__name__ == "Conv1D"):
            names[name.rsplit(".", 1)[-1]] = None
    return list(names)


def first_line(error: BaseException) -> str:
    """An exception's first line (its type when it has no message)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def trained_keys(module: nn.Module) -> set[str]:
    """The state-dict keys (below `module`) of what training changes: trainable parameters and persistent buffers
    of the modules that hold one (none in the adapted models this module builds)."""
    keys = {name for name, p in module.named_parameters() if p.requires_grad}
    for prefix, sub in module.named_modules():
        if any(p.requires_grad for p in sub.parameters(recurse=False)):
            keys |= {f"{prefix}.{b}" if prefix else b for b, _ in sub.named_buffers(recurse=False)
                     if b not in sub._non_persistent_buffers_set}
    return keys
