"""The values PyTorch or the maths refuse, checked before PyTorch is imported (accutrain.config.validate calls
`check_values`): the optimizer's, the schedule's and the built-in models' keys, the seeds, and micro_batch=auto's
memory budget on the CPU. A built-in option's keys are checked only while its `_target_` is accutrain's own: a
`_target_` of the user's takes whatever its own code accepts."""
from __future__ import annotations

import math
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from accutrain.config.data_schemas import HFData, SequenceData, SyntheticData, TextData
from accutrain.config.schemas import (
    AdamWOptim,
    CharLMModel,
    CNNModel,
    CosineSched,
    HFCausalLMModel,
    HFEncoderModel,
    HFSeqClsModel,
    MLPModel,
    SGDOptim,
)
from accutrain.errors import UserError

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.manual_seed and torch.Generator.manual_seed accept


def builtin(node: Any, *schemas: type) -> bool:
    """`node` is one of these built-in options, its `_target_` still accutrain's own: its keys are ours to check."""
    kind = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    return any(kind is s and node.get("_target_") == s._target_ for s in schemas)


def number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite_at_least(key: str, value: Any, low: float, what: str, *, above: bool = False) -> None:
    """Refuse a value that is not a finite number ≥ low (> low with `above`): one line naming key, value, what."""
    ok = number(value) and math.isfinite(value) and (value > low if above else value >= low)
    if not ok:
        raise UserError(f"{key}={value} is not valid: expected {what}")


def check_values(cfg: DictConfig) -> None:
    """Every value of `cfg` that PyTorch would refuse with a traceback, or accept and train wrongly."""
    check_seed("seed", cfg.seed)
    if "seed" in cfg.data and builtin(cfg.data, SyntheticData, SequenceData, TextData):
        check_seed("data.seed", cfg.data.seed)
    check_optim(cfg.optim)
    check_sched(cfg.sched)
    check_model(cfg.model)
    if cfg.trainer.checkpoint_minutes is not None:
        finite_at_least("trainer.checkpoint_minutes", cfg.trainer.checkpoint_minutes, 0, "a positive number of "
                        "minutes, or null (no checkpoint by the clock nor at epoch ends)", above=True)
    if builtin(cfg.data, SyntheticData) and cfg.data.num_classes < 2:
        raise UserError(f"data.num_classes={cfg.data.num_classes} is not valid: expected 2 or more classes (with one, "
                        "cross-entropy is 0 whatever the model says: nothing is learned)")
    if builtin(cfg.data, HFData):
        check_buffer_size(cfg.data.buffer_size)
    if cfg.trainer.device == "cpu":
        auto_needs_budget(cfg, "cpu")
    threads = cfg.trainer.threads
    if threads is not None and threads != "auto" and not (number(threads) and threads == int(threads) >= 1):
        raise UserError(f"trainer.threads={threads} is not valid: expected null (PyTorch's default, or "
                        "OMP_NUM_THREADS), a number of threads (1, 2, …) or auto (the cores the load leaves free)")


def check_buffer_size(value: Any) -> None:
    """data.buffer_size: the shuffle buffer a stream's samples pass through holds at least one."""
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise UserError(f"data.buffer_size={value} is not valid: expected the number of records the shuffle buffer "
                        "of data.streaming=true holds, 1 or more (e.g. 1000; 1: no shuffling)")


def check_seed(key: str, value: int) -> None:
    if not SEED_MIN <= value <= SEED_MAX:
        raise UserError(f"{key}={value} is not valid: expected an integer from {SEED_MIN} to {SEED_MAX} (what "
                        "torch.manual_seed accepts), e.g. 0")


def check_optim(o: DictConfig) -> None:
    """optim.lr for every optimizer (accutrain sets it on the parameter groups); the built-in ones' keys as
    torch.optim.SGD and AdamW check them, NaN and infinity included, which they let through."""
    finite_at_least("optim.lr", o.lr, 0, "a positive, finite learning rate (e.g. optim.lr=0.01)", above=True)
    if not builtin(o, SGDOptim, AdamWOptim):
        return
    finite_at_least("optim.weight_decay", o.weight_decay, 0, "0 (none) or a positive, finite decay")
    if builtin(o, SGDOptim):
        finite_at_least("optim.momentum", o.momentum, 0, "0 (none) or a positive, finite momentum (e.g. 0.9)")
        if o.nesterov and o.momentum == 0:
            raise UserError("optim.nesterov=true needs momentum: optim.momentum=0 has none to look ahead with (set "
                            "optim.momentum, e.g. 0.9, or optim.nesterov=false)")
        return
    betas = list(o.betas)
    if len(betas) != 2 or not all(number(b) and 0 <= b < 1 for b in betas):
        raise UserError(f"optim.betas={betas} is not valid: expected two decays [β1, β2], each 0 <= β < 1 (e.g. "
                        "[0.9,0.999])")
    finite_at_least("optim.eps", o.eps, 0, "a positive, finite number (e.g. 1e-8): with 0, a parameter whose "
                    "gradient is 0 is updated by 0/0 = NaN", above=True)


def check_sched(s: DictConfig) -> None:
    if builtin(s, CosineSched) and not (number(s.min_lr_ratio) and 0 <= s.min_lr_ratio <= 1):
        raise UserError(f"sched.min_lr_ratio={s.min_lr_ratio} is not valid: expected a fraction of the peak lr, "
                        "0 <= ratio <= 1 (e.g. 0.1)")


def check_model(m: DictConfig) -> None:
    """The built-in models' sizes (positive) and dropout probabilities (0 to 1)."""
    sizes = {MLPModel: "hidden", CNNModel: "channels", CharLMModel: ("embedding", "hidden")}
    for schema, keys in sizes.items():
        if not builtin(m, schema):
            continue
        for key in (keys if isinstance(keys, tuple) else (keys,)):
            value = m[key]
            single = isinstance(value, int)
            if any(v < 1 for v in ([value] if single else list(value))):
                shown = value if single else OmegaConf.to_container(value)
                raise UserError(f"model.{key}={shown} is not valid: expected " + (
                    "a positive size" if single else "a list of positive sizes, one per layer (e.g. [256,256])"))
    if builtin(m, MLPModel, CNNModel, HFCausalLMModel, HFSeqClsModel, HFEncoderModel):
        dropout: Optional[float] = m.dropout
        if dropout is not None and not 0 <= dropout <= 1:
            raise UserError(f"model.dropout={dropout} is not valid: expected a probability between 0 and 1"
                            + (" or null" if builtin(m, HFCausalLMModel, HFSeqClsModel, HFEncoderModel) else ""))


def auto_needs_budget(cfg: Any, device_type: str) -> None:
    """micro_batch=auto (micro_tokens=auto) finds its size by trial steps that run out of memory; the CPU has no such error to detect,
    so it needs trainer.memory_budget_mb. Called before PyTorch loads for trainer.device=cpu, and once the device is
    resolved (accutrain.runtime.launch.place, still before the run directory is made) for trainer.device=auto."""
    for key in ("micro_batch", "micro_tokens"):
        if getattr(cfg, key) == "auto" and device_type == "cpu" and cfg.trainer.memory_budget_mb is None:
            raise UserError(f"{key}=auto on the CPU needs trainer.memory_budget_mb=N: the peak memory (MiB) a "
                            "training step may reach, since the CPU has no out-of-memory error to detect")
