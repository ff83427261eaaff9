"""With several devices the peak memory reported is the most any rank held, and says so."""
from __future__ import annotations

import json

import pytest
from conftest import TINY, read_metrics, train_run


@pytest.mark.slow
def test_peak_memory_with_two_devices_is_the_most_of_any_rank_and_named_so(tmp_path):
    run_dir, proc = train_run(tmp_path, "run", *TINY, "devices=2", "micro_batch=8", "accum=2", "trainer.max_steps=3")
    status = json.loads((run_dir / "status.json").read_text())
    rank0 = max(r["peak_mem_mb"] for r in read_metrics(run_dir)[0])  # metrics.jsonl: rank 0's own
    assert status["peak_mem_of"] == "the most of 2 ranks"
    assert status["peak_mem_mb"] >= rank0 > 0
    assert "(the most of 2 ranks)" in proc.stderr
