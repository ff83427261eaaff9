"""NEFTune (`model.neftune_alpha`, Jain et al. 2023): uniform noise added to the input embeddings in training, scaled
by alpha / sqrt(L × d) — L the sample's own tokens, d the embedding width.

The exact version of what the Hugging Face Trainer offers: each training sample's noise is drawn from a generator
seeded by the sample (its `sample_seed`, from (seed, epoch, sample): accutrain.core.windows), over its own tokens
only, and scaled by its own length — never by the micro-batch's padded length or its place in it — so that any split
of the window (`micro_batch=4 accum=4`, `micro_batch=16`, two devices) adds the same noise to every sample, and a
resumed run the same as the uninterrupted one. Held-out batches (evaluation) get none.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from accutrain.errors import UserError


class Noise:
    """The per-sample draws of one forward: the samples' seeds and lengths, taken from the model's inputs."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.seeds: Optional[torch.Tensor] = None
        self.lengths: Optional[torch.Tensor] = None

    def take(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """The model's forward pre-hook: `sample_seed` taken out of its inputs (the model does not know it), the
        samples' lengths read from the attention mask (before packed documents make it 4-D)."""
        seeds = kwargs.pop("sample_seed", None)
        mask = kwargs.get("attention_mask")
        self.seeds = seeds if module.training else None
        if seeds is not None:
            width = kwargs["input_ids"].shape[1]
            self.lengths = (mask.sum(dim=1) if mask is not None and mask.dim() == 2
                            else torch.full_like(seeds, width))
        return args, kwargs

    def add(self, module: nn.Module, args: tuple, embeds: torch.Tensor) -> torch.Tensor:
        """The embedding layer's forward hook: each sample's noise added over its own tokens."""
        if self.seeds is None or not module.training:
            return embeds
        width = embeds.shape[-1]
        noise = torch.zeros_like(embeds, dtype=torch.float32)
        for row, (seed, length) in enumerate(zip(self.seeds.tolist(), self.lengths.tolist())):
            if length:
                g = torch.Generator(device=embeds.device).manual_seed(seed)
                drawn = torch.rand(length, width, generator=g, device=embeds.device, dtype=torch.float32)
                noise[row, :length] = (2 * drawn - 1) * (self.alpha / math.sqrt(length * width))
        return embeds + noise.to(embeds.dtype)


def check(alpha: Optional[float]) -> None:
    """model.neftune_alpha: null or a positive scale, or one line."""
    if alpha is not None and not alpha > 0:
        raise UserError(f"model.neftune_alpha={alpha} is not valid: expected a positive noise scale (the NEFTune "
                        "paper uses 5, 10 or 15), or null")


def attach(model: nn.Module, inner: nn.Module, alpha: Optional[float]) -> None:
    """NEFTune on `model` (the adapter accutrain calls), whose Hugging Face model `inner` has input embeddings;
    `model.sample_seeds` asks the training loader for each sample's seed (accutrain.core.windows)."""
    if alpha is None:
        return
    embeddings = inner.get_input_embeddings()
    if embeddings is None:
        raise UserError("model.neftune_alpha adds noise to the input embeddings; this model has none")
    noise = Noise(float(alpha))
    model.register_forward_pre_hook(noise.take, with_kwargs=True)
    embeddings.register_forward_hook(noise.add)
    model.sample_seeds = True
