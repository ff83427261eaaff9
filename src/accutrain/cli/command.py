"""The command line before Hydra runs anything: `~` in values, --version and --help, and every config the command
would run composed and checked here — a composition error, a key no schema knows, a bad value, a run directory an
earlier run used or one that cannot be written end in one line (UserError) before anything is written.

Hydra composes again when it runs: this module uses Hydra's own parser, config search path, config loader and basic
sweeper (the private ones through accutrain.cli.hydra_internals), so that both compositions agree (hydra-core 1.3).
"""
from __future__ import annotations

import copy
import os
import re
import sys
from argparse import Namespace
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from accutrain import __version__
from accutrain.cli import hydra_internals, recorded
from accutrain.config.messages import explain, override_key, refuse_unknown_keys
from accutrain.config.train import GROUP_NODES, config_dir, register_schemas
from accutrain.config.validate import validate
from accutrain.errors import UserError
from accutrain.store import owned, record, rundir

CONFIG_NAME = "train"
SCHEMA_SUFFIX = "_schema"
# The device and ranks check_run placed a single run on: the run Hydra starts next in this process trusts them and
# the values checked with them (launch.train's `ranks`). None for a sweep, whose jobs are checked as they run.
checked: Optional[Any] = None
# Hydra's record (.hydra/) of each run directory that holds an earlier run this command continues, as it was before
# Hydra writes over it: put back when the command changes nothing (accutrain.store.status.recorded). By absolute path.
earlier_records: dict[str, record.Files] = {}
# The `hydra.mode` of the command line's composition, as a 1-tuple once check() has composed it (Hydra then need not
# compose it again to read it: hydra_internals.known_mode).
mode: Optional[tuple[Any]] = None


def keep_hydra_record(run_dir: Path, cfg: DictConfig) -> None:
    """Remember Hydra's record of the earlier run in run_dir before Hydra writes over it."""
    subdir = cfg.hydra.output_subdir
    earlier_records[os.path.abspath(run_dir)] = record.hydra_record(run_dir, None if subdir is None else str(subdir))


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


