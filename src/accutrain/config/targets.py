"""Factory nodes (`_target_` and its keyword arguments: model, data, optim, sched, each tracker): the callable a
`_target_` names, the arguments the run supplies, and the call — Hydra's instantiate, so that what a run's
config.yaml records is what `hydra.utils.instantiate` builds."""
from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
import traceback
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from accutrain.config.train import GROUP_NODES
from accutrain.errors import UserError, one_line

log = logging.getLogger("accutrain")

# accutrain 0.1's flat modules that a `_target_` may still name (a saved config, a user's yaml), and their homes since
# the package was layered; the built-in models' and data's factories kept their paths (accutrain.models.mlp, …).
MOVED = {
    "accutrain.optim": "accutrain.models.optim", "accutrain.sched": "accutrain.models.sched",
    "accutrain.hf": "accutrain.models.hf", "accutrain.ema": "accutrain.models.ema",
    "accutrain.text": "accutrain.data.text", "accutrain.views": "accutrain.data.views",
    "accutrain.tokenizer": "accutrain.data.tokenizer", "accutrain.batches": "accutrain.core.batches",
    "accutrain.sweep": "accutrain.report.sweep", "accutrain.metrics": "accutrain.train.metrics",
}


def moved(target: str) -> str:
    """`target` with a module of accutrain 0.1 replaced by its new home (said once in the log), else itself."""
    for old, new in MOVED.items():
        if target.startswith(old + "."):
            log.warning(f"{target}: {old} is now {new}; write {new + target[len(old):]} (the old path stops working "
                        "in a later version)")
            return new + target[len(old):]
    return target


def load_target(key: str, target: str) -> Callable[..., Any]:
    """The callable a `_target_` names (module.attribute); one clear line when it cannot be imported."""
    parts = moved(target).split(".")
    first_error: Optional[ImportError] = None
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError as e:
            first_error = first_error or e
            continue
        for j, attr in enumerate(parts[i:]):
            if not hasattr(obj, attr):
                raise UserError(f"{key}={target}: {'.'.join(parts[: i + j])} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        if not callable(obj):
            raise UserError(f"{key}={target} is not callable: expected a class or function")
        return obj
    raise UserError(f"{key}={target}: cannot import it ({first_error or 'expected module.attribute'})")


def plain(node: DictConfig | dict) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def instantiate(key: str, node: DictConfig | dict, *args: Any) -> Any:
    """`hydra.utils.instantiate(node, *args)`: its `_target_` called with `args` and the node's other keys (nested
    `_target_`s built first). An import error is one line naming `key._target_`; an exception the call raises
    reaches the caller as it was raised (not wrapped), so that a plug-in's own error can be named."""
    from hydra.utils import instantiate as hydra_instantiate

    values = plain(node)
    target = load_target(f"{key}._target_", values["_target_"])
    refuse_unknown_arguments(key, values["_target_"], target, {k: v for k, v in values.items() if k != "_target_"})
    values["_target_"] = moved(values["_target_"])
    return hydra_instantiate(values, _partial_=True, _convert_="all")(*args)


def run_arguments(key: str, node: DictConfig | dict, offered: dict[str, Any]) -> dict[str, Any]:
    """The arguments of `offered` (the run's seed, the data's num_classes, …) that `key._target_` takes and the
    node does not set: what the run records in the node before instantiating it."""
    values = plain(node)
    target = load_target(f"{key}._target_", values["_target_"])
    return {k: v for k, v in accepted(target, offered).items() if k not in values}


def record(node: DictConfig, arguments: dict[str, Any]) -> None:
    """Add `arguments` to a factory node of the run's config (so config.yaml holds every argument of the call)."""
    with open_dict(node):
        for name, value in arguments.items():
            node[name] = value


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


def plugin_failure(error: BaseException, cfg: DictConfig) -> Optional[str]:
    """When `error` was raised in the code of a user plug-in (a `_target_` outside accutrain), one line naming it,
    the error and where: `the model mymodels.Net raised RuntimeError: … (mymodels.py:12, in forward)`; else None."""
    frames = traceback.extract_tb(error.__traceback__)
    for group in GROUP_NODES:
        target = OmegaConf.select(cfg, f"{group}._target_")
        if not isinstance(target, str) or target.startswith("accutrain."):
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
