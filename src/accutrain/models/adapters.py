"""`model.adapter=lora` (the `peft` extra) and `model.quantize=4bit` (QLoRA: CUDA and bitsandbytes) for the Hugging
Face models: the base model frozen, LoRA matrices trained. peft is imported here only, when an adapter is asked for.

An adapted model's state_dict holds only what training changes — the adapter's parameters (and any module PEFT
trains whole, such as a classifier head) — so checkpoints hold those and the optimizer state for them; the frozen
base weights come back from the model factory and the seed, as they were built the first time.
"""
from __future__ import annotations

import difflib
import hashlib
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


SAMPLES = 4096  # elements of each frozen tensor that the base's fingerprint reads (evenly spread), besides its shape
ADAPTER_KEYS = ("adapter", "lora")  # the model node's keys about the adapter, not about its base


def frozen_base(model: nn.Module) -> list[torch.Tensor]:
    """The parameters a checkpoint does not hold (the model's state_dict leaves them out: an adapted model's frozen
    base), in the model's order; none for a model whose checkpoints hold it whole."""
    held = {id(t) for t in model.state_dict(keep_vars=True).values()}
    return [p for _, p in model.named_parameters() if id(p) not in held]


def fingerprint(tensors: list[torch.Tensor]) -> str:
    """A short hash of the tensors' shapes, dtypes and SAMPLES of each one's elements (evenly spread): another
    pretrained base, another revision, another random initialisation all differ in it (reading every weight of a
    large model would take seconds)."""
    digest = hashlib.sha256()
    for t in tensors:
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLES)][:SAMPLES].contiguous().cpu()
        digest.update(f"{tuple(t.shape)} {t.dtype};".encode())
        digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def base_record(model: nn.Module, node: dict[str, Any]) -> Optional[dict[str, Any]]:
    """What the frozen base of an adapted model is, as checkpoints record it: the factory and its arguments (but the
    adapter's), the name or path and revision, and the fingerprint of its weights as the factory built them. None
    for a model whose checkpoints hold it whole."""
    frozen = frozen_base(model)
    if not frozen:
        return None
    arguments = {k: v for k, v in node.items() if k != "_target_" and k not in ADAPTER_KEYS}
    return dict(factory=node["_target_"], arguments=arguments, name_or_path=node.get("name_or_path"),
                revision=node.get("revision"), fingerprint=fingerprint(frozen))


def describe_base(base: dict[str, Any]) -> str:
    """A base in a few words: the factory, the name (or a random initialisation) and revision, the fingerprint."""
    name = base.get("name_or_path") or "initialised at random"
    revision = f" at revision {base['revision']}" if base.get("revision") else ""
    return f"{str(base.get('factory')).rsplit('.', 1)[-1]} {name}{revision} (weights {base.get('fingerprint')})"


def refuse_another_base(path: Any, saved: Optional[dict[str, Any]], now: Optional[dict[str, Any]]) -> None:
    """A resume continues the adapter on the base it was trained on: a checkpoint of another base (another
    fingerprint of the frozen weights) is refused in one line naming both, and the arguments that differ."""
    if saved is None or now is None or saved.get("fingerprint") == now.get("fingerprint"):
        return
    before, after = flat(saved.get("arguments") or {}, "model"), flat(now.get("arguments") or {}, "model")
    changed = [f"{k}: {before.get(k)} → {after.get(k)}" for k in sorted(set(before) | set(after))
               if before.get(k) != after.get(k)]
    if saved.get("factory") != now.get("factory"):
        changed.insert(0, f"model._target_: {saved.get('factory')} → {now.get('factory')}")
    raise UserError(f"{path} holds an adapter trained on the frozen base {describe_base(saved)}; this run's base is "
                    f"{describe_base(now)}" + (f" ({'; '.join(changed[:3])})" if changed else "")
                    + ": an adapter continues only on the base it was trained on — resume with that base's model "
                    "settings, or start afresh")


def flat(node: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A nested mapping's leaves by dotted key (model.config.n_layer)."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}.{key}"))
        else:
            out[f"{prefix}.{key}"] = value
    return out
