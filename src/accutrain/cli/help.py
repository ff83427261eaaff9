"""`accutrain --help` (the usage, examples, every config group's options and the composed config) and
`accutrain-check --help` (its own flags and usage, short)."""
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



CHECK_HELP = """usage: {prog} [--show-sample[=N]] [key=value ...]

  --show-sample[=N]   print training sample N (0 without a value) with the tokens the loss counts marked, and
                      a truncated record's cut; no model is built, no check is run
  -h, --help          this help; --version: accutrain's version

{prog} {version}: is the run's gradient accumulation exact? It builds the run `accutrain key=value ...` would
train, computes its first window's gradient accumulated (micro_batch × accum × devices) and as one batch, and
prints the difference per parameter group with a verdict and the causes it finds (BatchNorm, dropout, a loss that
is not the window's mean). It writes nothing. Exit code 0: faithful; 1: not; 2: a mistake in the command.

examples:
  {prog} micro_batch=8 accum=4 batchnorm.convert=group    resnet18 with GroupNorm: faithful, exit code 0
  {prog} data=hf data.train=examples/chat.jsonl --show-sample=2

It takes every key accutrain takes: accutrain --help lists the config groups and the config."""


def print_check_help(prog: str) -> None:
    """accutrain-check's own help, its flags first."""
    try:
        print(CHECK_HELP.format(prog=prog, version=__version__))
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
