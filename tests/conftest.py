"""Shared helpers: run the real `accutrain` CLI in a subprocess and read what a run wrote."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

# Tiny, fast, exact: an MLP (no BatchNorm, no dropout) on generated 1×8×8 images.
TINY = ["model=mlp", "model.hidden=[32]", "data=synthetic", "data.image_size=8", "data.channels=1",
        "data.val_size=50", "trainer.progress=false"]


def cli_command(script: str = "accutrain") -> list[str]:
    """The console script installed beside this interpreter, as a user would type it."""
    exe = Path(sys.executable).with_name(script)
    if exe.exists():
        return [str(exe)]
    found = shutil.which(script)
    assert found, f"the {script} console script is not installed"
    return [found]


def run_cli(*args: str, cwd: Path, script: str = "accutrain", check: bool = True,
            env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run([*cli_command(script), *args], cwd=cwd, capture_output=True, text=True, env=environment,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"accutrain {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def train_run(tmp_path: Path, name: str, *args: str, check: bool = True) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path / name
    proc = run_cli(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path, check=check)
    return run_dir, proc


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(per-step records, evaluation records) of metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "val_acc" in r]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    """A user error: non-zero exit, no traceback, and one error line that names what went wrong."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1, output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
