"""checkpoints/best.pt: what evaluation needs (the weights, their average, the progress, plan and config), not a
second copy of the optimizer state; a resume continues from step-*.pt or last.pt."""
from __future__ import annotations

import pytest
import torch
from conftest import TINY, assert_one_line_user_error, train_here

from accutrain.config.train import compose
from accutrain.config.validate import typed_run
from accutrain.errors import UserError
from accutrain.runtime.launch import train


def test_best_pt_holds_the_weights_without_the_optimizer_state(tmp_path):
    run_dir, _ = train_here(tmp_path, "run", *TINY, "optim=adamw", "trainer.ema=0.9", "trainer.max_steps=4")
    checkpoints = run_dir / "checkpoints"
    best = torch.load(checkpoints / "best.pt", weights_only=True)
    last = torch.load(checkpoints / "last.pt", weights_only=True)
    assert {"optimizer", "scheduler", "rng"}.isdisjoint(best)
    assert {"model", "ema", "progress", "plan", "config", "step"} <= best.keys()
    assert best["step"] == best["progress"]["best_step"]
    assert {k: v.shape for k, v in best["model"].items()} == {k: v.shape for k, v in last["model"].items()}
    # AdamW keeps two moments per weight: best.pt is about a third of a full checkpoint
    assert (checkpoints / "best.pt").stat().st_size < 0.5 * (checkpoints / "last.pt").stat().st_size


def test_resuming_from_best_pt_is_one_line_naming_what_to_resume_from(tmp_path):
    run_dir, _ = train_here(tmp_path, "run", *TINY, "trainer.max_steps=2")
    with pytest.raises(UserError) as e:
        train(typed_run(compose(*TINY, "trainer.max_steps=4", f"resume={run_dir / 'checkpoints' / 'best.pt'}")),
              tmp_path / "again")
    assert_one_line_user_error(e.value, "best.pt", "evaluation only", "last.pt")


def test_extending_a_finished_run_keeps_its_best_pt_in_place(tmp_path):
    """best.pt holds no optimizer state; the step it holds is still read, so a resume at that step (a finished run
    given more epochs) starts no branch and sets nothing aside."""
    run_dir, _ = train_here(tmp_path, "run", *TINY, "trainer.epochs=1")
    _, log = train_here(tmp_path, "run", *TINY, "trainer.epochs=2", "resume=auto")
    assert "resumed from" in log and "moved to" not in log, log
    assert not list((run_dir / "checkpoints").glob("abandoned-*"))
    assert (run_dir / "checkpoints" / "best.pt").exists()
