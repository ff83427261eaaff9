"""The table of refused combinations: an option (the run's loss, a strategy, a way of making samples, an export), the
other keys it cannot be combined with, and the remedy. It is checked on the typed run before PyTorch loads
(config.validate), so a refused combination is one line in about two seconds, before the run directory exists.

The run's loss is asked its traits (accutrain.config.families), never its name: the rows of `TRAIT_ROWS` hold for
every family with the trait — a window-level loss, one that caches the window, one whose samples are pairs — and a
family's own refusals come from its spec. A new family adds nothing here."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from accutrain.config import families, model_traits
from accutrain.config.train import TrainConfig
from accutrain.config.trait_refusals import TRAIT_ROWS, trait_rows
from accutrain.core.losses.spec import Refusal as Row
from accutrain.core.losses.spec import Traits
from accutrain.core.options import Beta2Scaling, LRScaling
from accutrain.core.plan import derive_accum
from accutrain.errors import UserError

Test = Callable[[TrainConfig, Traits], bool]


@dataclass(frozen=True)
class Entry:
    """An option (`key`, as a user types it) and the combinations it refuses."""

    key: str | Callable[[TrainConfig], str]  # a callable names it with the run's value (the run's loss)
    chosen: Callable[[TrainConfig], bool]
    rows: tuple[Row, ...] | Callable[[TrainConfig], tuple[Row, ...]]
    label: str = ""  # the option's key, where `key` is a callable (the tests name the rows by it)


def lora(c: TrainConfig, key: str) -> Any:
    """model.lora.<key> (None where the model has no such node, or leaves it to PEFT)."""
    node = c.model.get("lora")
    return node.get(key) if isinstance(node, Mapping) else None


def random_views(c: TrainConfig) -> bool:
    """Whether augment= draws anything per sample (a flip left to `auto` may: the data decides)."""
    a = c.augment
    return a.crop.name != "none" or a.flip in (True, "auto") or a.policy is not None or a.random_erasing > 0


BASE_BATCH = "it needs scaling.base_batch, the effective batch {} was tuned for (e.g. scaling.base_batch=32)"
SCHEDULED = ("the schedule sets the effective batch of every window (accum follows from it and micro_batch × "
             "devices): drop ")
TOKEN_BUDGET = ("micro_tokens cuts each window by a token budget and {} sizes micro-batches by samples: use one of "
                "them (micro_tokens with global_batch=N, or micro_batch × accum)")
NOISE_SCALE_NEEDS_TWO = ("the noise scale compares each micro-batch's gradient with the window's, the same with one "
                         "micro-batch per window: set accum ≥ 2 (or devices ≥ 2) or trainer.noise_scale=false")


def one_micro_batch(c: TrainConfig) -> bool:
    """A window of one micro-batch on one process, where the config alone decides it (a torchrun or SLURM world's
    devices=1 is its default, not its size: the build checks the real world)."""
    return (c.devices == 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1 and isinstance(c.micro_batch, int)
            and c.batch_schedule is None and c.micro_tokens is None
            and derive_accum(c.micro_batch, 1, c.accum, c.global_batch) == 1)


TABLE: tuple[Entry, ...] = (
    Entry(lambda c: f"resume={c.resume}", lambda c: c.resume is not None, label="resume", rows=(
        Row(lambda c, t: c.trainer.overwrite, "trainer.overwrite=true", "resume continues the run directory's earlier "
            "run and trainer.overwrite=true deletes the run directory's earlier run: choose one"),
    )),
    Entry("batch_schedule", lambda c: c.batch_schedule is not None, (
        Row(lambda c, t: c.accum is not None, lambda c: f"accum={c.accum}", lambda c, t: SCHEDULED + f"accum={c.accum}"),
        Row(lambda c, t: c.global_batch is not None, lambda c: f"global_batch={c.global_batch}",
            lambda c, t: SCHEDULED + f"global_batch={c.global_batch}"),
    )),
    Entry(lambda c: f"micro_tokens={c.micro_tokens}", lambda c: c.micro_tokens is not None, label="micro_tokens", rows=(
        Row(lambda c, t: c.micro_batch == "auto", "micro_batch=auto", TOKEN_BUDGET.format("micro_batch=auto")),
        Row(lambda c, t: c.batch_schedule is not None, "batch_schedule", TOKEN_BUDGET.format("batch_schedule")),
    )),
    Entry("micro_batch=auto", lambda c: c.micro_batch == "auto", (
        Row(lambda c, t: c.global_batch is None and c.batch_schedule is None, "global_batch=null", "it keeps the "
            "effective batch while it finds the largest micro-batch that fits: give global_batch=N"),
        Row(lambda c, t: c.accum is not None, lambda c: f"accum={c.accum}", lambda c, t: "micro_batch=auto derives "
            f"accum from global_batch: drop accum={c.accum}"),
    )),
    Entry(lambda c: f"scaling.lr={c.scaling.lr.name}", lambda c: c.scaling.lr is not LRScaling.none, label="scaling.lr",
          rows=(
        Row(lambda c, t: c.scaling.base_batch is None, "scaling.base_batch=null", BASE_BATCH.format("optim.lr")),
    )),
    Entry(lambda c: f"scaling.beta2={c.scaling.beta2.name}", lambda c: c.scaling.beta2 is not Beta2Scaling.none,
          label="scaling.beta2", rows=(
        Row(lambda c, t: c.scaling.base_batch is None, "scaling.base_batch=null", BASE_BATCH.format("optim.betas")),
        Row(lambda c, t: "betas" not in c.optim, lambda c: f"optim._target_={c.optim.target}", "it scales Adam's β2, "
            "and this optimizer has no betas: use optim=adamw (an Adam of your own: give +optim.betas=[0.9,0.999]) "
            "or scaling.beta2=none"),
    )),
    Entry("scaling.ema=true", lambda c: c.scaling.ema, (
        Row(lambda c, t: c.trainer.ema is None, "trainer.ema=null", "it scales the decay of trainer.ema, which is "
            "off: set trainer.ema (e.g. trainer.ema=0.999) or scaling.ema=false"),
        Row(lambda c, t: c.scaling.base_batch is None, "scaling.base_batch=null", BASE_BATCH.format("trainer.ema")),
    )),
    Entry(lambda c: f"trainer.monitor={c.trainer.monitor}", lambda c: c.trainer.monitor.endswith("_ema"),
          label="trainer.monitor", rows=(
        Row(lambda c, t: c.trainer.ema is None, "trainer.ema=null", lambda c, t: "it is never measured without an "
            f"average of the weights: set trainer.ema (e.g. trainer.ema=0.999) or monitor "
            f"{c.trainer.monitor.removesuffix('_ema')}"),
    )),
    Entry("trainer.noise_scale=true", lambda c: c.trainer.noise_scale, (
        Row(lambda c, t: one_micro_batch(c), "accum=1 on one device", NOISE_SCALE_NEEDS_TWO),
    )),
    Entry(lambda c: f"trainer.compile_mode={c.trainer.compile_mode}", lambda c: c.trainer.compile_mode is not None,
          label="trainer.compile_mode", rows=(
        Row(lambda c, t: not c.trainer.compile, "trainer.compile=false", "a mode of torch.compile does nothing "
            "without trainer.compile=true"),
    )),
    Entry(lambda c: families.option(c.loss), lambda c: True, trait_rows),
    Entry("augment.views=2", lambda c: c.augment.views == 2, (
        Row(lambda c, t: not t.pairs, lambda c: families.option(c.loss), "pairs of views are for a loss whose samples "
            "are pairs (loss=contrastive, loss=triplet): set augment.views=1, or such a loss"),
        Row(lambda c, t: not random_views(c), "augment=none (no random crop, flip, policy or erasing)",
            "augment.views=2 needs two different random views of each image: set a random augment= (e.g. "
            "augment=crop_flip)"),
    )),
    Entry("strategy=fsdp", lambda c: c.strategy.name == "fsdp", (
        Row(lambda c, t: c.micro_batch == "auto", "micro_batch=auto", "a trial step that runs out of memory on one "
            "rank would leave the others waiting in FSDP's collectives; give micro_batch=N"),
        Row(lambda c, t: c.micro_tokens == "auto", "micro_tokens=auto", "a trial step that runs out of memory on one "
            "rank would leave the others waiting in FSDP's collectives; give micro_tokens=N"),
        Row(lambda c, t: c.trainer.offload_grads, "trainer.offload_grads=true", "use strategy.cpu_offload=true, which "
            "keeps the sharded weights, gradients and optimizer state in host memory"),
        Row(lambda c, t: c.trainer.accum_dtype is not None, lambda c: f"trainer.accum_dtype={c.trainer.accum_dtype}",
            "with trainer.precision=bf16-mixed FSDP already reduces and accumulates gradients in float32"),
        Row(lambda c, t: str(c.trainer.precision) == "16-mixed", "trainer.precision=16-mixed", "float16 with a "
            "GradScaler is not verified with FSDP; use bf16-mixed"),
        Row(lambda c, t: c.batchnorm.sync, "batchnorm.sync=true", "use batchnorm.convert=group or "
            "batchnorm.convert=frozen"),
        Row(lambda c, t: c.trainer.ema_device is not None, lambda c: f"trainer.ema_device={c.trainer.ema_device}",
            "the average is sharded like the weights (1/devices of it per rank); strategy.cpu_offload=true keeps "
            "both in host memory"),
        Row(lambda c, t: c.trainer.channels_last, "trainer.channels_last=true", "PyTorch's fully_shard takes contiguous "
            "parameters only; use strategy=ddp"),
        Row(lambda c, t: c.trainer.compile, "trainer.compile=true", "compiling the model inside FSDP's sharding is not "
            "verified with accutrain's exact accumulation; use strategy=ddp to compile"),
        Row(lambda c, t: c.trainer.noise_scale, "trainer.noise_scale=true", "FSDP's gradients are sharded and reduced "
            "as they arrive, so a micro-batch's own gradient is never whole on a rank; use strategy=ddp to measure "
            "the noise scale"),
        Row(lambda c, t: c.model.get("adapter") is not None, lambda c: f"model.adapter={c.model.get('adapter')}",
            "sharding a frozen base with its adapter is not verified with adapter-only checkpoints; use "
            "strategy=ddp, which reduces only the adapter's gradients"),
        Row(lambda c, t: c.trainer.export is not None, lambda c: f"trainer.export={c.trainer.export}", "exporting "
            "needs the whole model in one process; load the run's full checkpoint (strategy.checkpoint=full) into "
            "the model and export that"),
    )),
    Entry("model.adapter=lora", lambda c: c.model.get("adapter") == "lora", (
        Row(lambda c, t: lora(c, "alpha") == 0, "model.lora.alpha=0", "LoRA's update is scaled by alpha / r, so it is "
            "zero whatever the adapter learns and the run would end with the model it started from: give "
            "model.lora.alpha > 0 (null: PEFT's 8)"),
        Row(lambda c, t: lora(c, "r") is not None and lora(c, "r") < 1, lambda c: f"model.lora.r={lora(c, 'r')}",
            "the adapter's matrices have rank r: give model.lora.r ≥ 1 (null: PEFT's 8)"),
        Row(lambda c, t: lora(c, "dropout") is not None and not 0 <= lora(c, "dropout") < 1,
            lambda c: f"model.lora.dropout={lora(c, 'dropout'):g}", "a dropout of 1 (or more) drops every input of "
            "the adapter, so its update is zero: give a probability in [0, 1)"),
        Row(lambda c, t: lora(c, "target_modules") is not None and not lora(c, "target_modules"),
            "model.lora.target_modules=[]", "no layer would carry an adapter, so nothing would train: name the layers "
            "(null: PEFT's defaults for the architecture)"),
    )),
    Entry("data.streaming=true", lambda c: bool(c.data.get("streaming")), (
        Row(lambda c, t: c.trainer.max_steps is None, "trainer.max_steps=null", "a stream's length is known only at its "
            "end: give trainer.max_steps=N, the run's length (trainer.epochs then caps the passes over the stream)"),
        Row(lambda c, t: c.data.get("val") is None, "data.val=null", "a stream is not split: give the held-out records "
            "as data.val=<a file or a dataset name>"),
        Row(lambda c, t: c.data.get("packing") not in (False, None), lambda c: f"data.packing={c.data.get('packing')}",
            "packing lays its blocks out over the whole training set; set data.packing=false"),
        Row(lambda c, t: c.micro_batch == "auto", "micro_batch=auto", "give micro_batch=N"),
        Row(lambda c, t: c.micro_tokens == "auto", "micro_tokens=auto", "a stream's longest samples are not known before "
            "it is read; give micro_tokens=N"),
        Row(lambda c, t: c.batch_schedule is not None, "batch_schedule", "a schedule is laid out over the training "
            "set's size; use a fixed batch (micro_batch × accum)"),
        Row(lambda c, t: c.loader.num_workers not in ("auto", 0), lambda c: f"loader.num_workers={c.loader.num_workers}",
            "the stream is read, and its windows cut, in the training process; leave loader.num_workers=auto"),
    )),
    Entry("data.padding=free", lambda c: c.data.get("padding") == "free", (
        Row(lambda c, t: getattr(c.loss.get("normalize"), "value", None) == "sequences", "loss.normalize=sequences",
            "a padding-free row holds several samples end to end, and the loss sees one row; use "
            "data.padding=longest"),
        Row(lambda c, t: c.model.get("neftune_alpha") is not None,
            lambda c: f"model.neftune_alpha={c.model.get('neftune_alpha')}", "NEFTune draws each sample's noise "
            "over its own row; use data.padding=longest"),
    )),
    Entry("model.kernels=liger", lambda c: c.model.get("kernels") == "liger", (
        Row(lambda c, t: c.trainer.device == "cpu", "trainer.device=cpu", "Liger Kernel's Triton kernels need a CUDA "
            "GPU: drop model.kernels (model.logits=chunked keeps the logits from being held whole on any device)"),
    )),
    Entry("model.quantize=4bit", lambda c: c.model.get("quantize") is not None, (
        Row(lambda c, t: c.trainer.device == "cpu", "trainer.device=cpu", "QLoRA needs a CUDA GPU and bitsandbytes: "
            "drop model.quantize to train LoRA on the unquantized weights"),
    )),
    Entry(lambda c: f"trainer.export={c.trainer.export}", lambda c: c.trainer.export in ("hf", "merged"),
          label="trainer.export", rows=(
        Row(lambda c, t: model_traits.pretrained_format(c.model) is False, lambda c: f"model._target_={c.model.target}",
            "it needs a Hugging Face model (model=hf_causal_lm, hf_seq_cls or hf_encoder); trainer.export=weights "
            "saves any model's weights"),
        Row(lambda c, t: c.trainer.export == "merged" and model_traits.builtin(c.model) and
            c.model.get("adapter") is None, "model.adapter=null", "merged merges an adapter into the model: set "
            "model.adapter=lora (trainer.export=hf saves a model trained whole)"),
    )),
)


def refuse_combinations(c: TrainConfig, traits: Traits | None = None) -> None:
    """The first refused combination of the run's options, as one UserError; `traits`: the run's loss's, where the
    build knows them (a plug-in family's, once made), else the config's."""
    traits = traits or families.traits_of(c.loss)
    for entry in TABLE:
        if not entry.chosen(c):
            continue
        for row in entry.rows(c) if callable(entry.rows) else entry.rows:
            if row.when(c, traits):
                key = entry.key(c) if callable(entry.key) else entry.key
                other = row.other(c) if callable(row.other) else row.other
                remedy = row.remedy(c, traits) if callable(row.remedy) else row.remedy
                raise UserError(f"{key} cannot be combined with {other}: {remedy}")


def rows() -> list[tuple[str, Row]]:
    """Every row of the table with its option — the run's loss's rows under `the run's loss`, each family's own
    under loss=<name> — for the tests, which run each through the command line."""
    fixed = [(entry.key, row) for entry in TABLE if isinstance(entry.key, str) for row in entry.rows]
    own = [(f"loss={f.name}", row) for f in families.families() for row in f.refusals]
    for entry in TABLE:
        if callable(entry.key) and not callable(entry.rows):
            fixed += [(entry.label, row) for row in entry.rows]
    return [("the run's loss", row) for row in TRAIT_ROWS] + own + fixed
