"""The schemas of what is trained and how it descends: the config groups `model/`, `augment/`, `optim/`, `sched/` and
the nodes `batchnorm`, `loader`, `scaling` (the `data/` group's are in accutrain.config.data_schemas, the `loss/`
group's are each family's, in accutrain.core.losses' spec modules),
as dataclasses in Hydra's ConfigStore (accutrain.config.train registers them with the others), so that an unknown
key or a wrong type is refused by name when the config is composed.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from accutrain.core.options import Beta2Scaling, LRScaling, MixMode

MISSING = "???"  # a value the user must give: OmegaConf reads this string as missing (omegaconf.MISSING)


class Norm(enum.Enum):
    keep = "keep"  # the model's own normalisation layers
    group = "group"  # BatchNorm → GroupNorm (batchnorm.groups): statistics per sample, exact under accumulation
    frozen = "frozen"  # BatchNorm kept in eval mode: fixed running statistics (fine-tuning pretrained weights)


# --- model/, optim/, sched/: factory nodes --------------------------------------------------------
# Each holds a `_target_` and its keyword arguments only, so that hydra.utils.instantiate builds it from a run's
# config.yaml (which also records the arguments taken from the data: num_classes, in_channels, …). What accutrain
# applies around the factories has nodes of its own: batchnorm, loader, scaling.
@dataclass
class ModelConfig:
    _target_: str = MISSING


@dataclass
class TorchvisionModel(ModelConfig):
    _target_: str = "accutrain.models.torchvision_classifier"
    name: str = MISSING  # any name in torchvision.models.list_models()
    pretrained: bool = False
    small_input: Optional[bool] = None  # 3x3 stride-1 stem without max-pool; null: when images are <= 32 px


@dataclass
class MLPModel(ModelConfig):
    _target_: str = "accutrain.models.mlp"
    hidden: List[int] = field(default_factory=lambda: [256, 256])
    dropout: float = 0.0


@dataclass
class CNNModel(ModelConfig):
    _target_: str = "accutrain.models.cnn"
    channels: List[int] = field(default_factory=lambda: [32, 64])
    dropout: float = 0.0


@dataclass
class CharLMModel(ModelConfig):
    _target_: str = "accutrain.models.char_lm"
    embedding: int = 32
    hidden: int = 64


@dataclass
class LoRAConfig:
    """model.lora: PEFT's LoraConfig (r, lora_alpha, lora_dropout, target_modules); null: PEFT's default."""

    r: Optional[int] = None  # the rank (PEFT: 8)
    alpha: Optional[float] = None  # the scale is alpha / r (PEFT: 8)
    dropout: Optional[float] = None  # PEFT: 0 — a non-zero one draws per micro-batch (warned when the window is cut)
    target_modules: Optional[List[str]] = None  # layer names; null: PEFT's defaults for the architecture


@dataclass
class HFModel(ModelConfig):
    """A Hugging Face transformers model (the `hf` extra): pretrained, or randomly initialised from a config."""

    _target_: str = MISSING
    name_or_path: Optional[str] = None  # a Hub name or a local directory (a save_pretrained output)
    pretrained: bool = True  # with name_or_path: its weights; false: its architecture, randomly initialised
    config: Dict[str, Any] = field(default_factory=dict)  # config overrides; without name_or_path: model_type + sizes
    dropout: Optional[float] = None  # null: the model's own; 0 (or p): every dropout probability set to it
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto: the weights as loaded (training: trainer.precision)
    attn_implementation: Optional[str] = None  # eager | sdpa | flash_attention_2 …; null: the library's choice
    trust_remote_code: bool = False
    revision: Optional[str] = None  # a Hub branch, tag or commit
    adapter: Optional[str] = None  # lora (the peft extra): train adapters, the model frozen; null: train it all
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    quantize: Optional[str] = None  # 4bit: QLoRA (CUDA + bitsandbytes; with adapter=lora and pretrained weights)


@dataclass
class HFCausalLMModel(HFModel):
    _target_: str = "accutrain.models.hf.causal_lm"
    neftune_alpha: Optional[float] = None  # NEFTune: noise on the input embeddings in training, drawn per sample
    logits: str = "chunked"  # chunked: the loss takes hidden states and head, a chunk of tokens at a time | full
    kernels: Optional[str] = None  # liger: Liger Kernel's RMSNorm, RoPE, SwiGLU and fused cross-entropy (CUDA)


@dataclass
class HFSeqClsModel(HFModel):
    _target_: str = "accutrain.models.hf.seq_cls"
    neftune_alpha: Optional[float] = None  # NEFTune, as hf_causal_lm's


@dataclass
class HFEncoderModel(HFModel):
    _target_: str = "accutrain.models.hf_encoder.encoder"
    pooling: str = "mean"  # mean | cls | last (decoder embedders): the token states pooled into one embedding
    normalize: bool = True  # L2-normalised embeddings (cosine similarity), as sentence-transformers' Normalize


# --- optim/ and sched/ --------------------------------------------------------------------------------
@dataclass
class OptimConfig:
    _target_: str = MISSING
    lr: float = MISSING
    weight_decay: float = 0.0


@dataclass
class SGDOptim(OptimConfig):
    _target_: str = "accutrain.models.optim.sgd"
    lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4


@dataclass
class AdamWOptim(OptimConfig):
    _target_: str = "accutrain.models.optim.adamw"
    lr: float = 1e-3
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01


@dataclass
class SchedConfig:
    _target_: str = MISSING
    warmup_steps: int = 0


@dataclass
class ConstantSched(SchedConfig):
    _target_: str = "accutrain.models.sched.constant"


@dataclass
class CosineSched(SchedConfig):
    _target_: str = "accutrain.models.sched.cosine"
    min_lr_ratio: float = 0.0  # final lr as a fraction of the peak lr


# --- what accutrain applies around the factories ---------------------------------------------------------------
@dataclass
class BatchNormConfig:
    """What becomes of the model's BatchNorm layers, whose statistics see a micro-batch, not the window."""

    convert: Norm = Norm.keep  # keep | group | frozen
    groups: int = 32  # convert=group: groups per GroupNorm (the largest divisor of the channels ≤ this)
    sync: bool = False  # BatchNorm → SyncBatchNorm when devices > 1: statistics over every rank's micro-batch (CUDA)


