"""The typed config: the trainer's and the top level's schemas, those of `strategy/`, `logger/` and
`batch_schedule/` (the model, augment, optim and sched schemas are in accutrain.config.schemas, the data's in
accutrain.config.data_schemas, the loss families' in their specs: accutrain.config.families), registering
them all in Hydra's ConfigStore, where the yaml files live, and composing them.

Every built-in group option (`configs/model/*.yaml`, …) starts from one of these schemas, so an unknown key
or a wrong type is refused by name when Hydra composes the config, before anything runs. The checks a type
cannot express are in accutrain.config.validate.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from accutrain.config import families
from accutrain.config.data_schemas import (
    DigitsData,
    HFData,
    ImageFolderData,
    SequenceData,
    SyntheticData,
    TextData,
    TorchvisionData,
)
from accutrain.config.logger_schemas import CSVTracker, MLflowTracker, TensorBoardTracker, WandBTracker
from accutrain.config.renames import renamed
from accutrain.config.schemas import (
    MISSING,
    AdamWOptim,
    AugmentConfig,
    BatchNormConfig,
    CharLMModel,
    CNNModel,
    ConstantSched,
    CosineSched,
    HFCausalLMModel,
    HFEncoderModel,
    HFSeqClsModel,
    LoaderConfig,
    MLPModel,
    ScalingConfig,
    SGDOptim,
    TorchvisionModel,
)
from accutrain.core.options import LastWindow

if TYPE_CHECKING:
    from omegaconf import DictConfig


class OnNonFinite(enum.Enum):
    stop = "stop"  # stop with a clear line naming the step
    skip = "skip"  # drop the window's gradients: no optimizer or scheduler step; counted and logged


class Sync(enum.Enum):
    each = "each"  # strategy=fsdp: reduce-scatter every micro-batch's gradients; only the shards stay between
    last = "last"  # … only the window's last one: one reduction per step; unsharded gradients stay between


class CheckpointFormat(enum.Enum):
    full = "full"  # rank 0 gathers everything into one file (torch.load(weights_only=True) reads it)
    sharded = "sharded"  # one directory (PyTorch Distributed Checkpoint), each rank writes its own shard


class ScheduleUnit(enum.Enum):
    samples = "samples"  # batch_schedule.at counts samples seen
    epochs = "epochs"  # … epochs (× the training set)
    fraction = "fraction"  # … a fraction of the run's training samples (trainer.epochs × the training set)


class Ramp(enum.Enum):
    linear = "linear"  # interpolate between the points
    step = "step"  # hold each batch until the next point


# --- strategy/ ----------------------------------------------------------------------------------------
# How the ranks share the model; accutrain applies every key itself.
@dataclass
class StrategyConfig:
    name: str = MISSING  # ddp | fsdp: chosen with strategy=ddp|fsdp, which brings that strategy's keys


@dataclass
class DDPStrategy(StrategyConfig):
    name: str = "ddp"  # every rank holds the whole model, gradients and optimizer state


@dataclass
class FSDPStrategy(StrategyConfig):
    name: str = "fsdp"  # PyTorch FSDP2: parameters, gradients and optimizer state sharded across the ranks
    wrap: Optional[List[str]] = None  # class names of the modules sharded as units; null: the repeated blocks
    sync: Sync = Sync.each  # each | last: reduce-scatter gradients every micro-batch, or on the window's last only
    reshard_after_forward: bool = True  # free the gathered parameters after forward (gathered again in backward)
    cpu_offload: bool = False  # weights, gradients and the optimizer step in host memory (CPUOffloadPolicy)
    checkpoint: CheckpointFormat = CheckpointFormat.full  # full: one file by rank 0 | sharded: a DCP directory


# --- trainer and the top level ------------------------------------------------------------------------
@dataclass
class TrainerConfig:
    epochs: Optional[int] = 5
    max_steps: Optional[int] = None  # optimizer steps; training stops at whichever of the two comes first
    last_window: LastWindow = LastWindow.step
    grad_clip: Optional[float] = None  # max global gradient norm, applied once per optimizer step
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    eval_every: Optional[int] = None  # optimizer steps between evaluations; null: at the end of every epoch
    eval_batch: Optional[int] = None  # null: micro_batch
    log_every: int = 50  # optimizer steps between log lines in train.log (metrics.jsonl gets every step)
    progress: bool = True  # the tqdm bar (counts optimizer steps)
    checkpoint_every: Optional[int] = None  # optimizer steps; a checkpoint is also written at the end and on SIGTERM
    checkpoint_minutes: Optional[float] = 10.0  # also after this many minutes, and at every epoch end (null: neither)
    keep_checkpoints: int = 3  # step-*.pt files kept in checkpoints/ (last.pt is the newest)
    on_nonfinite: OnNonFinite = OnNonFinite.stop  # a NaN/Inf loss or gradient in a window
    precision: str = "32"  # 32 | bf16-mixed | 16-mixed (autocast; 16: GradScaler) | bf16-true (bf16 weights)
    accum_dtype: Optional[str] = None  # float32: sum half-precision gradients in float32 buffers
    activation_checkpointing: bool = False  # recompute activations in backward
    offload_grads: bool = False  # keep the accumulating gradients in (pinned) CPU memory between micro-batches
    memory_budget_mb: Optional[float] = None  # micro_batch=auto: the memory a trial step may peak at (CPU: needed)
    check: bool = False  # run accutrain-check's comparison on the first window before training
    ema: Optional[float] = None  # decay of an exponential moving average of the weights (e.g. 0.999); null: none
    ema_warmup: bool = False  # decay min(ema, (1 + n) / (10 + n)) after n updates: the average forgets its start
    ema_device: Optional[str] = None  # where the average lives: null beside the weights, or cpu
    noise_scale: bool = False  # the gradient noise scale B_simple per optimizer step (accutrain.train.noise_scale)
    noise_scale_decay: float = 0.95  # the moving averages of its |G|² and tr Σ estimates, per optimizer step
    monitor: str = "auto"  # the evaluation metric best.pt and early stopping follow; auto: the loss's (core/monitor)
    monitor_mode: Optional[str] = None  # min | max; null: max for accuracies, min for losses
    early_stopping: Optional[int] = None  # patience: stop after this many evaluations without improvement
    min_delta: float = 0.0  # an improvement must exceed this to count
    deterministic: bool = False  # deterministic cuDNN/cuBLAS algorithms: bit-identical resume on CUDA too
    tf32: Optional[bool] = None  # float32 matmuls and convolutions on CUDA in TF32 (true) or full float32 (false)
    dist_timeout_s: float = 1800.0  # how long the other ranks wait for rank-0-only work (download, check, checkpoint)
    # Signals that stop the run after the current optimizer step, with a checkpoint (a cluster's preemption notice;
    # under submitit the job is then requeued and resumes).
    preempt_signals: List[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"])
    # The grace a stop signal leaves before the kill: a window that would end within half of it is finished, a longer
    # one abandoned (its partial gradients dropped, the last completed step checkpointed; the resume redoes it).
    stop_grace_s: float = 60.0
    export: Optional[str] = None  # weights: the model's weights alone, <run dir>/model.safetensors, at the end; hf:
    # save_pretrained (model and tokenizer; an adapter as PEFT saves it) into the run directory's hf/; merged: an
    # adapted model with its adapter merged into the weights
    overwrite: bool = False  # start afresh in a run directory an earlier run used, deleting what it wrote
    tune_malloc: bool = True  # CPU on glibc: keep freed activations in the heap (no page faults per micro-batch)
    threads: Any = None  # PyTorch's threads: null (its default, or OMP_NUM_THREADS) | N | auto (what the load leaves)
    compile: bool = False  # torch.compile the model once (in place, before DDP); the short tail recompiles at most once
    compile_mode: Optional[str] = None  # torch.compile's mode: default | reduce-overhead | max-autotune | …
    compile_backend: str = "inductor"  # torch.compile's backend (aot_eager: no code generation, for debugging)
    channels_last: bool = False  # the model's 4-D weights and the 4-D inputs in channels_last (NHWC) memory format


# --- batch_schedule/ -------------------------------------------------------------------------------------
@dataclass
class BatchScheduleConfig:
    at: List[float] = MISSING  # where each point begins, in `unit`; ascending, the first 0
    batch: List[int] = MISSING  # the effective batch from each point on (multiples of micro_batch × devices)
    unit: ScheduleUnit = ScheduleUnit.fraction
    ramp: Ramp = Ramp.linear


@dataclass
class TrainConfig:
    model: Any = MISSING
    data: Any = MISSING
    optim: Any = MISSING
    sched: Any = MISSING
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    strategy: Any = MISSING
    loss: Any = MISSING  # loss=<family> (configs/loss/; the families: accutrain.config.families)
    batchnorm: BatchNormConfig = field(default_factory=BatchNormConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    logger: Dict[str, Any] = field(default_factory=dict)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # Batch arithmetic: effective batch = micro_batch x accum x devices. Typed Any so that accutrain, not
    # OmegaConf, explains a bad value (see validate).
    micro_batch: Any = 32
    accum: Any = None  # null: derived from global_batch, else 1
    devices: Any = 1
    global_batch: Any = None
    micro_tokens: Any = None  # null: micro_batch samples; N: cut each window by ≤ N tokens; auto: the largest that fits
    seed: int = 0
    resume: Optional[str] = None  # a checkpoint path, or auto: the newest good one in this run directory
    batch_schedule: Optional[BatchScheduleConfig] = None  # the effective batch by samples seen; null: fixed


SCHEMAS = {
    (None, "train_schema"): TrainConfig,
    ("model", "torchvision_schema"): TorchvisionModel,
    ("model", "mlp_schema"): MLPModel,
    ("model", "cnn_schema"): CNNModel,
    ("model", "char_lm_schema"): CharLMModel,
    ("model", "hf_causal_lm_schema"): HFCausalLMModel,
    ("model", "hf_seq_cls_schema"): HFSeqClsModel,
    ("model", "hf_encoder_schema"): HFEncoderModel,
    ("data", "digits_schema"): DigitsData,
    ("data", "synthetic_schema"): SyntheticData,
    ("data", "torchvision_schema"): TorchvisionData,
    ("data", "image_folder_schema"): ImageFolderData,
    ("data", "sequences_schema"): SequenceData,
    ("data", "text_schema"): TextData,
    ("data", "hf_schema"): HFData,
    ("optim", "sgd_schema"): SGDOptim,
    ("optim", "adamw_schema"): AdamWOptim,
    ("sched", "constant_schema"): ConstantSched,
    ("sched", "cosine_schema"): CosineSched,
    ("strategy", "ddp_schema"): DDPStrategy,
    ("strategy", "fsdp_schema"): FSDPStrategy,
    ("batch_schedule", "schedule_schema"): BatchScheduleConfig,
    ("augment", "augment_schema"): AugmentConfig,
    ("logger", "csv_schema"): CSVTracker,
    ("logger", "tensorboard_schema"): TensorBoardTracker,
    ("logger", "mlflow_schema"): MLflowTracker,
    ("logger", "wandb_schema"): WandBTracker,
}


# The config groups whose option is a node of keys: a factory's `_target_` and its keyword arguments (model, data,
# optim, sched, loss; each logger.<name> a tracker's), or the strategy's settings.
GROUP_NODES = ("model", "data", "optim", "sched", "loss", "strategy", "logger")


@functools.cache
def register_schemas() -> None:
    """Put the schemas in Hydra's ConfigStore, once per process (storing converts every dataclass to a config: a
    tenth of a second, which every composition would otherwise pay again); the yaml files name them in their
    defaults."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for (group, name), node in {**SCHEMAS, **families.schemas()}.items():
        cs.store(group=group, name=name, node=node)


def config_dir() -> Path:
    """The configs: inside the package in a wheel, at the repository's top level in an editable install."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "configs", package.parent.parent / "configs"):
        if (candidate / "train.yaml").is_file():
            return candidate
    raise RuntimeError(f"accutrain's configs are missing (looked in {package / 'configs'}): reinstall accutrain")


def compose(*overrides: str, hydra: bool = False) -> DictConfig:
    """The config `accutrain <overrides>` would run with, composed in this process (tests, scripts); with hydra=True
    it includes the `hydra` node (launcher, sweeper, callbacks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schemas()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=renamed(list(overrides)), return_hydra_config=hydra)
