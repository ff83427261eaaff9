"""The typed config: composes with Hydra's compose API, refuses unknown keys and wrong types by name."""
import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from accutrain.cli.command import check
from accutrain.cli.compose import expand_home
from accutrain.config.train import config_dir
from accutrain.config.validate import validate
from accutrain.core.options import LastWindow
from accutrain.errors import UserError, one_line


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
    (["micro_batch=10000000000000000000000"], "expected a positive integer or auto, at most 9223372036854775807"),
    (["trainer.max_steps=10000000000000000000000"], "trainer.max_steps=10000000000000000000000 is not valid"),
    (["resume=auto", "trainer.overwrite=true"], "resume=auto cannot be combined with trainer.overwrite=true"),
])
def test_values_a_type_cannot_check(compose, overrides, message):
    with pytest.raises(UserError) as info:
        validate(compose(*overrides))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_synthetic_seed_follows_the_run_seed_unless_set(compose):
    assert compose("data=synthetic", "seed=7").data.seed == 7
    assert compose("data=synthetic", "seed=7", "data.seed=3").data.seed == 3


@pytest.mark.parametrize("argv, fragments", [
    (["foo=1"], ["foo=1: the config has no key 'foo'; its keys are: model, data,", "micro_batch"]),
    (["model.foo=1"], ["model.foo=1: model=resnet18 has no key 'foo'", "pretrained",
                       "keys of your own need model=custom"]),
    (["trainer.epochs=abc"], ["trainer.epochs=abc is not valid: expected an integer or null"]),
    (["trainer.last_window=keep"], ["trainer.last_window=keep is not valid: expected one of step, drop"]),
    (["scaling.lr=cubic"], ["scaling.lr=cubic is not valid: expected one of none, linear, sqrt"]),
    (["model=nosuch"], ["model=nosuch: model has no option 'nosuch'; the options are: char_lm, cnn,", "custom"]),
    (["+trainer.epoch=3"], ["+trainer.epoch=3: trainer has no key 'epoch' (did you mean trainer.epochs?)"]),
    (["+loss.normalise=tokens"], ["+loss.normalise=tokens: loss=cross_entropy has no key 'normalise'",
                                  "(did you mean loss.normalize?)"]),
    (["model=mlp", "+model.depth=4"], ["+model.depth=4: model=mlp has no key 'depth'", "need model=custom"]),
    (["+foo=1"], ["+foo=1: the config has no key 'foo'"]),
    (["micro_batch=4,8"], ["micro_batch=4,8 gives several values: add -m"]),
    (["model.hidden=[1"], ["cannot read the override 'model.hidden=[1'"]),
    (["seed=${nowhere}"], ["seed=${nowhere}", "nowhere"]),
    (["-m", "model=mlp,cnn", "model.hidden=[8]"], ["model=resnet18 has no key 'hidden'", "++model.hidden=[8] sets"]),
    (["-m", "model=mlp,cnn", "++model.hidden=[8]"], ["++model.hidden=[8]: model=cnn has no key 'hidden'"]),
])
def test_config_mistakes_are_one_line_naming_the_key_and_what_is_valid(argv, fragments):
    """What Hydra would refuse in 5–24 lines (or, for a `+` typo, accept and ignore), refused in one line before
    Hydra runs; the schemas the options build on are not options."""
    with pytest.raises(UserError) as info:
        check(argv, decide=False)
    line = one_line(info.value)
    assert "\n" not in str(info.value) and "_schema" not in line
    for fragment in fragments:
        assert fragment in line, line


def test_keys_of_your_own_model_or_data_are_accepted(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text("class Net:\n    def __init__(self, depth=1, **kwargs):\n        pass\n")
    (tmp_path / "mydata.py").write_text("def make(size=10, shift=0.0):\n    pass\n")
    monkeypatch.syspath_prepend(tmp_path)  # the plug-ins are imported before the run (a mistake in one: one line)
    check(["model=custom", "model._target_=mymodels.Net", "+model.depth=4"], run=False)
    check(["data=custom", "data._target_=mydata.make", "+data.size=1000", "+data.shift=0.5"], run=False)
    check(["-m", "model=mlp,cnn", "micro_batch=8,16"], decide=False)  # a sweep's every job composes
    check(["-m", "model=mlp", "++model.hidden=[8]", "micro_batch=8,16"], decide=False)


def test_a_tilde_in_a_value_is_the_home_directory(monkeypatch):
    """bash leaves `~` alone after `data.root=` (not a variable name) and Hydra's grammar rejects it."""
    monkeypatch.setenv("HOME", "/home/me")
    assert expand_home(["data.root=~/pets", "-m", "hydra.run.dir=~", "resume=a~b", "data.root=~/a,~/b"]) == [
        "data.root=/home/me/pets", "-m", "hydra.run.dir=/home/me", "resume=a~b", "data.root=/home/me/a,/home/me/b"]
