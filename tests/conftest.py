"""Shared helpers: compose a config, train in this process, run the real CLI in a subprocess, read what a run wrote.

A test trains in this process (`train_here`) unless what it proves needs the command line itself (exit codes,
one-line errors, signals, status.json, Hydra's run and sweep directories, torchrun): then `train_run` runs the
`accutrain` console script. Both take the overrides a user would type.
"""
from __future__ import annotations

import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import forked as fork_server
import numpy as np
import pytest
import torch
from PIL import Image
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from accutrain.config.train import compose as compose_config
from accutrain.config.validate import typed_run
from accutrain.runtime.launch import train

# Each test process (pytest-xdist runs one per core) computes on one thread, and so does each accutrain it starts:
# several processes each spinning up threads for every core would slow one another down many times over.
torch.set_num_threads(1)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# No network here or in CI: a Hugging Face name not in the local cache fails at once instead of retrying for 24 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The hundreds of processes the suite starts compile accutrain's modules once, not each on its own: an editable install
# leaves them uncompiled, and where PYTHONDONTWRITEBYTECODE is set (the development machine sets it) every process
# would compile them again (0.3 s of CPU each).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# Timeouts end a hang, nothing else: a test proves a property, not a speed. They are generous because a 2-core machine
# whose cores are busy with other work runs a command many times slower than an idle one (PyTorch's threads wait for
# cores the other processes hold: README.md, "How long it takes"): a command, a run or a sweep may take COMMAND_S; a
# run reaching a step, or answering a signal, WAIT_S.
COMMAND_S = 900
WAIT_S = 600

# Tiny, fast, exact: the debug preset's MLP (no BatchNorm, no dropout) on generated 1×8×8 images, narrowed.
TINY = ["debug=fast", "model.hidden=[32]"]
# The same data for a model of the test's own (model=custom …).
TINY_DATA = ["debug=fast"]


