"""`accutrain --help`: the usage, examples, every config group's options and the composed config."""
from __future__ import annotations

import os
import sys
from argparse import Namespace
from typing import Any

from omegaconf import OmegaConf

from accutrain import __version__
from accutrain.cli.compose import compose, task_config

SCHEMA_SUFFIX = "_schema"


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

