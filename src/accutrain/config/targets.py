"""Factory nodes (`_target_` and its keyword arguments: model, data, optim, sched, each tracker): the callable a
`_target_` names, the arguments the run supplies, and the call — Hydra's instantiate, so that what a run's
config.yaml records is what `hydra.utils.instantiate` builds."""
from __future__ import annotations

import inspect
import logging
import os
import sys
import traceback
from typing import TYPE_CHECKING, Any, Callable, Optional

from accutrain.config import families
from accutrain.config.loading import load_target, moved
from accutrain.config.train import GROUP_NODES, TrainConfig
from accutrain.config.typed import Factory
from accutrain.errors import UserError, one_line

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger("accutrain")


def plain(node: Factory | DictConfig | dict) -> dict[str, Any]:
    """A factory node as plain data, `_target_` and its arguments."""
    if isinstance(node, Factory):
        return node.node()
    if type(node).__module__.startswith("omegaconf"):  # a composed node (the command line's): resolved
        from omegaconf import OmegaConf

        return OmegaConf.to_container(node, resolve=True)
    return dict(node)


def instantiate(key: str, node: Factory | DictConfig | dict, *args: Any) -> Any:
    """`hydra.utils.instantiate(node, *args)`: its `_target_` called with `args` and the node's other keys (nested
    `_target_`s built first). An import error is one line naming `key._target_`; an exception the call raises
    reaches the caller as it was raised (not wrapped), so that a plug-in's own error can be named."""
    values = plain(node)
    target = load_target(f"{key}._target_", values["_target_"])
    refuse_unknown_arguments(key, values["_target_"], target, {k: v for k, v in values.items() if k != "_target_"})
    values["_target_"] = moved(values["_target_"])
    return hydra_call(key, values)(*args)


def hydra_call(key: str, values: dict[str, Any]) -> Any:
    """Hydra's instantiate of `values` as a partial (nothing called yet); what Hydra itself refuses — a target its
    policy blocks (os.system, subprocess.…), a nested node it cannot build — one line naming `key._target_`."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(values, _partial_=True, _convert_="all")
    except InstantiationException as e:
        said = " ".join(line.strip() for line in str(e).splitlines() if line.strip() and not line.startswith(
            "full_key:"))
        raise UserError(f"{key}._target_={values['_target_']}: Hydra will not instantiate it ({said[:300]})") from None


def run_arguments(key: str, node: Factory | DictConfig | dict, offered: dict[str, Any]) -> dict[str, Any]:
    """The arguments of `offered` (the run's seed, the data's num_classes, …) that `key._target_` takes and the
    node does not set: what the run supplies to the factory (and records beside its config, config/typed.Supplied)."""
    values = plain(node)
    target = load_target(f"{key}._target_", values["_target_"])
    return {k: v for k, v in accepted(target, offered).items() if k not in values}


def refuse_unknown_arguments(key: str, name: str, target: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """A key of the node that `target` takes no keyword argument for (and no **kwargs) is one line naming the key
    and the arguments it does take — rather than the TypeError of the call (a `+data.size` the user's factory does
    not know, or one a preset such as debug=fast adds)."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a callable without a signature to read: its own call decides
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in kwargs if k not in names]
    if unknown:
        given = ", ".join(f"{key}.{k}={kwargs[k]!r}" for k in unknown)
        plural = "s" if len(unknown) > 1 else ""
        raise UserError(f"{given}: {key}._target_={name} takes no argument{plural} {', '.join(map(repr, unknown))} "
                        f"(its arguments: {', '.join(names) or 'none'}): remove {'them' if plural else 'it'} with "
                        f"{' '.join(f'~{key}.{k}' for k in unknown)}, or give {name.rsplit('.', 1)[-1]} "
                        f"the parameter{plural} (or **kwargs)")


def accepted(target: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The arguments of `offered` that `target` takes (by name, or all of them through **kwargs)."""
    params = inspect.signature(target).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in offered.items() if takes_any or k in params}


def targets(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(key, `_target_`) of every factory node of the run: model, data, optim, sched, loss, each logger."""
    found = [(group, getattr(cfg, group).target) for group in GROUP_NODES if group not in ("strategy", "logger")]
    return found + [(f"logger.{name}", node.target) for name, node in cfg.logger.items()]


def plugin_failure(error: BaseException, cfg: TrainConfig) -> Optional[str]:
    """When `error` was raised in the code of a user plug-in (a `_target_` outside accutrain), one line naming it,
    the error and where: `the model mymodels.Net raised RuntimeError: … (mymodels.py:12, in forward)`; else None."""
    frames = traceback.extract_tb(error.__traceback__)
    for group, target in targets(cfg):
        if target.startswith("accutrain."):
            continue
        parts = target.split(".")
        modules = [sys.modules.get(".".join(parts[:i])) for i in range(len(parts) - 1, 0, -1)]
        source = next((getattr(m, "__file__", None) for m in modules if m is not None), None)
        if source is None:
            continue
        here = [f for f in frames if os.path.realpath(f.filename) == os.path.realpath(source)]
        if here:
            where = f"{os.path.basename(here[-1].filename)}:{here[-1].lineno}, in {here[-1].name}"
            return f"the {group} {target} raised {one_line(error)} ({where})"
    return None


def check_plugins(cfg: TrainConfig) -> None:
    """Every `_target_` of the user's own imports (a syntax error or an exception at import is one line naming the
    key, the file and the line), and a custom loss takes the arguments its node gives it: before anything runs."""
    for key, target in targets(cfg):
        if target.startswith("accutrain."):
            continue
        made = load_target(f"{key}._target_", target)
        hydra_call(key, {"_target_": target})  # a target Hydra's policy blocks: refused before the run starts
        if key == "loss" and not families.implements(made):  # a per-term loss (a family of the user's: its own)
            check_loss_call(made, target, {k: v for k, v in cfg.loss.arguments.items()
                                           if k not in ("normalize", "ignore_index")})


def check_loss_call(make: Callable[..., Any], target: str, kwargs: dict[str, Any]) -> None:
    """loss=custom calls `_target_(output, target, **node)` for a function, or `_target_(**node)(output, target)` for
    a class: a required argument the node does not give is one line, not a TypeError in the first step."""
    try:
        if inspect.isclass(make):
            inspect.signature(make).bind(**kwargs)
            inspect.signature(make.__call__).bind(None, None, None)
        else:
            inspect.signature(make).bind(None, None, **kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, ValueError):  # no signature to read: the call decides
            return
        missing = str(e).removeprefix("missing a required argument: ").strip("'")
        raise UserError(f"loss._target_={target} cannot be called as accutrain calls a loss ({e}): "
                        + (f"give it with +loss.{missing}=…" if "missing a required argument" in str(e) else
                           "it takes (output, target) and the loss node's keys as keyword arguments")) from None
