"""The reported peak memory (the summary's line, status.json's peak_mem_mb, accutrain-report's column) is the
process's: what the final evaluation (or a checkpoint, the test, the export) holds after the last window counts too
(issue 52: with the allocator tuning on, a small run's process peak came after training, and went unreported)."""
import json
import re
import subprocess
import sys

import pytest
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


RELEASE = """
import re, torch
from accutrain.runtime.malloc import glibc_version, release_heap, tune_malloc
def rss_mb():
    return int(re.search(r"VmRSS:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) // 1024
if glibc_version() is None or "tuned" not in tune_malloc():
    print("untuned")
else:
    window = torch.ones(64 * 2**20)  # a micro-batch's 256 MiB, written, freed: the tuned heap keeps them
    del window
    kept = rss_mb()
    release_heap()  # what the session does once the loop is over
    print(kept, rss_mb())
"""


def test_what_the_tuned_heap_kept_for_the_next_micro_batch_goes_back_after_training():
    """The process's peak is then the loop's, not the loop's plus the final evaluation's, export's and plot's."""
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True).stdout.split()
    if out == ["untuned"]:
        pytest.skip("glibc's allocator is not here to tune")
    kept, released = map(int, out)
    assert kept - released > 200, (kept, released)