@dataclass
class LoaderConfig:
    """How samples become micro-batches: loader processes, and which keys of mapping items feed the model."""

    num_workers: Any = "auto"  # auto: min(4, cores per device − 1) for data read or decoded per item, else 0
    input_keys: Optional[List[str]] = None  # mapping items: the model's keyword inputs; null: all but target_key
    target_key: str = "labels"  # mapping items: the target


@dataclass
class ScalingConfig:
    """Hyperparameters that follow the effective batch, relative to the batch they were tuned for."""

    lr: LRScaling = LRScaling.none  # none | linear | sqrt: optim.lr × (effective batch / base_batch), or its root
    base_batch: Optional[int] = None  # the effective batch optim.lr was tuned for (needed by linear and sqrt)
    beta2: Beta2Scaling = Beta2Scaling.none  # half_life: Adam's β2 ** (effective batch / base_batch)
    ema: bool = False  # true: trainer.ema's decay ** (effective batch / base_batch)


# --- augment/ ------------------------------------------------------------------------------------------
class Crop(enum.Enum):
    none = "none"  # the fixed view's geometry
    pad = "pad"  # pad `padding` pixels, then a random crop back to the image size (CIFAR)
    resized = "resized"  # RandomResizedCrop(image size, scale, ratio) (ImageNet)
    auto = "auto"  # resized for data=imagefolder (photos of any size), pad otherwise


@dataclass
class AugmentConfig:
    """The training view of each image (torchvision transforms.v2), drawn per sample from (seed, epoch, sample), and
    MixUp/CutMix, drawn per window from (seed, epoch, window). Evaluation is never augmented."""

    crop: Crop = Crop.none
    padding: Any = "auto"  # crop=pad: pixels, or auto: round(image size / 8), at least 1 (CIFAR's 4 on 32 px)
    scale: List[float] = field(default_factory=lambda: [0.08, 1.0])  # crop=resized: the crop's area, of the image's
    ratio: List[float] = field(default_factory=lambda: [0.75, 4 / 3])  # crop=resized: its aspect ratio
    flip: Any = False  # random horizontal flip (p=0.5): true | false | auto (where a mirror keeps the classes)
    policy: Optional[str] = None  # trivialaugment | randaugment | null
    num_ops: int = 2  # policy=randaugment
    magnitude: int = 9  # policy=randaugment
    random_erasing: float = 0.0  # the probability of erasing a random rectangle (after normalisation)
    eval_crop_ratio: float = 1.0  # evaluation: resize to image_size / this, centre-crop image_size
    mixup_alpha: float = 0.0  # MixUp's Beta(α, α); 0: off
    cutmix_alpha: float = 0.0  # CutMix's Beta(α, α); 0: off
    mix_prob: float = 1.0  # the probability that a window (mix_mode=window) or a sample is mixed
    switch_prob: float = 0.5  # with both on: the probability of CutMix rather than MixUp
    mix_mode: MixMode = MixMode.window
    views: int = 1  # 2: two random views of each sample, drawn from (seed, epoch, sample, view): loss=contrastive
