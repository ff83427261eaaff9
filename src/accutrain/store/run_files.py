"""The names of what a run writes into its run directory, for those that find, protect or delete them."""
from __future__ import annotations

from accutrain.store.status import STATUS_FILE

METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
# What a run writes besides checkpoints/ and the log; trainer.overwrite=true deletes them (train.log is emptied).
RUN_FILES = (METRICS, STATUS_FILE, "config.yaml", "loss.png", "summary.md", "summary.csv")
