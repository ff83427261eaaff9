"""Components: everything the loop needs, built once from the config (accutrain.train.build)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

from accutrain.config.train import TrainConfig, TrainerConfig
from accutrain.config.typed import Supplied
from accutrain.core.grad_buffers import GradBuffers
from accutrain.core.loader import InProcessLoader
from accutrain.core.loss import Loss
from accutrain.core.lr_scaling import BatchScaling
from accutrain.core.plan import BatchPlan
from accutrain.core.precision import Precision
from accutrain.core.streams import StreamSampler
from accutrain.core.windows import WindowSampler
from accutrain.dist import World
from accutrain.models.ema import EMA
from accutrain.parallel.strategy import Strategy
from accutrain.train.monitor import Monitor
from accutrain.train.noise_scale import NoiseScale


@dataclass
class Components:
    """Everything the loop needs, built once from the run (built by keyword: accutrain.train.build). `run` is the
    typed, frozen run the command line decided; `supplied` what the build supplied to its factories (config.yaml
    records both; accutrain-check builds again from them)."""

    run: TrainConfig
    supplied: Supplied  # data, model, sched: the arguments the run supplied to their factories
    lr_scaling: BatchScaling  # scaling.*: the learning rate, β2 and the EMA's decay per window's batch
    world: World
    plan: BatchPlan
    device: torch.device
    model: nn.Module  # the bare model: its state_dict is what checkpoints hold
    wrapped: nn.Module  # what the loop calls: the DDP wrapper on several devices, else the model itself
    strategy: Strategy  # how the ranks share the model: no_sync, the reductions' counts, checkpoint state
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: WindowSampler | StreamSampler  # the training set's windows (a stream's: core/streams.py)
    loader: DataLoader | InProcessLoader  # yields (window, micro-batch) in the sampler's order
    val_loader: DataLoader
    precision: Precision
    buffers: Optional[GradBuffers]  # gradients summed outside .grad (accum_dtype / offload_grads)
    loss: Loss  # loss=: cross-entropy, a per-term loss (core/losses.py) or a window-level one (core/contrastive.py)
    ema: Optional[EMA]  # the moving average of the weights (trainer.ema)
    monitor: Monitor  # the evaluation metric best.pt and early stopping follow
    tokenizer: Any = None  # the data's, exported beside the model (trainer.export=hf)
    noise: Optional[NoiseScale] = None  # the gradient noise scale's estimator (trainer.noise_scale)
    test_loader: Optional[Any] = None  # the test split (data.test), every rank its share: evaluated at the end
    base: Optional[dict[str, Any]] = None  # an adapted model's frozen base (models.adapters.base_record), or None
    class_names: tuple[str, ...] = ()  # the data's: entry i names output i (store.classes records them)

    @property
    def trainer(self) -> TrainerConfig:
        """trainer.*, the run's."""
        return self.run.trainer
