"""Hydra's private API that the command line uses (accutrain.cli.hydra_internals), checked against the installed
Hydra: a release that moves or changes one of them fails here, naming the function, not somewhere in a user's run."""
import inspect
from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser

import accutrain
from accutrain.cli import hydra_internals
from accutrain.config.train import config_dir, register_schemas

# What accutrain.cli.command reads of the parsed command line.
ARGS = ("cfg", "config_dir", "config_name", "config_path", "experimental_rerun", "help", "hydra_help", "info",
        "multirun", "overrides", "shell_completion")


def fenced(name, check):
    """Run `check`; any failure names the fenced function and the Hydra it ran against."""
    import hydra

    try:
        check()
    except Exception as e:  # noqa: BLE001 - every kind of breakage is reported the same way
        pytest.fail(f"accutrain.cli.hydra_internals.{name} no longer works with hydra-core {hydra.__version__}: "
                    f"{type(e).__name__}: {e}")


@pytest.fixture
def hydra():
    register_schemas()
    instance = hydra_internals.main_hydra("train", str(config_dir()))
    yield instance
    GlobalHydra.instance().clear()


def test_args_parser_reads_the_command_line_as_hydra_main_does():
    def check():
        args = hydra_internals.args_parser().parse_args(["-m", "--config-dir", "x", "accum=1,2"])
        missing = [a for a in ARGS if not hasattr(args, a)]
        assert not missing, f"the parsed command line lacks {missing}"
        assert args.multirun and args.config_dir == "x" and args.overrides == ["accum=1,2"]

    fenced("args_parser", check)


def test_main_hydra_composes_and_lists_as_the_run_will(hydra):
    from hydra.types import RunMode

    def check():
        params = inspect.signature(hydra.compose_config).parameters
        for name in ("config_name", "overrides", "run_mode", "from_shell", "with_log_configuration"):
            assert name in params, f"Hydra.compose_config takes no {name}"
        cfg = hydra.compose_config("train", ["accum=2"], run_mode=RunMode.RUN, from_shell=True,
                                   with_log_configuration=False)
        assert cfg.accum == 2 and cfg.hydra.runtime.choices["model"] == "resnet18"
        loader = hydra.config_loader
        assert "model" in loader.list_groups("") and "mlp" in loader.get_group_options("model")
        assert loader.load_sweep_config(cfg, ["accum=4"]).accum == 4

    fenced("main_hydra", check)


def test_sweep_jobs_split_a_sweep_as_the_basic_sweeper_does(hydra):
    def check():
        parsed = OverridesParser.create(config_loader=hydra.config_loader).parse_overrides(["accum=1,2", "seed=0,1"])
        jobs = hydra_internals.sweep_jobs(parsed)
        assert sorted(map(sorted, jobs)) == sorted(map(sorted, [["accum=1", "seed=0"], ["accum=1", "seed=1"],
                                                                  ["accum=2", "seed=0"], ["accum=2", "seed=1"]]))

    fenced("sweep_jobs", check)


@pytest.mark.parametrize("overrides", [["accum=2"], ["accum=2", "hydra.mode=MULTIRUN"]])
def test_known_mode_answers_what_get_mode_would_compose(hydra, overrides):
    """Hydra.get_mode composes the config only to read hydra.mode: the checks' composition gives the same value."""
    from hydra.types import RunMode

    def check():
        assert list(inspect.signature(type(hydra).get_mode).parameters) == ["self", "config_name", "overrides"]
        mode = hydra.compose_config("train", overrides, run_mode=RunMode.RUN, from_shell=True).hydra.mode
        assert hydra.get_mode("train", overrides) == mode
        with hydra_internals.known_mode(mode):
            assert hydra.get_mode("train", ["no_such_key=1"]) == mode  # answered, not composed
        assert hydra.get_mode("train", ["no_such_key=1"]) is None  # the real one again (its composition fails)

    fenced("known_mode", check)


def test_only_the_fence_imports_hydras_private_modules():
    package = Path(accutrain.__file__).parent
    users = sorted(str(p.relative_to(package)) for p in package.rglob("*.py") if "hydra._internal" in p.read_text())
    assert users == ["cli/hydra_internals.py"]
