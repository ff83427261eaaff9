"""The model of a run, sized to its data, and the loss checked with it; how the ranks share it (the strategy)."""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from accutrain.config import families, model_traits
from accutrain.config.refusals import refuse_combinations
from accutrain.config.train import TrainConfig
from accutrain.core.batches import BatchFormat
from accutrain.core.loss import Loss
from accutrain.core.precision import Precision
from accutrain.data import datasets as data
from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.models import adapters, losses, norms
from accutrain.models import factories as models
from accutrain.models.checkpointing import enable_activation_checkpointing
from accutrain.parallel.strategy import Strategy

log = logging.getLogger("accutrain")


def build_model(cfg: TrainConfig, datasets: data.Datasets, batches: BatchFormat, world: World, device: torch.device,
                precision: Precision, strategy: Strategy
                ) -> tuple[nn.Module, Loss, dict[str, dict[str, Any]], Optional[dict[str, Any]]]:
    """The run's loss, and the model sized to the data, its BatchNorm layers as `batchnorm.convert` asks, activation
    checkpointing, on the device (in CPU memory for FSDP, which moves each rank's shards to the device; SyncBatchNorm
    comes later, in build, once micro_batch=auto has searched), the loss checked with it on the first samples; the
    arguments the run supplied to their factories (the model's num_classes, in_channels, …; the loss's model
    defaults); and what the frozen base of an adapted model is (models.adapters.base_record: the checkpoints record
    it, a resume compares it)."""
    supplied = dict(model=models.data_arguments(cfg.model, datasets.sample_shape, datasets.num_classes,
                                                datasets.extra))
    node = cfg.model.node(supplied["model"])
    defaults = models.loss_defaults(node)
    loss = losses.build_loss(cfg.loss.node(), defaults)
    supplied["loss"] = losses.supplied_arguments(cfg.loss.node(), defaults)
    if families.family_of(cfg.loss) is None and families.implements(loss):  # a family of the user's, as made
        refuse_combinations(cfg, families.declared(loss))
    first = batches([datasets.train[i] for i in range(min(2, len(datasets.train)))])
    example = loss.probe(first)  # one input per row: a view of an image pair, an anchor of a text pair
    if isinstance(example.inputs, dict) and "document_ids" in example.inputs and \
            model_traits.takes_documents(cfg.model) is False:
        if example.spans is not None:
            raise UserError(f"data.padding=free lays a micro-batch's samples end to end, each keeping its positions "
                            f"and attention to itself, which model {models.model_name(node)} cannot take "
                            "(document_ids): use model=hf_causal_lm, or data.padding=longest")
        raise UserError(f"data.packing=true keeps each packed document's positions and attention to itself, which "
                        f"model {models.model_name(node)} cannot take (document_ids): use model=hf_causal_lm, or "
                        "data.packing=concat (attention crossing documents)")
    model = models.build_model(node, datasets.sample_shape, datasets.num_classes, datasets.extra, example,
                               logits=loss.output == "logits")
    base = adapters.base_record(model, node)  # as the factory built it, before trainer.precision casts it
    norms.convert_norm(model, cfg.batchnorm.convert, cfg.batchnorm.groups)
    losses.check(loss, model, first.to(models.weights_device(model)), cfg.data.target)
    if cfg.trainer.activation_checkpointing:
        if wrapped := enable_activation_checkpointing(model):
            log.info(f"activation checkpointing: {wrapped} blocks recompute their activations in backward")
        else:
            log.warning("trainer.activation_checkpointing=true does nothing for this model: it has no blocks to "
                        "wrap (modules with parameters inside an nn.Sequential or nn.ModuleList)")
    strategy.check_model(model, cfg.batchnorm.convert)
    model = model.to(device=strategy.model_device(device), dtype=precision.param_dtype)
    log.info(f"model {models.model_name(node)}: {models.count_parameters(model):,} parameters, "
             f"on {device}" + (f" × {world.size} ranks" if world.size > 1 else "")
             + (f", precision {precision.name}" if precision.name != "32" else ""))
    return model, loss, supplied, base


def make_strategy(cfg: TrainConfig, world: World, device: torch.device, precision: Precision) -> Strategy:
    """The strategy `strategy=` names, for this rank (FSDP's module is imported only when it is chosen)."""
    if cfg.strategy.name == "fsdp":
        from accutrain.parallel.fsdp import FSDP

        return FSDP(cfg.strategy, world, device, precision)
    return Strategy(world, device)
