"""What the command line takes from Hydra's private modules (`hydra._internal`, hydra-core 1.3), in one place: the
argument parser, the config search path and the Hydra instance that `hydra.main` makes, and the basic sweeper's
split of a sweep into jobs — so that the checks before Hydra runs compose exactly what Hydra will.
tests/config/test_hydra_internals.py fails, naming the function, when a Hydra release moves or changes one of them."""
from __future__ import annotations

from argparse import ArgumentParser
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional


def args_parser() -> ArgumentParser:
    """The parser `hydra.main` applies to the command line (--multirun, --config-dir, --cfg, overrides, …)."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def main_hydra(task_name: str, primary_config_dir: str, extra_dir: str | None = None) -> Any:
    """A Hydra instance over `primary_config_dir` (and --config-dir's `extra_dir` before it), as `hydra.main` sets it
    up; its `compose_config` and `config_loader` compose as the run will. GlobalHydra must be cleared after use."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery

    search_path = create_config_search_path(f"file://{primary_config_dir}")
    if extra_dir is not None:
        search_path.prepend(provider="command-line", path=f"file://{extra_dir}",
                            anchor=SearchPathQuery(provider="schema"))
    return Hydra.create_main_hydra2(task_name=task_name, config_search_path=search_path)


@contextmanager
def known_mode(mode: Any) -> Iterator[None]:
    """While Hydra runs: its `Hydra.get_mode`, which composes the whole config once more only to read `hydra.mode`,
    answers `mode` — the value the checks read from their composition of the same command line (a third of a short
    run's start-up time)."""
    from hydra._internal.hydra import Hydra

    original = Hydra.get_mode
    Hydra.get_mode = lambda self, config_name, overrides: mode
    try:
        yield
    finally:
        Hydra.get_mode = original


def sweep_jobs(parsed_overrides: list[Any]) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper makes them from parsed sweep overrides (one batch: all jobs)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return [list(job) for job in BasicSweeper.split_arguments(parsed_overrides, None)[0]]


def run(argv: list[str], task: Callable[[Any], Any], config_path: str, config_name: str,
        mode: Optional[tuple[Any]] = None) -> None:
    """What `hydra.main` does with a command line, for `argv` (not sys.argv) and `task` (a closure holding what the
    command line decided): --experimental-rerun, or Hydra's run of the job (a sweep's jobs); `mode`, where the
    checks read it — `(hydra.mode,)` — spares Hydra a composition (known_mode)."""
    from hydra import version
    from hydra._internal.utils import _run_hydra, get_args_parser
    from hydra.main import _get_rerun_conf

    version.setbase("1.3")
    parser = get_args_parser()
    args = parser.parse_args(argv)
    if args.experimental_rerun is not None:
        task(_get_rerun_conf(args.experimental_rerun, args.overrides))
        return
    with known_mode(mode[0]) if mode is not None else nullcontext():
        _run_hydra(args=args, args_parser=parser, task_function=task, config_path=config_path,
                   config_name=config_name)
