"""Every script in scripts/ run in its quickest mode on the CPU, so that none rots when the package changes under it
(issue 39's typed run broke most of them silently): each goes through accutrain's code path it benchmarks, with
tiny models and data, and prints its figures. A script that needs CUDA builds its config here.
compare_lm_peers.py has its own test (test_peer_benchmark.py)."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
TESTED_ELSEWHERE = {"compare_lm_peers.py"}  # tests/e2e/test_peer_benchmark.py
TINY_IMAGES = ["model=mlp", "model.hidden=[16]", "data=synthetic", "data.size=64", "data.val_size=16",
               "data.image_size=8", "data.channels=1"]

# script → (its quickest arguments on the CPU, a line its output must hold): main(argv) in this process
RUNS = {
    "augment_accuracy.py": (["--train", "4", "--val", "2", "--epochs", "1", "--size", "8", "--seeds", "0"],
                            "micro_batch=8 accum=4"),
    "batch_size_study.py": (["--epochs", "1", "--only", "a/2x2"], "| a/2x2 | 8 |"),
    "bench_augment.py": (["--rounds", "1", "--size", "32", "--micro-batch", "8"], "crop_flip+mix"),
    "bench_checkpoint_cost.py": (["--writes", "2", *TINY_IMAGES], "the default checkpointing adds"),
    "bench_ddp.py": (["--steps", "3", "--warmup", "1", "--accums", "2", *TINY_IMAGES, "micro_batch=4"], "    2 | "),
    "bench_hf_memory.py": (["--sizes", "20", "--rounds", "1"], "20 records"),
    "bench_lm_finetune.py": (["--tiny"], "micro_tokens="),
    "bench_malloc.py": (["--rounds", "1", "--steps", "3", "--warmup", "1", *TINY_IMAGES, "micro_batch=4", "accum=2"],
                        "| accutrain, tuned |"),
    "bench_noise_scale.py": (["--rounds", "1", "--steps", "3", "--warmup", "1", "model=mlp", "micro_batch=4",
                              "accum=2"], "the noise scale costs"),
    "bench_overhead.py": (["--rounds", "1", "--steps", "4", "--warmup", "1", "model=mlp", "micro_batch=8", "accum=2"],
                          "accutrain's extra"),
    "bench_overhead_vs.py": (["HEAD", "--rounds", "1", "--steps", "3", "--warmup", "1", "model=mlp", "micro_batch=4",
                              "accum=2"], "working tree − HEAD"),
    "bench_trackers.py": (["--steps", "5", "--rounds", "1"], "| mlflow, one log_batch per step |"),
    "bench_worker_start.py": (["--rounds", "1", "data.size=32", "trainer.max_steps=1"], "forked workers save"),
    "compare_embedding_peers.py": (["--window", "4", "--micro", "2", "--repeats", "1", "--layers", "1", "--hidden",
                                    "16", "--methods", "accutrain"], "accutrain"),
    "compare_normalisation.py": (["--windows", "2", "--accum", "2", "--micro-batch", "2", "--length", "8"],
                                 "windows"),
    "compare_preference_peers.py": (["--tiny", "--window", "4", "--micro", "2", "--steps", "1", "--records", "8"],
                                    "| kto | TRL |"),
    "compare_window_loss.py": (["--epochs", "1", "--micro", "4", "--accum", "2", "--repeats", "1", "--width", "16",
                                "trainer.max_steps=3"], "the exact loss costs"),
    "moe_balancing.py": (["study", "--seeds", "0", "--epochs", "1", "--lines", "64", "--effective", "8", "--hidden",
                          "16", "--layers", "1", "--experts", "2"], "| micro_batch |"),
}
# scripts tested below by a test of their own: what they need (CUDA, the network, minutes) is not here
OWN_TESTS = {"bench_auto_batch.py", "bench_memory.py", "make_digits.py"}


@pytest.fixture
def scripts(monkeypatch: pytest.MonkeyPatch):
    """Load a script as its module (scripts/ on sys.path, as when it runs), and leave the process as it was:
    torch's threads, accutrain's log level, logging switched off by a script (logging.disable), a process group a
    peer's trainer joined, the scripts' modules."""
    monkeypatch.setattr(sys, "path", [str(SCRIPTS), *sys.path])
    threads, level = torch.get_num_threads(), logging.getLogger("accutrain").level
    before, grouped = set(sys.modules), torch.distributed.is_initialized()

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(Path(name).stem, SCRIPTS / name)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in set(sys.modules) - before:
        if (SCRIPTS / f"{name}.py").exists():
            del sys.modules[name]
    torch.set_num_threads(threads)
    logging.getLogger("accutrain").setLevel(level)
    logging.disable(logging.NOTSET)
    if torch.distributed.is_initialized() and not grouped:  # a peer's trainer (Accelerate) joined a process group
        torch.distributed.destroy_process_group()


def test_every_script_has_a_run_here() -> None:
    names = {p.name for p in SCRIPTS.glob("*.py")} - TESTED_ELSEWHERE
    assert names == set(RUNS) | OWN_TESTS, "a script in scripts/ has no entry in RUNS (or OWN_TESTS), or one is gone"
    assert not set(RUNS) & OWN_TESTS


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_script_runs_its_quickest_mode(name: str, scripts, capsys: pytest.CaptureFixture,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    argv, expected = RUNS[name]
    if name == "bench_overhead_vs.py" and not (shutil.which("git") and subprocess.run(
            ["git", "-C", str(SCRIPTS), "rev-parse", "HEAD"], capture_output=True).returncode == 0):
        pytest.skip("bench_overhead_vs.py compares with a git revision: not a git checkout")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    scripts(name).main(argv)
    out = capsys.readouterr().out
    assert expected in out, out


def test_bench_auto_batch_builds_its_runs_on_the_cpu(scripts) -> None:
    """bench_auto_batch.py needs CUDA to search; its runs are built here, and without a GPU it says so in one line."""
    bench = scripts("bench_auto_batch.py")
    auto = bench.run_config([*bench.DEFAULTS, "model=mlp"])
    assert (auto.micro_batch, auto.trainer.device, auto.model.target) == ("auto", "cuda", "accutrain.models.mlp")
    fixed = bench.run_config([*bench.DEFAULTS, "model=mlp"], 24)
    assert (fixed.micro_batch, fixed.global_batch, fixed.trainer.max_steps) == (24, 24, 1)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench.main([])


@pytest.mark.slow
def test_bench_memory_measures_one_split(scripts) -> None:
    """One accutrain process of bench_memory.py's table (all of them take minutes): its peak and samples/s."""
    bench = scripts("bench_memory.py")
    args = argparse.Namespace(image_size=8, steps=3, warmup=1, overrides=["model=mlp", "data.channels=1"])
    peak, rate = bench.run(8, 2, ["trainer.activation_checkpointing=true"], args)
    assert peak > 0 and rate > 0


def test_make_digits_split_is_the_bundled_one(scripts) -> None:
    """make_digits.py downloads (the network is not here): its split of the labels is the one the bundled file has."""
    make = scripts("make_digits.py")
    bundled = np.load(make.OUT)
    assert np.array_equal(make.stratified_val_mask(bundled["labels"].astype(np.int64), 0.2, seed=0), bundled["val"])


@pytest.mark.slow
def test_moe_balancing_times_each_option(scripts, capsys: pytest.CaptureFixture) -> None:
    """moe_balancing.py's second mode (`cost`): one window accumulated by each loss.router_aux, and pass 1 alone."""
    scripts("moe_balancing.py").main(["cost", "--repeats", "1", "--micro-batch", "2", "--effective", "4",
                                      "--hidden", "16", "--layers", "1", "--experts", "2"])
    out = capsys.readouterr().out
    assert all(f"| {mode} |" in out for mode in ("off", "micro_batch", "window", "pass 1 alone")), out
