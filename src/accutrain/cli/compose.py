"""Composing the command line's config before Hydra runs anything, as Hydra will compose it: Hydra's own parser,
config search path, config loader and basic sweeper (the private ones through accutrain.cli.hydra_internals), so that
both compositions agree (hydra-core 1.3); a composition error, or a key no schema knows, is one line."""
from __future__ import annotations

import copy
import os
from argparse import Namespace
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from accutrain.cli import hydra_internals
from accutrain.config.messages import explain, override_key, refuse_unknown_keys
from accutrain.config.train import GROUP_NODES, config_dir, register_schemas
from accutrain.errors import UserError

CONFIG_NAME = "train"


def expand_home(argv: list[str]) -> list[str]:
    """`key=~/data` → `key=/home/me/data`, as the shell does for `~` at the start of a word: bash leaves it alone
    after `data.root=` (not a shell variable name), and Hydra's override grammar rejects it."""
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and not arg.startswith("-") and value.startswith("~"):
            value = ",".join(os.path.expanduser(v) if v.startswith("~") else v for v in value.split(","))
        out.append(f"{key}{eq}{value}")
    return out


def parse(argv: list[str]) -> Namespace:
    return hydra_internals.args_parser().parse_args(argv)


@contextmanager
def hydra_instance(args: Namespace) -> Iterator[Any]:
    """Hydra's config loader over accutrain's configs (plus --config-dir), as `hydra.main` sets it up."""
    from hydra.core.global_hydra import GlobalHydra

    register_schemas()
    extra = None
    if args.config_dir is not None:
        extra = os.path.abspath(args.config_dir)
        if not os.path.isdir(extra):
            raise UserError(f"--config-dir {args.config_dir}: no such directory")
    hydra = hydra_internals.main_hydra(CONFIG_NAME, str(config_dir()), extra)
    try:
        yield hydra
    finally:
        GlobalHydra.instance().clear()


def group_choices(hydra: Any, overrides: list[str]) -> dict[str, Optional[str]]:
    """The option of each group these overrides select (for messages; empty when even that does not compose)."""
    from hydra.types import RunMode

    groups = set(hydra.config_loader.list_groups(""))
    chosen = [o for o in overrides if override_key(o) in groups and "," not in o]
    try:
        cfg = hydra.compose_config(CONFIG_NAME, chosen, run_mode=RunMode.RUN, with_log_configuration=False)
        return dict(cfg.hydra.runtime.choices)
    except Exception:
        return {}


def compose(hydra: Any, args: Namespace, overrides: list[str], multirun: bool = False) -> DictConfig:
    """The config Hydra will compose (with its `hydra` node); a composition error is one line."""
    from hydra.errors import HydraException
    from hydra.types import RunMode
    from omegaconf.errors import OmegaConfBaseException

    mode = RunMode.MULTIRUN if multirun else RunMode.RUN
    try:
        return hydra.compose_config(args.config_name or CONFIG_NAME, overrides, run_mode=mode, from_shell=True,
                                    with_log_configuration=False)
    except (HydraException, OmegaConfBaseException) as e:
        message = explain(e, overrides, group_choices(hydra, overrides))
        swept = [o for o in overrides if "," in o and override_key(o) in GROUP_NODES and " has no key " in message
                 and message.startswith(f"{override_key(o)}.")]
        if multirun and swept:  # Hydra composes the sweep's base config with the group's default option first
            key = message.split(":", 1)[0]
            message += (f" (a sweep over {swept[0]} starts from the default option: ++{key} sets the key in the jobs "
                        "whose option has it)")
        raise UserError(message) from None


def job_configs(hydra: Any, base: DictConfig) -> Iterator[tuple[int, list[str], DictConfig]]:
    """(job number, its overrides, its config) for each job of a multirun, as Hydra's basic sweeper will make them;
    nothing for another sweeper."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if not str(base.hydra.sweeper.get("_target_", "")).endswith(".BasicSweeper"):
        return
    params = [f"{k}={v}" for k, v in (base.hydra.sweeper.get("params") or {}).items()]
    arguments = params + list(base.hydra.overrides.task)
    try:
        parsed = OverridesParser.create(config_loader=hydra.config_loader).parse_overrides(arguments)
        jobs = hydra_internals.sweep_jobs(parsed)
    except (HydraException, OmegaConfBaseException) as e:
        raise UserError(explain(e, arguments, group_choices(hydra, arguments))) from None
    for num, overrides in enumerate(jobs):
        try:
            cfg = hydra.config_loader.load_sweep_config(base, list(overrides))
        except (HydraException, OmegaConfBaseException) as e:
            raise UserError(explain(e, list(overrides), group_choices(hydra, list(overrides)))) from None
        with open_dict(cfg):
            cfg.hydra.job.num = cfg.hydra.job.id = num
        yield num, list(overrides), cfg


def task_config(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """The config the task receives (without `hydra`), every key known to its schema and every value resolvable."""
    from omegaconf.errors import OmegaConfBaseException

    if error := refuse_unknown_keys(cfg, overrides):
        raise UserError(error)
    task = copy.deepcopy(cfg)
    with read_write(task), open_dict(task):
        del task["hydra"]
    try:
        OmegaConf.to_container(task, resolve=True)
    except OmegaConfBaseException as e:
        raise UserError(explain(e, overrides, dict(cfg.hydra.runtime.choices))) from None
    return task
