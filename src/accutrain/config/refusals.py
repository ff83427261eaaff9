"""The table of refused combinations: an option (a loss family, a strategy, a way of making samples), the other keys
it cannot be combined with, and the remedy. It is checked on the typed run before PyTorch loads (config.validate),
so a refused combination is one line in about two seconds, before the run directory exists.

A new loss family that refuses something adds its entry here — one entry, its rows — and nothing elsewhere."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from accutrain.config.train import TrainConfig
from accutrain.core.options import RouterAux
from accutrain.errors import UserError

CONTRASTIVE = "accutrain.core.contrastive.contrastive"
MOE = "accutrain.core.moe.moe"

Test = Callable[[TrainConfig], bool]


@dataclass(frozen=True)
class Row:
    """`other` (the key as typed, with the run's value: a callable formats it) refused beside the entry's option."""

    when: Test
    other: str | Callable[[TrainConfig], str]
    remedy: str


@dataclass(frozen=True)
class Entry:
    """An option (`key`, as a user types it) and the combinations it refuses."""

    key: str
    chosen: Test
    rows: tuple[Row, ...]


def effective_batch(c: TrainConfig) -> int | None:
    """micro_batch × accum × devices (or global_batch) where the config alone decides it."""
    if c.global_batch is not None:
        return c.global_batch
    if isinstance(c.micro_batch, int) and isinstance(c.devices, int) and c.batch_schedule is None:
        return c.micro_batch * (c.accum or 1) * c.devices
    return None


def lora(c: TrainConfig, key: str) -> Any:
    """model.lora.<key> (None where the model has no such node, or leaves it to PEFT)."""
    node = c.model.get("lora")
    return node.get(key) if isinstance(node, Mapping) else None


def random_views(c: TrainConfig) -> bool:
    """Whether augment= draws anything per sample (a flip left to `auto` may: the data decides)."""
    a = c.augment
    return a.crop.name != "none" or a.flip in (True, "auto") or a.policy is not None or a.random_erasing > 0


TABLE: tuple[Entry, ...] = (
    Entry("loss=contrastive", lambda c: c.loss.target == CONTRASTIVE, (
        Row(lambda c: c.strategy.name == "fsdp", "strategy=fsdp", "use strategy=ddp"),
        Row(lambda c: c.micro_batch == "auto", "micro_batch=auto", "give micro_batch=N (or micro_tokens=N for text "
            "pairs)"),
        Row(lambda c: c.micro_tokens == "auto", "micro_tokens=auto", "give micro_tokens=N"),
        Row(lambda c: c.trainer.accum_dtype is not None or c.trainer.offload_grads,
            "trainer.accum_dtype / trainer.offload_grads", "leave them unset"),
        Row(lambda c: c.augment.mixup_alpha > 0 or c.augment.cutmix_alpha > 0, "augment.mixup_alpha / cutmix_alpha",
            "set them to 0: pairs are not mixed"),
        Row(lambda c: c.trainer.noise_scale, "trainer.noise_scale=true", "a micro-batch's gradient of a window-level "
            "loss is not an estimate of the window's (its negatives come from the whole window): set "
            "trainer.noise_scale=false"),
        Row(lambda c: effective_batch(c) == 1, lambda c: f"an effective batch of {effective_batch(c)}",
            "a window of one pair has no negative: its loss is 0 whatever the weights; give global_batch=N, N ≥ 2"),
    )),
    Entry("augment.views=2", lambda c: c.augment.views == 2, (
        Row(lambda c: c.loss.target != CONTRASTIVE, lambda c: f"loss={c.loss.target.rsplit('.', 1)[-1]}",
            "pairs of views are for loss=contrastive: set augment.views=1, or loss=contrastive"),
        Row(lambda c: not random_views(c), "augment=none (no random crop, flip, policy or erasing)",
            "augment.views=2 needs two different random views of each image: set a random augment= (e.g. "
            "augment=crop_flip)"),
    )),
    Entry("strategy=fsdp", lambda c: c.strategy.name == "fsdp", (
        Row(lambda c: c.micro_batch == "auto", "micro_batch=auto", "a trial step that runs out of memory on one "
            "rank would leave the others waiting in FSDP's collectives; give micro_batch=N"),
        Row(lambda c: c.micro_tokens == "auto", "micro_tokens=auto", "a trial step that runs out of memory on one "
            "rank would leave the others waiting in FSDP's collectives; give micro_tokens=N"),
        Row(lambda c: c.trainer.offload_grads, "trainer.offload_grads=true", "use strategy.cpu_offload=true, which "
            "keeps the sharded weights, gradients and optimizer state in host memory"),
        Row(lambda c: c.trainer.accum_dtype is not None, lambda c: f"trainer.accum_dtype={c.trainer.accum_dtype}",
            "with trainer.precision=bf16-mixed FSDP already reduces and accumulates gradients in float32"),
        Row(lambda c: str(c.trainer.precision) == "16-mixed", "trainer.precision=16-mixed", "float16 with a "
            "GradScaler is not verified with FSDP; use bf16-mixed"),
        Row(lambda c: c.batchnorm.sync, "batchnorm.sync=true", "use batchnorm.convert=group or "
            "batchnorm.convert=frozen"),
        Row(lambda c: c.trainer.ema_device is not None, lambda c: f"trainer.ema_device={c.trainer.ema_device}",
            "the average is sharded like the weights (1/devices of it per rank); strategy.cpu_offload=true keeps "
            "both in host memory"),
        Row(lambda c: c.trainer.channels_last, "trainer.channels_last=true", "PyTorch's fully_shard takes contiguous "
            "parameters only; use strategy=ddp"),
        Row(lambda c: c.trainer.compile, "trainer.compile=true", "compiling the model inside FSDP's sharding is not "
            "verified with accutrain's exact accumulation; use strategy=ddp to compile"),
        Row(lambda c: c.trainer.noise_scale, "trainer.noise_scale=true", "FSDP's gradients are sharded and reduced "
            "as they arrive, so a micro-batch's own gradient is never whole on a rank; use strategy=ddp to measure "
            "the noise scale"),
        Row(lambda c: c.model.get("adapter") is not None, lambda c: f"model.adapter={c.model.get('adapter')}",
            "sharding a frozen base with its adapter is not verified with adapter-only checkpoints; use "
            "strategy=ddp, which reduces only the adapter's gradients"),
        Row(lambda c: c.trainer.export is not None, lambda c: f"trainer.export={c.trainer.export}", "exporting "
            "needs the whole model in one process; load the run's full checkpoint (strategy.checkpoint=full) into "
            "the model and export that"),
    )),
    Entry("model.adapter=lora", lambda c: c.model.get("adapter") == "lora", (
        Row(lambda c: lora(c, "alpha") == 0, "model.lora.alpha=0", "LoRA's update is scaled by alpha / r, so it is "
            "zero whatever the adapter learns and the run would end with the model it started from: give "
            "model.lora.alpha > 0 (null: PEFT's 8)"),
        Row(lambda c: lora(c, "r") is not None and lora(c, "r") < 1, lambda c: f"model.lora.r={lora(c, 'r')}",
            "the adapter's matrices have rank r: give model.lora.r ≥ 1 (null: PEFT's 8)"),
        Row(lambda c: lora(c, "dropout") is not None and not 0 <= lora(c, "dropout") < 1,
            lambda c: f"model.lora.dropout={lora(c, 'dropout'):g}", "a dropout of 1 (or more) drops every input of "
            "the adapter, so its update is zero: give a probability in [0, 1)"),
        Row(lambda c: lora(c, "target_modules") is not None and not lora(c, "target_modules"),
            "model.lora.target_modules=[]", "no layer would carry an adapter, so nothing would train: name the layers "
            "(null: PEFT's defaults for the architecture)"),
    )),
    Entry("data.streaming=true", lambda c: bool(c.data.get("streaming")), (
        Row(lambda c: c.trainer.max_steps is None, "trainer.max_steps=null", "a stream's length is known only at its "
            "end: give trainer.max_steps=N, the run's length (trainer.epochs then caps the passes over the stream)"),
        Row(lambda c: c.data.get("val") is None, "data.val=null", "a stream is not split: give the held-out records "
            "as data.val=<a file or a dataset name>"),
        Row(lambda c: c.data.get("packing") not in (False, None), lambda c: f"data.packing={c.data.get('packing')}",
            "packing lays its blocks out over the whole training set; set data.packing=false"),
        Row(lambda c: c.micro_batch == "auto", "micro_batch=auto", "give micro_batch=N"),
        Row(lambda c: c.micro_tokens == "auto", "micro_tokens=auto", "a stream's longest samples are not known before "
            "it is read; give micro_tokens=N"),
        Row(lambda c: c.batch_schedule is not None, "batch_schedule", "a schedule is laid out over the training "
            "set's size; use a fixed batch (micro_batch × accum)"),
        Row(lambda c: c.loader.num_workers not in ("auto", 0), lambda c: f"loader.num_workers={c.loader.num_workers}",
            "the stream is read, and its windows cut, in the training process; leave loader.num_workers=auto"),
    )),
    Entry("data.padding=free", lambda c: c.data.get("padding") == "free", (
        Row(lambda c: getattr(c.loss.get("normalize"), "value", None) == "sequences", "loss.normalize=sequences",
            "a padding-free row holds several samples end to end, and the loss sees one row; use "
            "data.padding=longest"),
        Row(lambda c: c.loss.target == CONTRASTIVE, "loss=contrastive", "text pairs embed each text in a row of its "
            "own; use data.padding=longest"),
        Row(lambda c: c.model.get("neftune_alpha") is not None,
            lambda c: f"model.neftune_alpha={c.model.get('neftune_alpha')}", "NEFTune draws each sample's noise "
            "over its own row; use data.padding=longest"),
    )),
    Entry("model.kernels=liger", lambda c: c.model.get("kernels") == "liger", (
        Row(lambda c: c.trainer.device == "cpu", "trainer.device=cpu", "Liger Kernel's Triton kernels need a CUDA "
            "GPU: drop model.kernels (model.logits=chunked keeps the logits from being held whole on any device)"),
    )),
    Entry("loss=moe", lambda c: c.loss.target == MOE, (
        Row(lambda c: c.model.target.startswith("accutrain.models.") and c.model.target != "accutrain.models.hf."
            "causal_lm", lambda c: f"model._target_={c.model.target}", "loss=moe balances the router of a "
            "mixture-of-experts language model: use model=hf_causal_lm with a mixture-of-experts config (e.g. "
            "+model.config.model_type=mixtral), or loss=cross_entropy"),
        Row(lambda c: c.strategy.name == "fsdp", "strategy=fsdp", "the window's routing counts are not verified "
            "with FSDP's sharded forwards; use strategy=ddp"),
    )),
    Entry("loss.router_aux=model", lambda c: c.loss.target == MOE and c.loss.get("router_aux") is RouterAux.model, (
        Row(lambda c: c.data.get("packing") is True, "data.packing=true", "the model's own balancing loss reads a "
            "block packed by documents as one sequence and its 4-D attention mask as padding: use "
            "loss.router_aux=window, which counts each document's tokens (or data.packing=false)"),
    )),
    Entry("model.quantize=4bit", lambda c: c.model.get("quantize") is not None, (
        Row(lambda c: c.trainer.device == "cpu", "trainer.device=cpu", "QLoRA needs a CUDA GPU and bitsandbytes: "
            "drop model.quantize to train LoRA on the unquantized weights"),
    )),
)


def refuse_combinations(c: TrainConfig) -> None:
    """The first refused combination of the run's options, as one UserError."""
    for entry in TABLE:
        if not entry.chosen(c):
            continue
        for row in entry.rows:
            if row.when(c):
                other = row.other(c) if callable(row.other) else row.other
                raise UserError(f"{entry.key} cannot be combined with {other}: {row.remedy}")


def rows() -> list[tuple[str, Row]]:
    """Every row of the table with its option (the tests run each through the command line)."""
    return [(entry.key, row) for entry in TABLE for row in entry.rows]
