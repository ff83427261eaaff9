"""The choices the core's arithmetic takes, as enums without a dependency: the typed config (accutrain.config)
names them before PyTorch is imported."""
from __future__ import annotations

import enum


class Normalize(enum.Enum):
    auto = "auto"  # the model's preference: tokens for model=hf_causal_lm, else samples
    samples = "samples"  # the window's loss is the mean over its samples
    elements = "elements"  # … over its elements (tokens, pixels), ignoring loss.ignore_index
    tokens = "tokens"  # the same as elements
    sequences = "sequences"  # … over its samples of each one's mean over its elements (tokens), as GRPO's loss


class LRScaling(enum.Enum):
    none = "none"  # optim.lr as given
    linear = "linear"  # optim.lr × effective batch / scaling.base_batch (the linear scaling rule)
    sqrt = "sqrt"  # optim.lr × √(effective batch / scaling.base_batch), for adaptive optimisers


class Beta2Scaling(enum.Enum):
    none = "none"  # Adam's betas as given
    half_life = "half_life"  # β2 ** (effective batch / scaling.base_batch): the same half-life in samples


class MixMode(enum.Enum):
    window = "window"  # one draw per window: mix or not, MixUp or CutMix, λ (and CutMix's box)
    sample = "sample"  # one draw per sample


class LastWindow(enum.Enum):
    step = "step"  # step on the incomplete last window of an epoch, normalised by its real size
    drop = "drop"  # drop it


class RouterAux(enum.Enum):
    window = "window"  # loss=moe: the router's balancing loss over the whole window, exactly (two passes)
    micro_batch = "micro_batch"  # over each micro-batch alone, as the model computes it (not the big batch's)
    model = "model"  # the model's own aux_loss as its forward returns it, per micro-batch (not the big batch's)
    off = "off"  # no balancing loss (the router's load is still measured)
