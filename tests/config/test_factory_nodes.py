"""Factory nodes hold only their factory's keyword arguments: `hydra.utils.instantiate` rebuilds a finished run's
model, data, optimizer and scheduler from its config.yaml; the keys accutrain applies itself have nodes of their own,
and their old spellings still work with a notice."""
from __future__ import annotations

import pytest
import torch
from conftest import train_here, train_run
from hydra.utils import instantiate
from omegaconf import OmegaConf

from accutrain.config.renames import RENAMED, renamed
from accutrain.config.validate import validate
from accutrain.data import Datasets
from accutrain.errors import UserError

TINY = ["debug=fast", "data.size=40", "data.val_size=8", "trainer.max_steps=2", "trainer.checkpoint_every=1"]


@pytest.mark.parametrize("model", ["mlp", "cnn", "resnet18"])
def test_a_runs_config_yaml_instantiates_its_model_data_optimizer_and_scheduler(tmp_path, model):
    run_dir, _ = train_here(tmp_path, "run", *TINY, f"model={model}", "optim=adamw", "sched=cosine",
                            "sched.warmup_steps=1")
    saved = OmegaConf.load(run_dir / "config.yaml")

    datasets = instantiate(saved.data)
    assert isinstance(datasets, Datasets) and len(datasets.train) == 40
    net = instantiate(saved.model)
    weights = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    net.load_state_dict(weights)  # strict: the very architecture the run trained
    optimizer = instantiate(saved.optim, net)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups[0]["lr"] == saved.optim.lr
    assert optimizer.param_groups[0]["weight_decay"] == saved.optim.weight_decay
    assert {g["weight_decay"] for g in optimizer.param_groups} == {saved.optim.weight_decay, 0.0}
    scheduler = instantiate(saved.sched, optimizer)
    assert scheduler.get_last_lr()[0] == pytest.approx(saved.optim.lr / 1)  # warm-up of 1 step: step 0 at full lr
    assert saved.sched.total_steps == 2
    if model == "mlp":  # the data's arguments, recorded
        assert (saved.model.num_classes, saved.model.in_channels, saved.model.image_size) == (10, 1, 8)
    with torch.no_grad():
        assert net.eval()(datasets.val[0][0][None]).shape == (1, datasets.num_classes)


def test_both_records_of_a_run_rebuild_it_with_instantiate(tmp_path):
    """config.yaml holds the command's config with the arguments the run supplied in their nodes, and those arguments
    again under `supplied`; Hydra's .hydra/config.yaml holds the command's config as typed: with the supplied record
    it builds the same model, data, optimizer, scheduler and loss."""
    run_dir, _ = train_run(tmp_path, "run", *TINY, "model=mlp", "optim=adamw", "sched=cosine", "trainer.progress=false")
    saved, composed = OmegaConf.load(run_dir / "config.yaml"), OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    supplied = saved.supplied
    assert (supplied.model.num_classes, supplied.model.in_channels, supplied.sched.total_steps) == (10, 1, 2)
    assert "num_classes" not in composed.model and "total_steps" not in composed.sched  # the input is not mutated
    weights = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    for cfg, extra in ((saved, {}), (composed, supplied)):
        datasets = instantiate(cfg.data, **extra.get("data", {}))
        net = instantiate(cfg.model, **extra.get("model", {}))
        net.load_state_dict(weights)  # strict: the very architecture the run trained
        scheduler = instantiate(cfg.sched, instantiate(cfg.optim, net), **extra.get("sched", {}))
        assert isinstance(scheduler.optimizer, torch.optim.AdamW)
        loss = instantiate(cfg.loss)
        x, y = datasets.val[0]
        assert loss.eval_metrics(loss.eval_sums(net.eval()(x[None]), torch.tensor([y])).tolist())["val_loss"] > 0


def test_the_optimizer_factories_take_parameters_as_well_as_a_module():
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    by_module = instantiate({"_target_": "accutrain.models.optim.sgd", "lr": 0.1, "weight_decay": 0.5}, net)
    by_params = instantiate({"_target_": "accutrain.models.optim.sgd", "lr": 0.1, "weight_decay": 0.5},
                            net.parameters())
    for a, b in zip(by_module.param_groups, by_params.param_groups):
        assert [id(p) for p in a["params"]] == [id(p) for p in b["params"]]
        assert a["weight_decay"] == b["weight_decay"]


