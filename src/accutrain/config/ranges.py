"""The table of valid values: each key a type cannot bound — a count that must be positive, a probability, a name from
a list — with what is valid, checked on the composed config before PyTorch loads. A value outside is one line,
`<key>=<value> is not valid: expected <what>`. Combinations of keys are accutrain.config.refusals' table; the values
only a built-in factory bounds (its `_target_` still accutrain's) are accutrain.config.validate_values'."""
from __future__ import annotations

import math
import signal
import sys
from dataclasses import dataclass
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from accutrain.config import families
from accutrain.errors import UserError
from accutrain.signals import UNCATCHABLE

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # trainer.compile_mode


@dataclass(frozen=True)
class Range:
    """`key`'s value is valid when `ok(value)`; else one line saying what is (`expected`: a callable formats it)."""

    key: str
    ok: Callable[[Any], bool]
    expected: str | Callable[[Any], str]
    show: Callable[[Any], str] = lambda v: shown(v)  # the value in the message
    beside: Callable[[Any], bool] = lambda cfg: True  # what else the key's value must agree with in the config


def integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive(*allow: Any) -> Callable[[Any], bool]:
    """A positive integer (at most sys.maxsize), or one of `allow`."""
    return lambda v: v in allow if not integer(v) else 1 <= v <= sys.maxsize


def count_text(allow: str = "", example: str = "") -> Callable[[Any], str]:
    """'a positive integer' (or what `allow` adds), with the bound a too large value passed and an example."""
    return lambda v: (f"a positive integer{allow}" + (f", at most {sys.maxsize}" if integer(v) and v > sys.maxsize
                                                       else "") + example)


def probability(v: Any) -> bool:
    return 0 <= v <= 1


def pair(low_open: float, high: float) -> Callable[[Any], bool]:
    """[min, max] with low_open < min <= max <= high."""
    def ok(v: Any) -> bool:
        values = list(v)
        return len(values) == 2 and low_open < values[0] <= values[1] <= high
    return ok


def catchable(names: Any) -> bool:
    return all(name in signal.Signals.__members__ and name not in UNCATCHABLE for name in names)


def batch(key: str, allow: tuple[Any, ...]) -> Range:
    valid = "".join(f" or {'null' if a is None else a}" for a in allow)
    return Range(key, positive(*allow), count_text(valid, f" (e.g. {key}=8)"), show=repr)


