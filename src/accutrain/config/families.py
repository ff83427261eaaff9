"""The loss families' registry: every spec module of accutrain.core.losses (`<family>_spec.py`, its `FAMILIES`),
discovered once, torch-free — and what the rest of the config asks of the run's loss: its family, its traits, whether
its terms are elements, the metrics it measures.

A `loss._target_` that no spec names is a plug-in: a class whose instances implement the Loss protocol
(accutrain.core.loss; e.g. a subclass of accutrain.core.losses.window.WindowLoss) is a family of its own, its traits
read from the class; anything else is a per-term loss (loss=custom's family)."""
from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from typing import Any, Mapping, Optional

from accutrain.config.loading import load_target
from accutrain.config.model_traits import target_of
from accutrain.core.losses.spec import Family, Traits

PROTOCOL = ("accumulate", "evaluate", "terms", "reference", "probe", "check", "attach")  # what makes a class a Loss
TRAIT_NAMES = tuple(Traits.__dataclass_fields__)


@functools.cache
def families() -> tuple[Family, ...]:
    """Every built-in family, in the order their spec modules sort."""
    import accutrain.core.losses as package

    found: list[Family] = []
    for module in sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.name.endswith("_spec")):
        found += importlib.import_module(f"{package.__name__}.{module}").FAMILIES
    names = [f.name for f in found]
    if len(set(names)) != len(names):
        raise RuntimeError(f"two loss families share a name: {sorted(n for n in names if names.count(n) > 1)}")
    return tuple(found)


def by_name(name: str) -> Family:
    return next(f for f in families() if f.name == name)


def family_of(node: Mapping[str, Any]) -> Optional[Family]:
    """The built-in family whose factory the node's `_target_` is (None: a plug-in)."""
    target = target_of(node)
    return next((f for f in families() if f.target and f.target == target), None)


def option(node: Mapping[str, Any]) -> str:
    """The loss as a user names it: loss=<family>, or a plug-in's `_target_`."""
    family = family_of(node)
    return f"loss={family.name}" if family is not None else f"loss._target_={target_of(node)}"


def plugin_class(node: Mapping[str, Any]) -> Optional[type]:
    """A plug-in `_target_` that is a class implementing the Loss protocol (its instances are a family), else None.
    Imports the user's module: called once the command line has checked the plug-ins' imports."""
    if family_of(node) is not None or target_of(node) in ("", "???"):
        return None
    made = load_target("loss._target_", target_of(node))
    return made if inspect.isclass(made) and implements(made) else None


def implements(made: Any) -> bool:
    """Whether `made` (a loss, or its class) has the Loss protocol's members (accutrain.core.loss)."""
    return all(callable(getattr(made, member, None)) for member in PROTOCOL)


def traits_of(node: Mapping[str, Any], plugins: bool = True) -> Traits:
    """The traits of the run's loss: its family's (for this node's values), a plug-in family's class attributes
    (with `plugins`), or a per-term loss's."""
    family = family_of(node)
    if family is not None:
        return family.traits_of(node)
    made = plugin_class(node) if plugins else None
    return declared(made) if made is not None else by_name("custom").traits


def declared(made: Any) -> Traits:
    """The traits a plug-in family's class (or its instance) declares as attributes; the others take Traits'
    defaults (a per-term loss's)."""
    return Traits(**{name: getattr(made, name) for name in TRAIT_NAMES
                     if isinstance(getattr(made, name, None), (bool, int, str))})


def counts_elements(node: Mapping[str, Any], traits: Traits, model_tokens: bool) -> bool:
    """Whether |W| counts the targets' elements (tokens), not samples: loss.normalize as given, or (auto) the
    family's terms — `model` meaning the model's default (`model_tokens`: a language model counts tokens)."""
    normalize = getattr(node.get("normalize"), "value", node.get("normalize", "auto"))
    if normalize != "auto" and normalize is not None:
        return normalize in ("elements", "tokens")
    return traits.terms == "elements" or (traits.terms == "model" and model_tokens)


def task_metrics() -> dict[str, tuple[str, ...]]:
    """What each task's evaluation measures (a family's `task` trait): trainer.monitor names one of them."""
    out: dict[str, tuple[str, ...]] = {}
    for family in families():
        out[family.traits.task] = tuple(dict.fromkeys(out.get(family.traits.task, ()) + family.metrics))
    return out


def metrics() -> tuple[str, ...]:
    """Every value trainer.monitor may take: auto, each family's metrics, and their `_ema` twins."""
    return ("auto", *dict.fromkeys(m + ema for ms in task_metrics().values() for m in ms for ema in ("", "_ema")))


def higher_is_better() -> tuple[str, ...]:
    return tuple(dict.fromkeys(m for family in families() for m in family.higher_is_better))


def schemas() -> dict[tuple[str, str], type]:
    """The families' config nodes, as config.train registers them: loss/<name>_schema."""
    return {("loss", f"{family.name}_schema"): family.schema for family in families()}
