"""The checks of a composed config that a type cannot express, run once per start, before anything is written and
before PyTorch is imported, all in one style — tables of rules, each fact written once: the keys still missing, each
value's range (accutrain.config.ranges), the batch arithmetic where the devices are known (accutrain.core.plan), the
values only a built-in factory bounds (accutrain.config.validate_values), the loss family's own ranges (its spec),
and the combinations refused (accutrain.config.refusals)."""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from accutrain.config import families
from accutrain.config.ranges import check_ranges
from accutrain.config.refusals import refuse_combinations
from accutrain.config.train import TrainConfig
from accutrain.config.typed import typed
from accutrain.config.validate_values import check_values
from accutrain.core.plan import window_split
from accutrain.errors import UserError


def validate(cfg: DictConfig) -> None:
    """Every rule a type cannot express; micro_batch × accum × devices = global_batch where all are numbers
    (make_plan checks it again once micro_batch=auto and devices=auto are known)."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise UserError(f"{', '.join(missing)} must be set: add {' '.join(k + '=…' for k in missing)} to the command")
    check_ranges(cfg)
    if cfg.trainer.epochs is None and cfg.trainer.max_steps is None:
        raise UserError("set trainer.epochs or trainer.max_steps (optimizer steps): both are null")
    if cfg.micro_batch != "auto" and cfg.devices != "auto" and cfg.get("batch_schedule") is None:
        window_split(cfg.micro_batch, cfg.devices, cfg.accum, cfg.global_batch, cfg.get("micro_tokens"))
    check_values(cfg)
    run = typed(cfg)
    family = families.family_of(run.loss)
    if family is not None and family.values is not None:  # the family's ranges a type cannot express
        family.values(run.loss.arguments)
    refuse_combinations(run)
    validate_compile(cfg.trainer)  # last: trainer.compile=true imports torch._dynamo to ask for its backends


def typed_run(cfg: DictConfig) -> TrainConfig:
    """The composed task config checked (validate) and typed (accutrain.config.typed): the run every layer below the
    command line receives."""
    validate(cfg)
    return typed(cfg)


def validate_compile(trainer: Any) -> None:
    """trainer.compile_backend: one of torch.compile's backends (asked of PyTorch, so only when compiling)."""
    if not trainer.compile:
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
