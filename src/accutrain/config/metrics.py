"""The evaluation metrics each loss family measures (its `task`): what trainer.monitor may name, checked before
PyTorch loads, and which are better higher. A loss family that measures other metrics adds its row here."""
from __future__ import annotations

# What each task's evaluation measures (accutrain.core.loss / losses: a loss's `task`); trainer.monitor=auto takes
# the loss's own choice (val_acc for a classifier, val_loss for the others and for a language model).
TASK_METRICS = {
    "classification": ("val_loss", "val_acc"),
    "regression": ("val_loss", "val_mae", "val_rmse"),
    "multilabel": ("val_loss", "val_f1"),
    "custom": ("val_loss",),
    "contrastive": ("val_loss", "val_recall1", "val_recall10", "val_mrr10", "val_ndcg10"),
    # temporary rows (issue 50) until the family registry reads each family's metrics from its spec
    "preference": ("val_loss", "val_rewards_accuracy", "val_rewards_margin", "val_rewards_chosen",
                   "val_rewards_rejected"),
    "feedback": ("val_loss", "val_kl", "val_rewards_desirable", "val_rewards_undesirable"),
}
METRICS = ("auto", *dict.fromkeys(m + ema for ms in TASK_METRICS.values() for m in ms for ema in ("", "_ema")))
HIGHER_IS_BETTER = ("val_acc", "val_f1", "val_recall1", "val_recall10", "val_mrr10", "val_ndcg10",
                    "val_rewards_accuracy", "val_rewards_margin", "val_rewards_desirable")
