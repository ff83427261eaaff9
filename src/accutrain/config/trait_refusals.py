"""The refusals keyed on a loss family's traits (accutrain.core.losses.spec.Traits), never on its name: every family
with the trait refuses the same options — a window-level loss FSDP and the noise scale, one that caches the window
the trial steps and gradient buffers, one over pairs MixUp and padding-free rows — then the family's own rows (its
spec). accutrain.config.refusals' table asks them for the run's loss."""
from __future__ import annotations

from accutrain.config import families, model_traits
from accutrain.config.train import TrainConfig
from accutrain.core.losses.spec import Refusal as Row


def effective_batch(c: TrainConfig) -> int | None:
    """micro_batch × accum × devices (or global_batch) where the config alone decides it."""
    if c.global_batch is not None:
        return c.global_batch
    if isinstance(c.micro_batch, int) and isinstance(c.devices, int) and c.batch_schedule is None:
        return c.micro_batch * (c.accum or 1) * c.devices
    return None


def trait_rows(c: TrainConfig) -> tuple[Row, ...]:
    """The run's loss family's own refusals (its spec; none for a plug-in), then the rows every family with a trait
    refuses."""
    family = families.family_of(c.loss)
    return (family.refusals if family is not None else ()) + TRAIT_ROWS


TRAIT_ROWS: tuple[Row, ...] = (
    Row(lambda c, t: t.whole_window and c.strategy.name == "fsdp", "strategy=fsdp", "a loss over the whole window is "
        "not verified with FSDP's sharded forwards and backwards; use strategy=ddp"),
    Row(lambda c, t: t.whole_window and c.trainer.noise_scale, "trainer.noise_scale=true", "a micro-batch's gradient "
        "of a window-level loss is not an estimate of the window's (its loss depends on the whole window): set "
        "trainer.noise_scale=false"),
    Row(lambda c, t: t.caches_window and c.micro_batch == "auto", "micro_batch=auto", "its memory grows with the "
        "window (it keeps every sample's embeddings between two passes), which a micro-batch's trial step does not "
        "measure: give micro_batch=N (or micro_tokens=N for text pairs)"),
    Row(lambda c, t: t.caches_window and c.micro_tokens == "auto", "micro_tokens=auto", "its memory grows with the "
        "window (it keeps every sample's embeddings between two passes), which a trial step does not measure: give "
        "micro_tokens=N"),
    Row(lambda c, t: t.caches_window and (c.trainer.accum_dtype is not None or c.trainer.offload_grads),
        "trainer.accum_dtype / trainer.offload_grads", "its second pass backpropagates the window's cached gradient "
        "through each micro-batch, outside the gradient buffers' accounting: leave them unset"),
    Row(lambda c, t: t.pairs and (c.augment.mixup_alpha > 0 or c.augment.cutmix_alpha > 0),
        "augment.mixup_alpha / cutmix_alpha", "set them to 0: pairs are not mixed"),
    Row(lambda c, t: t.pairs and c.data.get("padding") == "free", "data.padding=free", "a pair embeds each of its "
        "texts in a row of its own; use data.padding=longest"),
    Row(lambda c, t: (effective_batch(c) or t.min_window) < t.min_window,
        lambda c: f"an effective batch of {effective_batch(c)}", lambda c, t: f"every window must hold the "
        f"{t.min_window} samples the loss needs at least (a window of one pair has no negative: its loss is 0 "
        f"whatever the weights); give global_batch=N, N ≥ {t.min_window}"),
    Row(lambda c, t: c.trainer.noise_scale and families.counts_elements(
        c.loss, t, model_traits.loss_defaults(c.model).get("normalize") == "tokens"), "trainer.noise_scale=true",
        "the noise scale measures gradients per sample, and this loss averages over elements (tokens): set "
        "loss.normalize=samples or trainer.noise_scale=false"),
)
