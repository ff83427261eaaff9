"""The checks of a composed config that a type cannot express, run once per start, before anything is written and
before PyTorch is imported; the batch arithmetic too, where the devices are known (a number, not auto). The values
PyTorch or the maths refuse (the optimizer's, the schedule's, the seeds, …) are in accutrain.config.validate_values."""
from __future__ import annotations

import math
import os
import signal
import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf

from accutrain.config.refusals import refuse_combinations
from accutrain.config.train import TrainConfig
from accutrain.config.typed import typed
from accutrain.config.validate_values import check_values
from accutrain.config import families
from accutrain.core.options import Beta2Scaling, LRScaling
from accutrain.core.plan import derive_accum, window_split
from accutrain.errors import UserError
from accutrain.signals import UNCATCHABLE

NOISE_SCALE_NEEDS_TWO = ("trainer.noise_scale=true compares each micro-batch's gradient with the window's: with "
                         "accum=1 on one device they are the same; set accum ≥ 2 (or devices ≥ 2) or "
                         "trainer.noise_scale=false")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # trainer.compile_mode


def positive_int(cfg: DictConfig, key: str, *, allow: tuple[Any, ...] = ()) -> None:
    """Refuse anything but a positive int (or one of `allow`) with one line naming key, value and what is valid."""
    value = cfg[key]
    if value in allow:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= sys.maxsize:
        valid = " or ".join(["a positive integer", *("null" if a is None else str(a) for a in allow)])
        limit = f", at most {sys.maxsize}" if isinstance(value, int) and value > sys.maxsize else ""
        raise UserError(f"{key}={value!r} is not valid: expected {valid}{limit} (e.g. {key}=8)")