def test_no_factory_node_holds_a_key_accutrain_applies_itself(compose):
    cfg = compose("model=resnet18", "data=cifar10")
    for old in RENAMED:
        group, key = old.split(".")
        assert key not in cfg[group], old
    assert cfg.batchnorm.convert.name == "keep" and cfg.loader.num_workers == "auto" and cfg.scaling.lr.name == "none"


def test_old_spellings_are_rewritten_with_one_notice_each(compose):
    said: list[str] = []
    args = ["model.norm=group", "+optim.base_batch=64", "optim.lr_scaling=sqrt", "~data.target_key",
            "data.num_workers=0", "model.name=resnet34", "hydra.run.dir=x", "--multirun"]
    assert renamed(args, said.append) == ["batchnorm.convert=group", "scaling.base_batch=64", "scaling.lr=sqrt",
                                          "~loader.target_key", "loader.num_workers=0", "model.name=resnet34",
                                          "hydra.run.dir=x", "--multirun"]
    assert len(said) == 5 and said[0].startswith("model.norm is now batchnorm.convert: write batchnorm.convert=group")
    cfg = compose("model.norm=frozen", "optim.lr_scaling=linear", "optim.base_batch=16", "data.num_workers=1")
    assert (cfg.batchnorm.convert.name, cfg.scaling.lr.name, cfg.scaling.base_batch, cfg.loader.num_workers) == \
        ("frozen", "linear", 16, 1)


@pytest.mark.parametrize("override, fragment", [
    ("loader.num_workers=-1", "loader.num_workers=-1 is not valid"),
    ("loader.num_workers=many", "loader.num_workers=many is not valid"),
    ("batchnorm.groups=0", "batchnorm.groups=0 is not valid"),
    ("scaling.lr=linear", "scaling.lr=linear cannot be combined with scaling.base_batch=null: it needs scaling.base_batch"),
])
def test_the_new_nodes_values_are_checked(compose, override, fragment):
    with pytest.raises(UserError, match=fragment):
        validate(compose(override))


def test_auto_workers_only_for_data_read_per_item(tmp_path, monkeypatch):
    from accutrain.data.datasets import loader_workers

    in_memory = Datasets(None, None, 2, (1,), "x")
    decoded = Datasets(None, None, 2, (1,), "x", decoded=True)
    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(16)), raising=False)
    assert loader_workers("auto", in_memory, 1) == 0
    assert loader_workers("auto", decoded, 1) == 4 and loader_workers("auto", decoded, 8) == 1
    assert loader_workers(3, in_memory, 1) == 3
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1})
    assert loader_workers("auto", decoded, 1) == 1 and loader_workers("auto", decoded, 2) == 0



def test_an_old_spelling_in_a_yaml_file_is_one_line_naming_the_new_key(tmp_path):
    from conftest import assert_one_line_error, run_cli

    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\nmodel:\n  norm: group\n")
    proc = run_cli("--config-dir", str(tmp_path), "+experiment=mine", cwd=tmp_path, check=False)
    assert_one_line_error(proc, "model.norm (in experiment/mine): model.norm is now batchnorm.convert")
    assert proc.returncode == 2


def test_the_typed_run_is_frozen_all_the_way_down_and_travels_to_spawned_ranks(compose):
    """What the command line checked is what every rank builds from: nothing below it can change the run."""
    import dataclasses
    import pickle

    from accutrain.config.validate import typed_run

    run = typed_run(compose("model=mlp", "logger=csv"))
    for change in (lambda: setattr(run, "seed", 1), lambda: setattr(run.trainer, "epochs", 9),
                   lambda: setattr(run.model, "target", "x.Y")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            change()
    with pytest.raises(TypeError):
        run.model.arguments["hidden"] = [8]
    assert isinstance(run.model.get("hidden"), tuple) and run.logger["csv"].target.endswith(".CSV")
    again = pickle.loads(pickle.dumps(run))  # as spawned workers receive it
    assert again == run
    with pytest.raises(dataclasses.FrozenInstanceError):
        again.trainer.epochs = 9
    assert dataclasses.replace(run.trainer, epochs=9).epochs == 9 and run.trainer.epochs == 5  # a changed copy


@pytest.mark.parametrize("target", ["os.system", "subprocess.run"])
def test_a_target_hydra_blocks_is_one_line_before_the_run_directory(tmp_path, target):
    from conftest import assert_one_line_error

    run, proc = train_run(tmp_path, "run", "data=custom", f"data._target_={target}", check=False)
    assert_one_line_error(proc, f"data._target_={target}: Hydra will not instantiate it", "is blocklisted")
    assert proc.returncode == 2 and "InstantiationException" not in proc.stderr
    assert not run.exists()
