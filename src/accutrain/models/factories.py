"""Model factories selected by `model=`: torchvision classifiers by name, small mlp/cnn, or a user `_target_`."""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from accutrain.config import model_traits
from accutrain.config.targets import instantiate, run_arguments
from accutrain.core.batches import Batch, as_batch
from accutrain.core.chunked_ce import Projection
from accutrain.errors import UserError, one_line

log = logging.getLogger("accutrain")


def mlp(num_classes: int, in_channels: int, image_size: int, hidden: list[int], dropout: float = 0.0) -> nn.Module:
    """Flatten, then Linear+ReLU(+Dropout) per hidden width, then the classifier."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_channels * image_size * image_size
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else [])
        width = h
    return nn.Sequential(*layers, nn.Linear(width, num_classes))


def cnn(num_classes: int, in_channels: int, channels: list[int], dropout: float = 0.0) -> nn.Module:
    """3×3 conv+ReLU+2×2 max-pool per width, global average pool, classifier; takes any image size."""
    layers: list[nn.Module] = []
    prev = in_channels
    for c in channels:
        layers += [nn.Conv2d(prev, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True)]
        prev = c
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()] + ([nn.Dropout(dropout)] if dropout else [])
    return nn.Sequential(*layers, nn.Linear(prev, num_classes))


class CharLM(nn.Module):
    """Embedding, GRU, and a classifier per position; logits in cross_entropy's layout (batch, classes, length)."""

    def __init__(self, vocab_size: int, num_classes: int, embedding: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embedding)
        self.rnn = nn.GRU(embedding, hidden, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        states, _ = self.rnn(self.embed(tokens))
        return self.head(states).transpose(1, 2)


def char_lm(vocab_size: int, num_classes: int, embedding: int = 32, hidden: int = 64) -> nn.Module:
    """A small character-level language model for accutrain's generated sequences (next-token targets)."""
    return CharLM(vocab_size, num_classes, embedding, hidden)


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _first(model: nn.Module, kind: type) -> tuple[str, nn.Module]:
    return next((n, m) for n, m in model.named_modules() if isinstance(m, kind))


def _adapt_input_channels(model: nn.Module, in_channels: int) -> None:
    """Give the first convolution `in_channels` inputs; pretrained filters are summed/spread over them."""
    name, conv = _first(model, nn.Conv2d)
    if conv.in_channels == in_channels:
        return
    new = nn.Conv2d(in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                    conv.dilation, conv.groups, conv.bias is not None)
    with torch.no_grad():  # keeps pretrained filters useful: their response to a grey image is unchanged
        new.weight.copy_(conv.weight.sum(1, keepdim=True).expand_as(new.weight) / in_channels)
        if conv.bias is not None:
            new.bias.copy_(conv.bias)
    replace_module(model, name, new)


def _replace_head(model: nn.Module, num_classes: int) -> None:
    """Swap the last Linear layer (the classifier of every torchvision classifier but squeezenet) for a new one."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if linears:
        name, head = linears[-1]
        if head.out_features != num_classes:
            replace_module(model, name, nn.Linear(head.in_features, num_classes))
        return
    name, conv = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)][-1]  # squeezenet
    replace_module(model, name, nn.Conv2d(conv.in_channels, num_classes, conv.kernel_size))


def torchvision_classifier(
    name: str, num_classes: int, in_channels: int, image_size: int, pretrained: bool = False,
    small_input: bool | None = None,
) -> nn.Module:
    """Any torchvision classification model by name, sized to the data's channels and classes.

    small_input (default: images of 32 px or less) gives ResNet-like models the CIFAR stem: a 3×3 stride-1
    first convolution and no max-pool, so 8×8 or 32×32 images are not shrunk to nothing before layer 1.
    """
    import torchvision

    known = torchvision.models.list_models(module=torchvision.models)
    if name not in known:
        raise UserError(
            f"model.name={name!r} is not a torchvision classification model; valid names include "
            f"{', '.join(n for n in ('resnet18', 'resnet50', 'mobilenet_v3_small', 'efficientnet_b0', 'vit_b_16'))}"
            f" … ({len(known)} in torchvision.models.list_models())"
        )
    if pretrained:
        try:
            model = torchvision.models.get_model(name, weights="DEFAULT")
        except (OSError, RuntimeError) as e:  # URLError is an OSError
            raise UserError(f"could not load pretrained weights for {name}: {e} (needs internet once, "
                            "then they are cached under $TORCH_HOME)") from None
        _replace_head(model, num_classes)
    else:
        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    if getattr(model, "aux_logits", False):  # inception/googlenet: train-mode auxiliary outputs are not used
        model.aux_logits = False
    _adapt_input_channels(model, in_channels)
    if small_input is None:
        small_input = image_size <= 32
    if small_input and isinstance(getattr(model, "conv1", None), nn.Conv2d) and hasattr(model, "maxpool"):
        model.conv1 = nn.Conv2d(in_channels, model.conv1.out_channels, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    return model


def data_arguments(cfg: Any, sample_shape: tuple[int, ...], num_classes: int, extra: Optional[dict] = None
                   ) -> dict[str, Any]:
    """The data's arguments (num_classes, in_channels, image_size, and `extra`: vocab_size, …) that the model's
    `_target_` takes and its node does not set."""
    from_data: dict[str, Any] = dict(num_classes=num_classes, **(extra or {}))
    if len(sample_shape) == 3:
        from_data.update(in_channels=sample_shape[0], image_size=sample_shape[1])
    return run_arguments("model", cfg, from_data)


def loss_defaults(cfg: Any) -> dict[str, Any]:
    """What the model's factory (or class) says loss.normalize=auto and loss.shift_labels=null become (its
    `loss_defaults`: model=hf_causal_lm's tokens and shifted labels), else nothing."""
    return model_traits.loss_defaults(cfg)


def build_model(cfg: Any, sample_shape: tuple[int, ...], num_classes: int, extra: Optional[dict] = None,
                example: Optional[Batch | tuple[Any, torch.Tensor]] = None, logits: bool = True) -> nn.Module:
    """Instantiate the model node `cfg` (`_target_` and its keyword arguments) with the data's arguments that it
    takes (data_arguments; a run records them in its node first).

    A dry forward pass (on two samples of the data, `example`, or two blank images) checks that the model takes
    the data and returns one logit per class (per element: at least one per class, in dimension 1), so a mismatch
    is one clear line now rather than a traceback in the first step; a model of embeddings (`logits` false: the
    loss compares its outputs with each other) is checked by the loss instead.
    """
    node = {**dict(cfg), **data_arguments(cfg, sample_shape, num_classes, extra)}
    try:
        model = instantiate("model", node)
    except UserError:
        raise
    except TypeError as e:  # most often a keyword argument it does not take
        raise UserError(f"model._target_={cfg['_target_']}: {e}") from e
    except Exception as e:  # the user's model failing in __init__: one line here, its traceback in train.log
        raise UserError(f"the model {cfg['_target_']} raised {one_line(e)} while being built") from e
    if not isinstance(model, nn.Module):
        raise UserError(f"model._target_={cfg['_target_']} returned {type(model).__name__}, not a torch.nn.Module")
    check_positions(model, sample_shape)
    if example is None:
        example = Batch(torch.zeros(2, *sample_shape), torch.zeros(2, dtype=torch.int64))
    example = as_batch(example).to(weights_device(model))  # a 4-bit model: on the GPU
    name = model_name(cfg)
    if not logits:
        return model
    model.eval()
    check_output(model, example, num_classes, name)
    target = example.target
    per_class = not target.is_floating_point()  # float targets (values, multi-hot, soft) have no class layout
    if per_class and target.dim() > 1 and num_classes in target.shape[1:]:  # (batch, length, classes) would pass too
        length = target.shape[1]
        shorter = example.apply(lambda t: t[:, : length - 1] if t.dim() > 1 and t.shape[1] == length else t)
        check_output(model, shorter, num_classes, name, second=True)
    model.train()
    return model


def check_positions(model: nn.Module, sample_shape: tuple[int, ...]) -> None:
    """Token data's data.max_length (its samples' shape) within the positions the model has, or one line: a longer
    sample would fail in its position embeddings — at the first long one, an evaluation maybe, hours in."""
    limit = getattr(model, "max_positions", None)
    if limit is not None and len(sample_shape) == 1 and sample_shape[0] > limit[1]:
        key, positions = limit
        raise UserError(f"data.max_length={sample_shape[0]} is more than the model's {positions} positions "
                        f"({key}): a longer sample would not fit its position embeddings; set data.max_length ≤ "
                        f"{positions}")


def check_output(model: nn.Module, example: Batch, num_classes: int, name: str, second: bool = False) -> None:
    """Forward `example` (no gradient) and refuse, in one line, an exception or logits that are not one per class
    (per sample, or per element in cross_entropy's layout: batch, classes, elements…)."""
    shape = " and ".join("×".join(map(str, t.shape[1:])) for t in example.tensors())
    try:
        with torch.no_grad():
            out = example.forward(model)
    except Exception as e:  # whatever the model raises: one line naming it (its traceback stays for train.log)
        first = (str(e).strip().splitlines() or [""])[0]
        if second:
            log.warning(f"the model's output has as many positions as classes ({num_classes}), so its layout "
                        f"(batch, classes, length) cannot be told from (batch, length, classes), and it fails on a "
                        f"shorter input ({type(e).__name__}: {first}): make sure its classes are in dimension 1")
            return
        if type(e) is RuntimeError and any(word in first for word in ("shape", "size", "channels", "dimension")):
            raise UserError(f"model {name} does not take {shape} inputs ({type(e).__name__}: {first}); choose a "
                            "model for this input size or other data") from e
        raise UserError(f"the model {name} raised {one_line(e)} in forward, on a batch of {len(example.target)} "
                        f"{shape} inputs") from e
    y, n = example.target, len(example.target)
    if isinstance(out, Projection):  # a causal LM's hidden states and head: its logits' shape, never computed
        out = torch.empty(out.shape, device="meta")
    if not isinstance(out, torch.Tensor):
        hint = (": a Hugging Face ModelOutput — use model=hf_causal_lm or model=hf_seq_cls, or return its .logits "
                "from your forward" if hasattr(out, "logits") else "")
        raise UserError(f"model {name} returns a {type(out).__name__}, not a tensor of logits{hint}")
    got, per_element = tuple(out.shape), y.dim() > 1
    if y.is_floating_point():  # values, multi-hot or soft targets: one output per target element
        if got[:1] == (n,) and out[0].numel() == y[0].numel():
            return
        raise UserError(f"the model returns {got} for a batch of {n}, expected {tuple(y.shape)}: one output per "
                        "target element")
    expected = (n, num_classes, *y.shape[1:])
    if got == expected or (per_element and len(got) == len(expected) and got[0] == n and got[1] >= num_classes
                           and got[2:] == expected[2:]):
        return
    message = (f"the model returns {got} for a batch of {n}, expected {expected}: one logit per class of the data"
               + (" per element (classes in dimension 1)" if per_element else ""))
    if per_element and got == (n, *y.shape[1:], num_classes):
        message += ("; its classes are last (batch, length, classes): return logits.transpose(1, 2), "
                    "cross_entropy's layout")
        if second:
            message += (f" (a length equal to the {num_classes} classes hid it: checked again on "
                        f"{y.shape[1]} positions)")
    raise UserError(message)


def weights_device(model: nn.Module) -> torch.device:
    """Where the model's weights are (a 4-bit model's on the GPU as soon as it is loaded), else the CPU."""
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def model_name(cfg: Any) -> str:
    """How the log names the configured model: its name, its Hugging Face name or model type, or its _target_."""
    config = cfg.get("config")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return cfg.get("name") or cfg.get("name_or_path") or (f"{model_type} (random init)" if model_type else
                                                          cfg["_target_"])


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
