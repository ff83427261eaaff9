"""The run as the command line decided it: the composed config turned once into typed, frozen objects — the
schemas' dataclasses, and each factory node (model, data, optim, sched, loss, each logger) a `Factory` — which is all
that the layers below the command line read. Nothing changes it: the arguments a run supplies to its factories
(data-derived sizes, data.seed, sched.total_steps) are a record of their own (`Supplied`), written beside it into
config.yaml (accutrain.config.record).

A frozen object refuses assignment (dataclasses.FrozenInstanceError); its lists are tuples and its mappings
read-only, so that the run a rank builds from is the run the command line checked."""
from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

from accutrain.config.train import GROUP_NODES, TrainConfig
from accutrain.errors import UserError

if TYPE_CHECKING:
    from omegaconf import DictConfig

Supplied = dict[str, dict[str, Any]]  # node (data, model, sched) → the arguments the run supplied to its factory


@dataclass(frozen=True)
class Factory:
    """A factory node: `_target_` and its keyword arguments, what hydra.utils.instantiate calls."""

    target: str
    arguments: Mapping[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.arguments.get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.arguments[key]

    def __contains__(self, key: str) -> bool:
        return key in self.arguments

    def node(self, supplied: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
        """The node as plain data, `_target_` first (with the arguments a run supplied), for instantiate or yaml."""
        return {"_target_": self.target, **thaw(dict(self.arguments)), **thaw(dict(supplied or {}))}


def typed(cfg: DictConfig) -> TrainConfig:
    """The composed task config (without `hydra`, every value set and resolvable) as a frozen TrainConfig."""
    from omegaconf import OmegaConf  # (here: the typed run's readers below the command line never load it)

    nodes = {name: factory(name, cfg[name]) for name in GROUP_NODES if name not in ("strategy", "logger")}
    loggers = {key: factory(f"logger.{key}", node) for key, node in (cfg.get("logger") or {}).items()}
    made = OmegaConf.to_object(cfg)
    for name, node in nodes.items():
        setattr(made, name, node)
    made.logger = loggers
    return seal(made)


def factory(key: str, node: Any) -> Factory:
    """A factory node as composed — every key it holds, a plug-in's own included — as a Factory."""
    from omegaconf import DictConfig, OmegaConf

    values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else None
    if not isinstance(values, dict) or not isinstance(values.get("_target_"), str):
        raise UserError(f"{key} is not a {'tracker' if key.startswith('logger.') else 'factory'}: expected "
                        f"{key}._target_=module.Class" + (f" (or logger={key[7:]} for a built-in one)"
                                                          if key.startswith("logger.") else ""))
    target = values.pop("_target_")
    return Factory(target, values)


class FrozenDict(dict):
    """A mapping that refuses changes (and pickles, unlike a mappingproxy: spawned ranks receive the run)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("the run's config is frozen (accutrain.config.typed): this mapping cannot change")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse  # type: ignore

    def __reduce__(self) -> tuple[Any, ...]:
        return FrozenDict, (dict(self),)


SEALED = "_sealed_"  # set in a sealed dataclass instance's __dict__


def seal(value: Any) -> Any:
    """`value` frozen in place, all the way down: dataclasses refuse assignment, lists become tuples, mappings
    FrozenDicts."""
    if isinstance(value, Factory):
        return Factory(value.target, seal(value.arguments))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if value.__dict__.get(SEALED):
            return value
        for f in dataclasses.fields(value):
            object.__setattr__(value, f.name, seal(getattr(value, f.name)))
        if not type(value).__dataclass_params__.frozen:
            object.__setattr__(value, "__class__", sealed_class(type(value)))
            value.__dict__[SEALED] = True
        return value
    if isinstance(value, (list, tuple)):
        return tuple(seal(v) for v in value)
    if isinstance(value, Mapping):
        return FrozenDict({k: seal(v) for k, v in value.items()})
    return value


def resealed(cls: type, fields: dict[str, Any]) -> Any:
    """A sealed `cls` made from its fields again (how a sealed instance unpickles)."""
    return seal(cls(**fields))


@functools.cache
def sealed_class(cls: type) -> type:
    """`cls` refusing assignment and deletion once sealed (a schema stays a plain dataclass for Hydra to compose;
    dataclasses.replace makes an unsealed copy)."""
    def refuse(self: Any, name: str, *value: Any) -> None:
        if self.__dict__.get(SEALED):
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}: the run's config is frozen "
                                                  "(accutrain.config.typed)")
        (object.__setattr__(self, name, *value) if value else object.__delattr__(self, name))

    def reduce(self: Any) -> tuple[Any, ...]:
        return resealed, (cls, {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init})

    return type(cls.__name__, (cls,), {"__setattr__": refuse, "__delattr__": refuse, "__reduce__": reduce,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def thaw(value: Any) -> Any:
    """Plain data (dicts, lists, strings, numbers) of a typed value: enums by value, factories as nodes."""
    if isinstance(value, Factory):
        return value.node()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: thaw(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    return value


def with_supplied(cfg: TrainConfig, supplied: Supplied) -> dict[str, Any]:
    """The run's config as plain data, each factory node holding the arguments the run supplied to it."""
    plain = thaw(cfg)
    for node, arguments in supplied.items():
        plain[node] = {**plain[node], **thaw(arguments)}
    return plain


def to_yaml(cfg: TrainConfig, supplied: Supplied) -> str:
    """config.yaml: the run's config with the arguments it supplied in their nodes (hydra.utils.instantiate rebuilds
    each part from it alone), and those arguments again under `supplied` — what the run added to the command's
    config (.hydra/config.yaml): instantiate(hydra_cfg.model, **supplied.model) builds the same model."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create({**with_supplied(cfg, supplied), "supplied": thaw(supplied)}))