def validate(cfg: DictConfig) -> None:
    """The checks a type cannot express, and micro_batch × accum × devices = global_batch where all are numbers
    (make_plan checks it again once micro_batch=auto and devices=auto are known)."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise UserError(f"{', '.join(missing)} must be set: add {' '.join(k + '=…' for k in missing)} to the command")
    positive_int(cfg, "micro_batch", allow=("auto",))
    positive_int(cfg, "accum", allow=(None,))
    positive_int(cfg, "global_batch", allow=(None,))
    positive_int(cfg, "devices", allow=("auto",))
    micro_tokens = cfg.get("micro_tokens")
    positive_int(cfg, "micro_tokens", allow=(None, "auto"))
    t = cfg.trainer
    if t.epochs is None and t.max_steps is None:
        raise UserError("set trainer.epochs or trainer.max_steps (optimizer steps): both are null")
    for key in ("epochs", "max_steps", "eval_every", "eval_batch", "checkpoint_every"):
        if t[key] is not None and not 1 <= t[key] <= sys.maxsize:
            raise UserError(f"trainer.{key}={t[key]} is not valid: expected a positive integer or null"
                            + (f", at most {sys.maxsize}" if t[key] > 0 else ""))
    for key in ("log_every", "keep_checkpoints"):
        if not 1 <= t[key] <= sys.maxsize:
            raise UserError(f"trainer.{key}={t[key]} is not valid: expected a positive integer"
                            + (f", at most {sys.maxsize}" if t[key] > 0 else ""))
    if t.overwrite and cfg.resume is not None:
        raise UserError(f"resume={cfg.resume} continues a run and trainer.overwrite=true deletes the run directory's "
                        "earlier run: choose one")
    if t.grad_clip is not None and not t.grad_clip > 0:  # NaN too
        raise UserError(f"trainer.grad_clip={t.grad_clip} is not valid: expected a positive norm or null")
    if cfg.get("batch_schedule") is not None and (cfg.accum is not None or cfg.global_batch is not None):
        key = "accum" if cfg.accum is not None else "global_batch"
        raise UserError(f"batch_schedule sets the effective batch of every window: drop {key}={cfg[key]} (accum "
                        "follows from the schedule and micro_batch × devices)")
    if cfg.micro_batch == "auto" and cfg.global_batch is None and cfg.get("batch_schedule") is None:
        raise UserError("micro_batch=auto needs global_batch=N: the effective batch to keep while it finds the "
                        "largest micro-batch that fits")
    if cfg.micro_batch == "auto" and cfg.accum is not None:
        raise UserError(f"micro_batch=auto derives accum from global_batch: drop accum={cfg.accum}")
    if micro_tokens is not None and (cfg.micro_batch == "auto" or cfg.get("batch_schedule") is not None):
        key = "micro_batch=auto" if cfg.micro_batch == "auto" else "batch_schedule"
        raise UserError(f"micro_tokens={micro_tokens} cuts each window by a token budget; {key} sizes micro-batches "
                        "by samples: use one of them (micro_tokens with global_batch=N, or micro_batch × accum)")
    if cfg.micro_batch != "auto" and cfg.devices != "auto" and cfg.get("batch_schedule") is None:
        window_split(cfg.micro_batch, cfg.devices, cfg.accum, cfg.global_batch, micro_tokens)
    if t.accum_dtype not in (None, "float32"):
        raise UserError(f"trainer.accum_dtype={t.accum_dtype} is not valid: expected float32 or null")
    if not t.dist_timeout_s > 0:
        raise UserError(f"trainer.dist_timeout_s={t.dist_timeout_s} is not valid: expected a positive number of "
                        "seconds")
    if not t.stop_grace_s >= 0:  # NaN too
        raise UserError(f"trainer.stop_grace_s={t.stop_grace_s} is not valid: expected the seconds a stop signal "
                        "leaves before the kill, 0 or more (0: a window in progress is always abandoned)")
    if t.get("export") not in (None, "hf", "merged", "weights"):
        raise UserError(f"trainer.export={t.export} is not valid: expected weights (model.safetensors at the end), hf "
                        "(save_pretrained), merged (an adapted model with its adapter merged in) or null")
    if t.memory_budget_mb is not None and not t.memory_budget_mb > 0:
        raise UserError(f"trainer.memory_budget_mb={t.memory_budget_mb} is not valid: expected a positive size")
    if cfg.batchnorm.groups < 1:
        raise UserError(f"batchnorm.groups={cfg.batchnorm.groups} is not valid: expected a positive integer")
    workers = cfg.loader.num_workers
    if workers != "auto" and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise UserError(f"loader.num_workers={workers} is not valid: expected auto or a number of processes (0: "
                        "the training process reads the data itself)")
    if cfg.sched.warmup_steps < 0:
        raise UserError(f"sched.warmup_steps={cfg.sched.warmup_steps} is not valid: expected 0 or more")
    if cfg.scaling.base_batch is not None and cfg.scaling.base_batch < 1:
        raise UserError(f"scaling.base_batch={cfg.scaling.base_batch} is not valid: expected a positive batch size or "
                        "null")
    if cfg.scaling.lr is not LRScaling.none and cfg.scaling.base_batch is None:
        raise UserError(f"scaling.lr={cfg.scaling.lr.name} needs scaling.base_batch, the effective batch optim.lr was "
                        f"tuned for (e.g. scaling.base_batch=32)")
    validate_batch_following(cfg)
    if t.ema is not None and not 0 < t.ema < 1:
        raise UserError(f"trainer.ema={t.ema} is not valid: expected a decay between 0 and 1 (e.g. 0.999) or null")
    if t.ema_device not in (None, "cpu"):
        raise UserError(f"trainer.ema_device={t.ema_device} is not valid: expected cpu or null (beside the weights)")
    if t.monitor not in families.metrics():
        raise UserError(f"trainer.monitor={t.monitor} is not valid: expected one of {', '.join(families.metrics())}")
    if t.monitor.endswith("_ema") and t.ema is None:
        raise UserError(f"trainer.monitor={t.monitor} is never measured without an average of the weights: set "
                        f"trainer.ema (e.g. trainer.ema=0.999) or monitor {t.monitor.removesuffix('_ema')}")
    if t.monitor_mode not in (None, "min", "max"):
        raise UserError(f"trainer.monitor_mode={t.monitor_mode} is not valid: expected min, max or null")
    if t.early_stopping is not None and t.early_stopping < 1:
        raise UserError(f"trainer.early_stopping={t.early_stopping} is not valid: expected a patience of 1 or more "
                        "evaluations, or null")
    if not 0 <= t.min_delta < math.inf:  # NaN would never let an evaluation improve
        raise UserError(f"trainer.min_delta={t.min_delta} is not valid: expected a finite number, 0 or more")
    augment_and_loss(cfg)
    for name in t.preempt_signals:
        if name not in signal.Signals.__members__ or name in UNCATCHABLE:
            raise UserError(f"trainer.preempt_signals has {name}, which is not a signal a process can catch: expected "
                            "names such as SIGTERM, SIGINT, SIGUSR1, SIGUSR2")
    validate_strategy(cfg)
    if cfg.augment.views not in (1, 2):
        raise UserError(f"augment.views={cfg.augment.views} is not valid: expected 1, or 2 (a pair of views per "
                        "sample)")
    check_values(cfg)
    run = typed(cfg)
    family = families.family_of(run.loss)
    if family is not None and family.values is not None:  # the family's ranges a type cannot express
        family.values(run.loss.arguments)
    refuse_combinations(run)
    validate_compile(t)  # last: trainer.compile=true imports torch._dynamo to ask for its backends


def typed_run(cfg: DictConfig) -> TrainConfig:
    """The composed task config checked (validate) and typed (accutrain.config.typed): the run every layer below the
    command line receives."""
    validate(cfg)
    return typed(cfg)


def validate_batch_following(cfg: DictConfig) -> None:
    """scaling.beta2 and scaling.ema need a base batch and something to scale; trainer.noise_scale needs more than one
    micro-batch per window to compare with the window (checked here where accum and devices are numbers, else by
    the build)."""
    s, t = cfg.scaling, cfg.trainer
    if s.beta2 is not Beta2Scaling.none:
        if s.base_batch is None:
            raise UserError(f"scaling.beta2={s.beta2.name} needs scaling.base_batch, the effective batch optim.betas "
                            "was tuned for (e.g. scaling.base_batch=32)")
        if "betas" not in cfg.optim:
            raise UserError(f"scaling.beta2={s.beta2.name} scales Adam's β2, and optim._target_={cfg.optim._target_} "
                            "has no betas: use optim=adamw (an Adam of your own: give +optim.betas=[0.9,0.999]) or "
                            "scaling.beta2=none")
    if s.ema:
        if t.ema is None:
            raise UserError("scaling.ema=true scales the decay of trainer.ema, which is off: set trainer.ema (e.g. "
                            "trainer.ema=0.999) or scaling.ema=false")
        if s.base_batch is None:
            raise UserError("scaling.ema=true needs scaling.base_batch, the effective batch trainer.ema was tuned for "
                            "(e.g. scaling.base_batch=32)")
    if not 0 <= t.noise_scale_decay < 1:
        raise UserError(f"trainer.noise_scale_decay={t.noise_scale_decay} is not valid: expected 0 <= decay < 1 (e.g. "
                        "0.95)")
    launched = int(os.environ.get("WORLD_SIZE", "1"))  # a torchrun or SLURM world: devices=1 is its default there
    if t.noise_scale and cfg.devices == 1 and launched == 1 and cfg.micro_batch != "auto" and \
            cfg.get("batch_schedule") is None and cfg.get("micro_tokens") is None and \
            derive_accum(cfg.micro_batch, 1, cfg.accum, cfg.global_batch) == 1:
        raise UserError(NOISE_SCALE_NEEDS_TWO)


def augment_and_loss(cfg: DictConfig) -> None:
    """augment.*: ranges a type cannot express."""
    a, key = cfg.augment, "augment"
    if a.padding != "auto" and (isinstance(a.padding, bool) or not isinstance(a.padding, int) or a.padding < 0):
        raise UserError(f"{key}.padding={a.padding} is not valid: expected auto or 0 or more pixels")
    if a.flip not in (True, False, "auto"):
        raise UserError(f"{key}.flip={a.flip} is not valid: expected true, false or auto")
    for name, low in (("scale", 0.0), ("ratio", 0.0)):
        pair = list(a[name])
        if len(pair) != 2 or not low < pair[0] <= pair[1] or (name == "scale" and pair[1] > 1):
            what = ("the crop's area as a fraction of the image's, 0 < min <= max <= 1 (a crop cannot be larger "
                    "than the image)" if name == "scale" else "the crop's aspect ratio range, 0 < min <= max")
            raise UserError(f"{key}.{name}={pair} is not valid: expected [min, max], {what}")
    if a.policy not in (None, "trivialaugment", "randaugment"):
        raise UserError(f"{key}.policy={a.policy} is not valid: expected trivialaugment, randaugment or null")
    if a.num_ops < 1 or not 0 <= a.magnitude <= 30:
        bad = "num_ops" if a.num_ops < 1 else "magnitude"
        raise UserError(f"{key}.{bad}={a[bad]} is not valid: expected " +
                        ("1 or more operations" if bad == "num_ops" else "a magnitude from 0 to 30"))
    for name in ("random_erasing", "mix_prob", "switch_prob"):
        if not 0 <= a[name] <= 1:
            raise UserError(f"{key}.{name}={a[name]} is not valid: expected a probability between 0 and 1")
    if not 0 < a.eval_crop_ratio <= 1:
        raise UserError(f"{key}.eval_crop_ratio={a.eval_crop_ratio} is not valid: expected 0 < ratio <= 1 (0.875: "
                        "resize to image_size / 0.875, centre-crop image_size)")
    for name in ("mixup_alpha", "cutmix_alpha"):
        if not 0 <= a[name] < math.inf:
            raise UserError(f"{key}.{name}={a[name]} is not valid: expected 0 (off) or a positive Beta(α, α) "
                            "parameter (e.g. 0.2 for MixUp, 1.0 for CutMix)")


def validate_strategy(cfg: DictConfig) -> None:
    """strategy=: its name is the option's (what FSDP cannot be combined with is in accutrain.config.refusals)."""
    s = cfg.strategy
    if s.name not in ("ddp", "fsdp") or (s.name == "fsdp") != ("sync" in s):
        raise UserError(f"strategy.name={s.name} is not valid: choose the strategy with strategy=ddp or strategy=fsdp "
                        "(which brings its keys)")


