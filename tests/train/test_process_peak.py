"""The reported peak memory (the summary's line, status.json's peak_mem_mb, accutrain-report's column) is the
process's: what the final evaluation (or a checkpoint, the test, the export) holds after the last window counts too
(issue 52: with the allocator tuning on, a small run's process peak came after training, and went unreported)."""
import json
import re

from conftest import TINY_DATA, read_metrics, train_run

from accutrain.report.runs import read_run

EVAL_HOG = """
import torch
import torch.nn as nn

class Net(nn.Module):
    '''An MLP whose evaluations after training (not the build's or the check's forwards before it) hold 256 MiB for a
    moment: a peak no training window has.'''
    def __init__(self, num_classes, in_channels, image_size):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size ** 2, num_classes))
        self.trained = False

    def forward(self, x):
        self.trained |= self.training
        if self.trained and not self.training:
            hog = torch.ones(64 * 2**20)  # 256 MiB, written: resident
            x = x + hog[:1].sum() - 1
        return self.net(x)
"""


def test_the_reported_peak_includes_the_final_evaluation(tmp_path):
    """In a process of its own (the CLI): memory an earlier test freed but kept would hide the hog's."""
    (tmp_path / "evalhog.py").write_text(EVAL_HOG)
    run_dir, proc = train_run(tmp_path, "run", *TINY_DATA, "model=custom", "model._target_=evalhog.Net",
                              "data.size=64", "trainer.epochs=1")  # one evaluation: the final one, after every window
    steps, _ = read_metrics(run_dir)
    reported = float(re.search(r"peak memory (\d+) MiB", proc.stderr).group(1))
    assert reported >= max(r["peak_mem_mb"] for r in steps) + 200, (reported, [r["peak_mem_mb"] for r in steps])
    status = json.loads((run_dir / "status.json").read_text())
    assert status["peak_mem_mb"] >= reported - 1  # and accutrain-report's column reads it
    assert read_run(run_dir, "run").peak_mem_mb == status["peak_mem_mb"]
