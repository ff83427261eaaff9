"""The typed config: composes with Hydra's compose API, refuses unknown keys and wrong types by name."""
import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from accutrain.config import LastWindow, config_dir
from accutrain.errors import UserError
from accutrain.validate import validate


def test_default_config_composes_and_validates(compose):
    cfg = compose()
    validate(cfg)
    assert cfg.model.name == "resnet18" and cfg.data._target_ == "accutrain.data.digits"
    assert (cfg.micro_batch, cfg.accum, cfg.devices, cfg.global_batch) == (32, None, 1, None)
    assert cfg.trainer.last_window is LastWindow.step


@pytest.mark.parametrize("group", ["model", "data", "optim", "sched"])
def test_every_option_of_every_group_composes(compose, group):
    options = sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))
    assert options
    for option in options:
        cfg = compose(f"{group}={option}")
        assert "_target_" in cfg[group].keys(), option


def test_group_options_are_typed(compose):
    cfg = compose("model=mlp", "optim=adamw")
    assert OmegaConf.get_type(cfg.model).__name__ == "MLPModel"
    assert OmegaConf.get_type(cfg.optim).__name__ == "AdamWOptim"


@pytest.mark.parametrize("override, fragment", [
    ("model.hiden=3", "hiden"),
    ("trainer.epoks=3", "epoks"),
    ("trainer.epochs=abc", "trainer.epochs"),
    ("optim.lr=fast", "optim.lr"),
    ("trainer.last_window=sometimes", "expected one of [step, drop]"),
    ("seed=x", "seed"),
])
def test_unknown_keys_and_wrong_types_are_refused_by_name(compose, override, fragment):
    overrides = ["model=mlp", override] if override.startswith("model.") else [override]
    with pytest.raises(ConfigCompositionException) as info:
        compose(*overrides)
    assert fragment in str(info.value) + str(info.value.__cause__)


@pytest.mark.parametrize("overrides, message", [
    (["micro_batch=0"], "micro_batch=0 is not valid: expected a positive integer"),
    (["micro_batch=abc"], "micro_batch='abc' is not valid"),
    (["micro_batch=8.5"], "micro_batch=8.5 is not valid"),
    (["accum=-1"], "accum=-1 is not valid: expected a positive integer or null"),
    (["accum=true"], "accum=True is not valid"),
    (["global_batch=0"], "global_batch=0 is not valid"),
    (["devices=0"], "devices=0 is not valid: expected a positive integer or auto"),
    (["trainer.epochs=null"], "set trainer.epochs or trainer.max_steps"),
    (["trainer.max_steps=0"], "trainer.max_steps=0 is not valid"),
    (["trainer.grad_clip=0"], "trainer.grad_clip=0.0 is not valid"),
    (["optim.lr=0"], "optim.lr=0.0 is not valid"),
    (["model=torchvision"], "model.name must be set"),
    (["data=imagefolder"], "data.root must be set"),
])
def test_values_a_type_cannot_check(compose, overrides, message):
    with pytest.raises(UserError) as info:
        validate(compose(*overrides))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_synthetic_seed_follows_the_run_seed_unless_set(compose):
    assert compose("data=synthetic", "seed=7").data.seed == 7
    assert compose("data=synthetic", "seed=7", "data.seed=3").data.seed == 3
