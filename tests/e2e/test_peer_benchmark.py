"""scripts/compare_lm_peers.py's tiny mode, so that the peer benchmark cannot rot: the same LoRA fine-tune on
accutrain, the Hugging Face Trainer and TRL's SFTTrainer (the `peers` extra), and resnet18 against a hand-written
accumulation loop, each printing its table and the command that made it."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_lm_peers.py"


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compare_lm_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tiny_peers_train_the_same_windows_each_in_its_process_and_print_a_row_each(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("trl", reason="the peers extra: pip install -e '.[peers]'")
    rows = script().main(["--tiny", "--process-per-side"])  # each side in a process of its own: its own peak
    out = capsys.readouterr().out
    assert [r["side"].split()[0] for r in rows] == ["accutrain", "HF", "TRL"]
    assert "peak RSS MiB" in out
    for row in rows:
        assert row["tokens_s"] > 0 and row["side"] in out and 100 < row["peak"] < 16_000, row
    assert "command: python" in out and "--tiny" in out
    # the same windows: the same real tokens per optimizer step on every side (accutrain's counted, the peers' read
    # from the records in accutrain's order), and the same first loss (the same weights on the same window)
    assert rows[1]["tokens"] == rows[0]["tokens"] == rows[2]["tokens"]
    first = [r["first"] for r in rows]
    assert max(first) - min(first) < 1e-4 * first[0], first
    # later steps differ only by each side's random LoRA A (B starts at zero): the losses stay close
    last = [r["last"] for r in rows]
    assert max(last) - min(last) < 1e-3 * last[0] and all(map(math.isfinite, last)), last
    assert last[0] < first[0]


@pytest.mark.slow
def test_tiny_vision_against_the_hand_written_loop(capsys: pytest.CaptureFixture) -> None:
    rows = script().main(["--tiny", "--vision"])
    out = capsys.readouterr().out
    assert [r["side"] for r in rows] == ["accutrain, channels_last", "hand loop, channels_last",
                                         "accutrain, contiguous", "hand loop, contiguous"]
    assert all(r["images_s"] > 0 and r["side"] in out for r in rows)
    assert "resnet18 at 32 px" in out and "command: python" in out
