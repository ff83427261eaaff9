"""Losses of your own for `loss=custom` (docs/losses.md), run from the repository's top folder:
`accutrain debug=fast loss=custom loss._target_=examples.mylosses.cubic data.target=regression`.

A loss returns one loss per term (`reduction='none'`): accutrain sums them over the window and divides by its real
count, so that accumulation is exact."""
import torch


def cubic(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """|error|³ per element."""
    return (output - target).abs().pow(3)


def mean_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """What not to write: a mean over the batch, which accutrain refuses in one line (a mean of micro-batch means is
    not the window's mean)."""
    return (output - target).pow(2).mean()
