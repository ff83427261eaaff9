"""Config mistakes in one line: Hydra's and OmegaConf's composition errors explained (the key, the value, what is
valid), and keys that no schema knows refused — a `+trainer.epoch=3` typo would otherwise be accepted and ignored —
except in plug-ins of the user's own (model=custom, data=custom), whose keys are its keyword arguments."""
from __future__ import annotations

import dataclasses
import difflib
import enum
import re
import typing
from typing import Any, Iterator, Optional

from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from accutrain.config.renames import RENAMED, notice
from accutrain.config.train import GROUP_NODES, config_dir

GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def override_key(override: str) -> str:
    """`+trainer.epoch=3` → trainer.epoch; `model=mlp` → model."""
    return override.split("=", 1)[0].lstrip("+~")


def as_typed(full_key: str, overrides: list[str]) -> Optional[str]:
    """The override of `full_key` as the user typed it, if there is one."""
    return next((o for o in reversed(overrides) if override_key(o) == full_key), None)


def schema_keys(kind: Any) -> Optional[list[str]]:
    """A structured node's keys (its dataclass fields but `_target_`); None for a plain dict (a plug-in's own keys)."""
    if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
        return None
    return [f.name for f in dataclasses.fields(kind) if f.name != "_target_"]


def describe_type(hint: Any) -> str:
    """What a value of this annotation looks like on the command line."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union:
        inner = " or ".join(describe_type(a) for a in args)
        return f"{inner} or null" if len(args) < len(typing.get_args(hint)) else inner
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(member.name for member in hint)
    if typing.get_origin(hint) in (list, typing.List):
        return f"a list of {describe_type(args[0]).replace('an ', '').replace('a ', '')}s, e.g. [a,b]" if args \
            else "a list, e.g. [a,b]"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(hint, "a value of the right type")


def field_type(kind: Any, key: Any) -> Any:
    try:
        return typing.get_type_hints(kind)[key]
    except Exception:  # not a dataclass, or an annotation that cannot be evaluated here
        return Any


def node_name(path: str, choices: dict[str, Optional[str]]) -> str:
    """How a message names a node: `model=resnet18` for a group's option, `trainer`, or `the config` (the top)."""
    if path in GROUP_NODES and choices.get(path):
        return f"{path}={choices[path]}"
    return path or "the config"


def unknown_key(shown: str, full_key: str, known: list[str], choices: dict[str, Optional[str]]) -> str:
    if full_key in RENAMED:  # an old spelling in a yaml file (the command line's are rewritten before composing)
        return f"{shown}: {notice(full_key)}"
    path, _, key = full_key.rpartition(".")
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f" (did you mean {'.'.join(filter(None, [path, close[0]]))}?)" if close else ""
    own = (f"; keys of your own need {path}=custom" if path in GROUP_NODES and (config_dir() / path / "custom.yaml")
           .is_file() else "")
    if path == "model" and key in ("adapter", "lora", "quantize"):  # the Hugging Face models' keys only
        return (f"{shown}: adapters and quantization are for the Hugging Face models (model=hf_causal_lm, "
                f"model=hf_seq_cls or model=hf_encoder); {node_name(path, choices)} has no key {key!r}")
    return f"{shown}: {node_name(path, choices)} has no key {key!r}{hint}; its keys are: {', '.join(known)}{own}"


def extra_keys(node: DictConfig, path: str = "") -> Iterator[tuple[str, list[str]]]:
    """(full key, the node's known keys) for each key of a structured node that its schema does not have; the
    `hydra` node is Hydra's."""
    known = schema_keys(OmegaConf.get_type(node))
    for key in node.keys():
        full = f"{path}.{key}" if path else str(key)
        if full == "hydra":
            continue
        if known is not None and key not in known and key != "_target_":
            yield full, known
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            yield from extra_keys(child, full)


def refuse_unknown_keys(cfg: DictConfig, overrides: list[str]) -> Optional[str]:
    """The one-line error for the first key no schema knows (added with `+` or in a config file), or None."""
    choices = dict(OmegaConf.select(cfg, "hydra.runtime.choices", default={}) or {})
    for full_key, known in extra_keys(cfg):
        shown = as_typed(full_key, overrides) or f"{full_key} (set in a config file)"
        return unknown_key(shown, full_key, known, choices)
    return None


def explain(error: Exception, overrides: list[str], choices: dict[str, Optional[str]]) -> str:
    """Hydra's (or OmegaConf's) composition error as one line naming the override, the key and what is valid."""
    if isinstance(error, MissingConfigException) and error.missing_cfg_file and "/" in error.missing_cfg_file:
        group, _, name = error.missing_cfg_file.rpartition("/")
        options = [o for o in (error.options or []) if not o.endswith("_schema")]
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
        hint = f" (did you mean {group}={close[0]}?)" if close else ""
        shown = as_typed(group, overrides) or f"{group}={name}"
        return f"{shown}: {group} has no option {name!r}{hint}; the options are: {', '.join(options)}"
    if isinstance(error, OverrideParseException):
        reason = error.message.strip().splitlines()[0]
        return (f"cannot read the override {error.override!r} ({reason}): quote a value with special characters "
                f"for Hydra, e.g. 'key=\"a value\"' (see {GRAMMAR})")
    cause = error if isinstance(error, OmegaConfBaseException) else error.__cause__
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:
        return explain_value(cause, overrides, choices)
    text = str(error).strip()
    if text.startswith("Ambiguous value for argument"):
        arg = text.split("'")[1]
        return (f"{arg} gives several values: add -m to run one job per value (a sweep), or write "
                f"{arg.split('=')[0]}=[{arg.split('=', 1)[1]}] for a list")
    moved = re.search(r"full_key: ([\w.]+)", text)
    if moved and moved.group(1) in RENAMED:  # an old spelling in a yaml file of the user's
        where = re.match(r"In '([^']+)'", text)
        return f"{moved.group(1)}" + (f" (in {where.group(1)})" if where else "") + f": {notice(moved.group(1))}"
    lines = text.split("\nConfig search path")[0].replace("\nSee https", "\nsee https").splitlines()
    return "; ".join(line.strip() for line in lines if line.strip())


def explain_value(cause: OmegaConfBaseException, overrides: list[str], choices: dict[str, Optional[str]]) -> str:
    full_key, kind = str(cause.full_key), cause.object_type
    shown = as_typed(full_key, overrides)
    known = schema_keys(kind)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        if known is not None:
            return unknown_key(shown or full_key, full_key, known, choices)
        path, _, key = full_key.rpartition(".")
        value = shown.split("=", 1)[1] if shown and "=" in shown else "…"
        return (f"{shown or full_key}: {node_name(path, choices)} has no key {key!r} yet: add it with "
                f"+{full_key}={value}")
    if isinstance(cause, ValidationError):
        hint = field_type(kind, cause.key)
        if schema_keys(hint) is not None:
            return f"{shown or full_key}: {full_key} is a group of keys ({full_key}.<key>=value), not a value"
        value = shown.split("=", 1)[1] if shown else cause.value
        return f"{full_key}={value} is not valid: expected {describe_type(hint)}"
    message = (str(cause.msg).strip().splitlines() or [type(cause).__name__])[0]
    return f"{shown or full_key}: {message}"