def make_output_dir(path: Path, key: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the output directory {path} ({key}): {e.strerror or e}") from None


SAFE_PATH = re.compile(r"[\w./:+-]+")


def output_dir(cfg: DictConfig, mode: str, pins: list[str]) -> Path:
    """hydra.<mode>.dir as it resolves now. One computed from interpolations (the default's ${now:…}) is pinned:
    `hydra.<mode>.dir=<it>` is added to `pins`, for the command line Hydra runs, so that Hydra, resolving it again a
    second later, uses the very directory checked here."""
    raw = str(OmegaConf.to_container(cfg.hydra[mode], resolve=False)["dir"])
    value = str(cfg.hydra[mode].dir)
    owned.refuse_empty(value, f"hydra.{mode}.dir")
    if "${" in raw and SAFE_PATH.fullmatch(value):
        pins.append(f"hydra.{mode}.dir={value}")
    return Path(value).expanduser()


def check_run(cfg: DictConfig, task: DictConfig, decide: bool, pins: list[str]) -> None:
    """A single run: the values (validate), the device and the ranks (launch.place), and — in the process that
    decides — its run directory: not an earlier run's (unless continued or replaced), writable, its log file too."""
    if decide:
        run_dir = output_dir(cfg, "run", pins)
        owned.refuse_foreign(run_dir, "hydra.run.dir")
        if run_dir.is_dir() and rundir.check_reuse(run_dir, task):
            keep_hydra_record(run_dir, cfg)
        owned.check_tracker_paths(run_dir, task)
    global checked
    validate(task)  # the values, before PyTorch is imported (seconds): a mistake in one is answered at once
    from accutrain.run.launch import place

    checked = place(task)
    if not decide:
        return
    make_output_dir(run_dir, "hydra.run.dir")
    has_log = OmegaConf.select(cfg, "hydra.job_logging.handlers.file") is not None
    rundir.check_writable(run_dir, run_dir / f"{cfg.hydra.job.name}.log" if has_log else None)
    if cfg.hydra.output_subdir is not None:
        rundir.writable(run_dir / str(cfg.hydra.output_subdir), "Hydra's record of the config")


def check_sweep(hydra: Any, base: DictConfig, decide: bool, pins: list[str]) -> None:
    """A multirun: every job composes with known keys (its values are checked when it runs: a job failing is
    recorded and the sweep goes on); the sweep directory can be written and holds no earlier sweep's runs unless
    they are continued (resume=auto) or replaced (trainer.overwrite=true)."""
    sweep_dir = output_dir(base, "sweep", pins) if decide else Path(str(base.hydra.sweep.dir)).expanduser()
    earlier = []
    for _, overrides, cfg in job_configs(hydra, base):
        task = task_config(cfg, overrides)
        job_dir = sweep_dir / str(cfg.hydra.sweep.subdir)
        if decide:
            owned.check_tracker_paths(job_dir, task)
        if not decide or not job_dir.is_dir():
            continue
        owned.refuse_foreign(job_dir, "hydra.sweep.dir")
        if rundir.earlier_run(job_dir) and task.resume is None and not task.trainer.overwrite:
            earlier.append(job_dir.name)
        elif rundir.check_reuse(job_dir, task, "hydra.sweep.dir"):
            keep_hydra_record(job_dir, cfg)
    if earlier:
        jobs = ", ".join(earlier[:8]) + (", …" if len(earlier) > 8 else "")
        raise UserError(f"{sweep_dir} (hydra.sweep.dir) holds the runs of an earlier sweep (jobs {jobs}): add "
                        "resume=auto to continue them, trainer.overwrite=true to delete them and start afresh, or "
                        "choose a new hydra.sweep.dir")
    if decide:
        make_output_dir(sweep_dir, "hydra.sweep.dir")
        rundir.writable(sweep_dir, "the sweep's jobs")


def check(argv: list[str], *, decide: bool = True, run: bool = True, prog: str = "accutrain") -> list[str]:
    """Check the command `prog argv` before Hydra runs it; print --version or --help and exit. decide: this process
    decides about the run directory (not torchrun's other ranks); run: the command trains (not accutrain-check).
    Returns the overrides to add for Hydra to use the output directory checked here. Raises UserError."""
    global checked, mode
    checked, mode = None, None
    earlier_records.clear()
    if "--version" in argv:
        print(f"{prog} {__version__}")
        sys.exit(0)
    args = parse(argv)
    pins: list[str] = recorded.carry(args, prog if decide else None) if run else []  # resume=auto: the run's own
    if args.config_path is not None or args.experimental_rerun is not None or args.hydra_help:
        return pins  # Hydra's own business
    with hydra_instance(args) as hydra:
        if args.help:
            print_help(hydra, args, prog)
            sys.exit(0)
        multirun = args.multirun and run
        base = compose(hydra, args, list(args.overrides), multirun)
        if args.info or args.shell_completion:
            return pins  # Hydra prints something and runs nothing
        mode = (base.hydra.mode,)
        if multirun:
            check_sweep(hydra, base, decide, pins)
        else:
            task = task_config(base, list(args.overrides))  # --cfg prints the config: one with a typo is refused
            if run and not args.cfg:
                check_run(base, task, decide, pins)
    return pins


def group_options(hydra: Any) -> dict[str, list[str]]:
    """Each config group's options (the schemas they build on are not options)."""
    loader = hydra.config_loader
    return {group: [o for o in loader.get_group_options(group) if not o.endswith(SCHEMA_SUFFIX)]
            for group in sorted(loader.list_groups("")) if group != "hydra"}


HELP = """{prog} {version}: a PyTorch trainer whose gradient accumulation is exactly the big batch's step.

usage:
  {prog} [key=value ...]               train; outputs in outputs/<date>/<time>/ (or hydra.run.dir=DIR)
  {prog} -m key=a,b [key=value ...]    a sweep: one run per combination, in multirun/<date>/<time>/<job>/
  {prog} --cfg job [key=value ...]     print the composed config and exit
  {prog} --version                     accutrain's version; --hydra-help: Hydra's own flags

examples:
  {prog} micro_batch=8 accum=4         effective batch 32 = micro_batch 8 × accum 4 × devices 1
  {prog} micro_batch=4 global_batch=32 accum derived: 8
  {prog} debug=fast                    a run of a few seconds on the CPU
  {prog} resume=auto hydra.run.dir=runs/long   continue a run from its newest good checkpoint

config groups (group=option{experiment}):
{groups}

the config (set any key: trainer.epochs=10; keys of your own model or data: model=custom +model.depth=4):
{config}
see also: accutrain-check [key=value ...] (is the accumulation exact? --show-sample[=N]: which tokens of a
training sample the loss counts), accutrain-report DIR (summaries)"""


def print_help(hydra: Any, args: Namespace, prog: str) -> None:
    cfg = compose(hydra, args, list(args.overrides))
    task = task_config(cfg, list(args.overrides))
    options = group_options(hydra)
    groups = "\n".join(f"  {group}: {', '.join(names)}" for group, names in options.items() if names)
    extra = "; +experiment=NAME for an experiment" if "experiment" in options else ""
    text = HELP.format(prog=prog, version=__version__, groups=groups, config=OmegaConf.to_yaml(task),
                       experiment=extra)
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `accutrain --help | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

