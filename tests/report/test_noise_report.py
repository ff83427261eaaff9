"""accutrain-report says what the noise scale says: one line per run that measured it, and noise.png."""
import re
from pathlib import Path

import pytest
from conftest import TINY, train_here

from accutrain.report.noise import verdict
from accutrain.report.runs import RunRow
from accutrain.report.summary import write_report


def row(b_simple: float, effective: int = 64) -> RunRow:
    early = [(i * effective, 10.0, effective) for i in range(80)]  # the first four fifths: left out
    return RunRow(Path("run"), "run", [], "completed",
                  noise_curve=early + [(i * effective, b_simple, effective) for i in range(80, 100)])


@pytest.mark.parametrize("b_simple, says", [
    (16.0, "the effective batch 64 is 4.0× the measured noise scale B_simple ≈ 16 late in training: beyond it more "
           "samples per step stop paying"),
    (256.0, "the effective batch 64 is 4.0× below the measured noise scale B_simple ≈ 256 late in training: a larger "
            "effective batch (more accumulation) would take proportionally fewer steps"),
    (80.0, "the effective batch 64 is near the measured noise scale B_simple ≈ 80 late in training (0.8×)"),
    (-3.0, "the noise scale never came out positive"),
])
def test_the_verdict_reads_the_last_fifth_of_training(b_simple, says):
    assert says in verdict(row(b_simple))


def test_no_line_for_a_run_that_did_not_measure_it():
    assert verdict(RunRow(Path("run"), "run", [], "completed")) is None


def test_the_report_of_a_run_that_measured_it(tmp_path):
    run_dir, log = train_here(tmp_path, "run", *TINY, "micro_batch=8", "accum=4", "trainer.noise_scale=true")
    said = re.search(r"^noise scale B_simple ≈ (\S+) late in training, at effective batch 32$", log, flags=re.M)
    report = write_report(run_dir)
    assert f"B_simple ≈ {said.group(1)} late in training" in report.text  # one figure: the closing line's
    assert run_dir / "noise.png" in report.files and (run_dir / "noise.png").stat().st_size > 0
    assert "run: the effective batch 32 is" in report.text and "measured noise scale B_simple" in report.text
    assert "## The noise scale" in (run_dir / "summary.md").read_text()
    plain, _ = train_here(tmp_path, "plain", *TINY, "micro_batch=8", "accum=4")
    assert plain / "noise.png" not in write_report(plain).files
