"""The public API: `accutrain.run(*overrides, run_dir=…)` trains as the command does and returns the run's record,
which accutrain-report reads too; `accutrain.compose(*overrides)` is the typed run; a mistake is one UserError before
the run directory exists; `import accutrain` loads neither PyTorch nor Hydra."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from conftest import TINY, assert_one_line_user_error

import accutrain
from accutrain.errors import UserError
from accutrain.report.runs import read_run

pytestmark = pytest.mark.slow


def test_run_returns_the_record_the_report_reads(tmp_path):
    record = accutrain.run(*TINY, "trainer.max_steps=3", "micro_batch=8", "accum=2", run_dir=tmp_path / "run")
    assert record.status == "completed" and record.steps == 3 and record.effective == 16
    assert record.monitor == "val_acc" and record.best is not None
    assert {"status.json", "config.yaml", "metrics.jsonl", "loss.png", ".accutrain"} <= {
        p.name for p in (tmp_path / "run").iterdir()}
    assert dataclasses.asdict(read_run(tmp_path / "run", "run")) == dataclasses.asdict(record)
    with pytest.raises(UserError) as info:  # an earlier run: continued or replaced, never mixed
        accutrain.run(*TINY, run_dir=tmp_path / "run")
    assert_one_line_user_error(info.value, "holds an earlier run", "resume=auto")


def test_a_mistake_is_one_user_error_before_the_run_directory(tmp_path):
    with pytest.raises(UserError) as info:
        accutrain.run(*TINY, "loss=triplet", "augment.views=2", "augment.crop=pad", "strategy=fsdp",
                      run_dir=tmp_path / "run")
    assert_one_line_user_error(info.value, "loss=triplet cannot be combined with strategy=fsdp")
    assert not (tmp_path / "run").exists()


def test_compose_is_the_typed_run():
    run = accutrain.compose(*TINY, "micro_batch=4", "accum=8")
    assert (run.micro_batch, run.accum) == (4, 8) and run.loss.target.endswith(".cross_entropy")
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.micro_batch = 8


def test_importing_accutrain_is_light():
    code = "import sys, accutrain; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'hydra', 'omegaconf'}))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