TRAINER_COUNTS = ("epochs", "max_steps", "eval_every", "eval_batch", "checkpoint_every")
RANGES: tuple[Range, ...] = (
    batch("micro_batch", ("auto",)), batch("accum", (None,)), batch("global_batch", (None,)),
    batch("devices", ("auto",)), batch("micro_tokens", (None, "auto")),
    *(Range(f"trainer.{k}", positive(None), count_text(" or null")) for k in TRAINER_COUNTS),
    *(Range(f"trainer.{k}", positive(), count_text()) for k in ("log_every", "keep_checkpoints")),
    Range("trainer.grad_clip", lambda v: v is None or v > 0, "a positive norm or null"),  # NaN too
    Range("trainer.accum_dtype", lambda v: v in (None, "float32"), "float32 or null"),
    Range("trainer.dist_timeout_s", lambda v: v > 0, "a positive number of seconds"),
    Range("trainer.stop_grace_s", lambda v: v >= 0, "the seconds a stop signal leaves before the kill, 0 or more (0: a "
          "window in progress is always abandoned)"),
    Range("trainer.export", lambda v: v in (None, "hf", "merged", "weights"), "weights (model.safetensors at the "
          "end), hf (save_pretrained), merged (an adapted model with its adapter merged in) or null"),
    Range("trainer.memory_budget_mb", lambda v: v is None or v > 0, "a positive size"),
    Range("trainer.ema", lambda v: v is None or 0 < v < 1, "a decay between 0 and 1 (e.g. 0.999) or null"),
    Range("trainer.ema_device", lambda v: v in (None, "cpu"), "cpu or null (beside the weights)"),
    Range("trainer.monitor", lambda v: v in families.metrics(), lambda v: f"one of {', '.join(families.metrics())}"),
    Range("trainer.monitor_mode", lambda v: v in (None, "min", "max"), "min, max or null"),
    Range("trainer.early_stopping", lambda v: v is None or v >= 1, "a patience of 1 or more evaluations, or null"),
    Range("trainer.min_delta", lambda v: 0 <= v < math.inf, "a finite number, 0 or more"),  # NaN never improves
    Range("trainer.noise_scale_decay", lambda v: 0 <= v < 1, "0 <= decay < 1 (e.g. 0.95)"),
    Range("trainer.preempt_signals", catchable, "names of signals a process can catch, such as SIGTERM, SIGINT, "
          "SIGUSR1, SIGUSR2"),
    Range("trainer.compile_mode", lambda v: v is None or v in COMPILE_MODES, f"one of {', '.join(COMPILE_MODES)}, "
          "or null"),
    Range("batchnorm.groups", lambda v: v >= 1, "a positive integer"),
    Range("loader.num_workers", lambda v: v == "auto" or (integer(v) and v >= 0), "auto or a number of processes "
          "(0: the training process reads the data itself)"),
    Range("sched.warmup_steps", lambda v: v >= 0, "0 or more"),
    Range("scaling.base_batch", lambda v: v is None or v >= 1, "a positive batch size or null"),
    Range("strategy.name", lambda v: v in ("ddp", "fsdp"), "ddp or fsdp, chosen with strategy=ddp or strategy=fsdp "
          "(which brings its keys)", beside=lambda c: (c.strategy.name == "fsdp") == ("sync" in c.strategy)),
    Range("augment.views", lambda v: v in (1, 2), "1, or 2 (a pair of views per sample)"),
    Range("augment.padding", lambda v: v == "auto" or (integer(v) and v >= 0), "auto or 0 or more pixels"),
    Range("augment.flip", lambda v: v in (True, False, "auto"), "true, false or auto"),
    Range("augment.scale", pair(0.0, 1.0), "[min, max], the crop's area as a fraction of the image's, 0 < min <= max "
          "<= 1 (a crop cannot be larger than the image)"),
    Range("augment.ratio", pair(0.0, math.inf), "[min, max], the crop's aspect ratio range, 0 < min <= max"),
    Range("augment.policy", lambda v: v in (None, "trivialaugment", "randaugment"), "trivialaugment, randaugment or "
          "null"),
    Range("augment.num_ops", lambda v: v >= 1, "1 or more operations"),
    Range("augment.magnitude", lambda v: 0 <= v <= 30, "a magnitude from 0 to 30"),
    *(Range(f"augment.{k}", probability, "a probability between 0 and 1")
      for k in ("random_erasing", "mix_prob", "switch_prob")),
    Range("augment.eval_crop_ratio", lambda v: 0 < v <= 1, "0 < ratio <= 1 (0.875: resize to image_size / 0.875, "
          "centre-crop image_size)"),
    *(Range(f"augment.{k}", lambda v: 0 <= v < math.inf, "0 (off) or a positive Beta(α, α) parameter (e.g. 0.2 for "
                                                           "MixUp, 1.0 for CutMix)") for k in ("mixup_alpha", "cutmix_alpha")),
)


def shown(value: Any) -> str:
    """A value as the user typed it: lists as lists, strings bare."""
    plain = OmegaConf.to_container(value) if isinstance(value, (DictConfig,)) or type(value).__name__ == "ListConfig" \
        else value
    return repr(plain) if isinstance(plain, str) and plain == "" else str(plain)


def check_ranges(cfg: DictConfig) -> None:
    """The first value of `cfg` outside its range, as one UserError."""
    for entry in RANGES:
        value = OmegaConf.select(cfg, entry.key)
        try:
            valid = entry.ok(value) and entry.beside(cfg)
        except TypeError:  # a value of another type (a string where a number goes)
            valid = False
        if not valid:
            expected = entry.expected(value) if callable(entry.expected) else entry.expected
            raise UserError(f"{entry.key}={entry.show(value)} is not valid: expected {expected}")