def pytest_collection_modifyitems(config, items):
    """The `slow` tests first (a stable sort), so that pytest-xdist's workers start on the longest ones rather than
    one worker finishing the last of them alone; `cuda`-marked tests skip, saying so, where no CUDA device is
    visible."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (pytest -m cuda on a GPU machine: scripts/gpu_check.sh)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture
def compose():
    """The config `accutrain <overrides>` would run with: compose(*overrides)."""
    return compose_config


def run_of(*overrides: str):
    """The typed run `accutrain <overrides>` would train (composed, checked, typed), as the layers below the command
    line receive it."""
    return typed_run(compose_config(*overrides))


@contextmanager
def captured_log() -> Iterator[io.StringIO]:
    """What accutrain logs (INFO and up) while the block runs, train.log's detail included: once a Hydra run in this
    process has configured logging, `accutrain.detail` no longer propagates to `accutrain`."""
    logger, stream = logging.getLogger("accutrain"), io.StringIO()
    handler, level = logging.StreamHandler(stream), logger.level
    detail = logging.getLogger("accutrain.detail")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    apart = not detail.propagate
    if apart:
        detail.addHandler(handler)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        if apart:
            detail.removeHandler(handler)


def train_here(tmp_path: Path, name: str, *args: str) -> tuple[Path, str]:
    """Train in this process as `accutrain *args hydra.run.dir=tmp_path/name` would (the CLI adds status.json and
    loss.png): (the run directory, what the run logged)."""
    run_dir = tmp_path / name
    run_dir.mkdir(parents=True, exist_ok=True)
    with captured_log() as log:
        train(typed_run(compose_config(*args)), run_dir)
    return run_dir, log.getvalue()


def cli_command(script: str = "accutrain") -> list[str]:
    """The console script installed beside this interpreter, as a user would type it."""
    exe = Path(sys.executable).with_name(script)
    if exe.exists():
        return [str(exe)]
    found = shutil.which(script)
    assert found, f"the {script} console script is not installed"
    return [found]


def command_process(argv: list[str], cwd: Path, env: dict, fresh: bool = False, **streams: Any) -> Any:
    """The command's process, started as subprocess.Popen would: forked from a process that has imported what every
    accutrain command imports (tests/forked.py), unless `fresh` (the console script in a new interpreter: what a
    test of the start itself needs; every command, with ACCUTRAIN_TESTS_FRESH=1 in pytest's environment)."""
    fresh = fresh or os.environ.get("ACCUTRAIN_TESTS_FRESH") == "1"
    forked = None if fresh else fork_server.popen(argv, cwd, env, **streams)
    return forked or subprocess.Popen(argv, cwd=cwd, env=env, text=True, **streams)


def run_cli(*args: str, cwd: Path, script: str = "accutrain", check: bool = True,
            env: dict | None = None, timeout: int = COMMAND_S, fresh: bool = False) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **ONE_THREAD, **(env or {})}
    argv = [*cli_command(script), *args]
    command = command_process(argv, cwd, environment, fresh, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = command.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        command.kill()
        raise
    proc = subprocess.CompletedProcess(argv, command.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"accutrain {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def train_run(tmp_path: Path, name: str, *args: str, check: bool = True, fresh: bool = False
              ) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path / name
    proc = run_cli(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path, check=check, fresh=fresh)
    return run_dir, proc


def strict_json(text: str) -> Any:
    """json.loads refusing what is not JSON but Python writes by default: NaN, Infinity, -Infinity."""
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON: {text}")

    return json.loads(text, parse_constant=refuse)


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(per-step records, evaluation records) of metrics.jsonl, read as strict JSON (NaN or Infinity fail)."""
    records = [strict_json(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    """A user error: non-zero exit, no traceback, and one error line that names what went wrong."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1, output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def assert_one_line_user_error(error: BaseException, *fragments: str) -> None:
    """A UserError raised in this process reads as the one line the CLI would print."""
    from accutrain.errors import UserError, one_line

    assert isinstance(error, UserError), repr(error)
    line = one_line(error)
    assert "\n" not in str(error).strip() or "Original Traceback" in str(error), str(error)
    for fragment in fragments:
        assert fragment in line, line


# --- runs a test kills: a slow model, started in the background ------------------------------------------
# A model that sleeps in forward (numerics untouched) so that a kill can land at a chosen optimizer step, and
# dropout so that an RNG state not restored would show.
# A data factory (data=custom) whose samples `bad` are NaN: non-finite windows on purpose.
NAN_DATA = """
import torch
from accutrain.data.datasets import Datasets, InMemory

def make(size=64, bad=(5,)):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(size, 1, 4, 4, generator=g), torch.randint(3, (size,), generator=g)
    for i in bad:
        x[i] = float("nan")
    return Datasets(InMemory(x, y), InMemory(x[:8].nan_to_num(), y[:8]), 3, (1, 4, 4), "nan data")
"""


SLOW_MODEL = """
import time
import torch.nn as nn

class Net(nn.Module):
    def __init__(self, num_classes, in_channels, image_size, width=32, delay=0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size ** 2, width), nn.ReLU(),
                                 nn.Dropout(0.3), nn.Linear(width, num_classes))
        self.delay = delay

    def forward(self, x):
        if self.training:
            time.sleep(self.delay)
        return self.net(x)
"""

RUN = [*TINY_DATA, "model=custom", "model._target_=slow.Net", "data.size=117", "trainer.epochs=3",
       "micro_batch=8", "accum=4", "trainer.checkpoint_every=1", "optim=adamw"]


@pytest.fixture
def slow(tmp_path, monkeypatch):
    (tmp_path / "slow.py").write_text(SLOW_MODEL)
    monkeypatch.syspath_prepend(tmp_path)  # for the runs in this process; the CLI imports from its working directory
    return tmp_path


def start(tmp_path: Path, name: str, *args: str) -> subprocess.Popen:
    with open(tmp_path / f"{name}.log", "w") as log:
        return command_process([*cli_command(), *args, f"hydra.run.dir={tmp_path / name}"], tmp_path,
                               {**os.environ, "PYTHONUNBUFFERED": "1", **ONE_THREAD}, stdout=log,
                               stderr=subprocess.STDOUT)


def killed_at_step(tmp_path: Path, name: str, steps: int, *args: str) -> Path:
    """`accutrain *args` in tmp_path/name, killed outright (SIGKILL) once metrics.jsonl holds `steps` steps; its run
    directory."""
    proc = start(tmp_path, name, *args)
    wait_for_steps(tmp_path / name, steps, proc)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL
    return tmp_path / name


def rewind(run_dir: Path, step: int) -> Path:
    """Make a finished run look killed after optimizer step `step`: drop its newer checkpoints (files, or the
    directories of sharded ones) and `last`."""
    ckpts = run_dir / "checkpoints"
    for path in ckpts.glob("step-*"):
        if int(path.name.split("-")[1].split(".")[0]) > step:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    for last in (ckpts / "last.pt", ckpts / "last"):
        if last.is_symlink() or last.is_file():
            last.unlink()
        elif last.is_dir():
            shutil.rmtree(last)
    return ckpts


def wait_for_steps(run_dir: Path, steps: int, proc: subprocess.Popen, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and sum('"loss"' in line for line in metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.005)
    raise AssertionError(f"the run did not reach step {steps}")


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# --- shared by several test modules -------------------------------------------------------------------
# The exactness preset: 110 samples (windows of 32, 32, 32 and 14), 3 epochs, clipping and weight decay on.
WINDOWS = ["data.size=110", "trainer.epochs=3", "trainer.grad_clip=0.5", "optim.weight_decay=1e-3"]
EXACT = [*TINY, *WINDOWS]


# A model of the tests' own that runs out of memory above `limit` samples (oommodel.py in the working directory).
OOM_MODEL = '''
import torch
import torch.nn as nn

class Net(nn.Module):
    """An MLP whose training forward runs out of memory above `limit` samples."""
    def __init__(self, num_classes, in_channels, image_size, limit=12):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size ** 2, 32), nn.ReLU(),
                                 nn.Linear(32, num_classes))
        self.limit = limit

    def forward(self, x):
        if self.training and x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated: {x.shape[0]} > {self.limit})")
        return self.net(x)
'''
# The same network as accutrain's mlp with hidden=[32]: plain runs of the two take the same steps.
OOM = [*TINY_DATA, "data.size=117", "trainer.epochs=2", "model=custom", "model._target_=oommodel.Net",
       "optim.weight_decay=1e-3"]


def make_image_folder(root, classes=("cat", "dog", "owl"), train=6, val=2, size=12):
    """Generated PNGs: each class its own colour, plus noise."""
    rng = np.random.default_rng(0)
    for split, count in (("train", train), ("val", val)):
        for c, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                base = np.zeros((size, size, 3)) + 60 * c + 40
                pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


class LiveTensors(TorchDispatchMode):
    """The bytes of tensor storage alive at once at most, and the largest tensor, over every operation run under it
    (forward and backward): what a micro-batch holds, whatever the allocator caches."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                self.live.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
                self.largest = max(self.largest, storage.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out