def validate_compile(trainer: Any) -> None:
    """trainer.compile, compile_mode and compile_backend: one line for what cannot work."""
    if trainer.compile_mode is not None and trainer.compile_mode not in COMPILE_MODES:
        raise UserError(f"trainer.compile_mode={trainer.compile_mode} is not valid: expected one of "
                        f"{', '.join(COMPILE_MODES)}, or null")
    if not trainer.compile:
        if trainer.compile_mode is not None:
            raise UserError(f"trainer.compile_mode={trainer.compile_mode} does nothing without trainer.compile=true")
        return
    import torch._dynamo  # here, not above: the other checks run before the command line imports PyTorch

    if not torch._dynamo.is_dynamo_supported():
        raise UserError("trainer.compile=true: torch.compile does not support this Python/PyTorch; "
                        "use trainer.compile=false")
    backends = torch._dynamo.list_backends(exclude_tags=())
    if trainer.compile_backend not in backends:
        raise UserError(f"trainer.compile_backend={trainer.compile_backend} is not valid: expected one of "
                        f"{', '.join(sorted(backends))}")
    if trainer.compile_mode is not None and trainer.compile_backend != "inductor":
        raise UserError(f"trainer.compile_mode={trainer.compile_mode} is a mode of the inductor backend, not of "
                        f"trainer.compile_backend={trainer.compile_backend}")
