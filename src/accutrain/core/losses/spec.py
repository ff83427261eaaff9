"""What a loss family declares once, torch-free, for the config to read before PyTorch loads: its option's name and
factory, its config node (schema), its traits, the metrics its evaluation measures and the combinations it refuses.

A family is its module (the maths and the Loss members, accutrain.core.loss) and a spec module beside it,
`<family>_spec.py`, holding `FAMILIES = (Family(...), …)`; accutrain.config.families discovers every spec module of
this package. The rest of accutrain asks a family's traits, never its name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

# What |W| counts under loss.normalize=auto: samples, the target's elements, or what the model's factory says
# (`loss_defaults`: tokens for a language model, else samples).
TERMS = ("samples", "elements", "model")
OUTPUTS = ("logits", "embeddings")


@dataclass(frozen=True)
class Traits:
    """A family as the config, the data, the build and the loop ask it — never by its name. A Loss object carries the
    same facts as attributes (whole_window, min_window, output, task); a plug-in family's class declares them."""

    task: str = "custom"  # what its evaluation measures (Family.metrics), trainer.monitor's default
    whole_window: bool = False  # a sample's loss depends on the window's other samples: the window is seen whole
    caches_window: bool = False  # it keeps rows of every sample of the window between two passes (gradient
    # caching): its memory grows with the window, so a micro-batch's trial step cannot size it
    output: str = "logits"  # what the model returns for it: logits (per class or target element) | embeddings
    min_window: int = 1  # the fewest samples a window must hold for the loss to mean anything
    pairs: bool = False  # a sample is a pair (an anchor and its positive, …; or two views of an image)
    class_targets: bool = False  # its targets are class indices, bounded by the data's classes (checked at start)
    terms: str = "samples"  # what |W| counts under loss.normalize=auto (TERMS)

    def __post_init__(self) -> None:
        if self.terms not in TERMS or self.output not in OUTPUTS or self.min_window < 1:
            raise ValueError(f"invalid traits {self}: terms in {TERMS}, output in {OUTPUTS}, min_window ≥ 1")


@dataclass(frozen=True)
class Refusal:
    """A refused combination: `when(run, traits)` is true for the run's typed config; `other` names what the user
    typed (a callable formats it from the run); `remedy` says what to do instead (a callable: from the run and the
    loss's traits)."""

    when: Callable[[Any, Traits], bool]
    other: str | Callable[[Any], str]
    remedy: str | Callable[[Any, Traits], str]


@dataclass
class LossNode:
    """What every family's node has: the target value the data pads element targets with (data=text, hf and
    sequences read it), which the loss then neither sums nor counts."""

    ignore_index: int = -100  # target elements equal to this count neither in the loss nor in the mean


@dataclass(frozen=True)
class Family:
    """One loss family, declared once (see the module's docstring)."""

    name: str  # the option: loss=<name> (configs/loss/<name>.yaml)
    target: str  # its factory: the node's `_target_` (the same string as the schema's default)
    schema: type  # its config node, a dataclass extending LossNode (registered as loss/<name>_schema)
    traits: Traits
    metrics: tuple[str, ...] = ("val_loss",)  # what its evaluation measures, val_loss first
    higher_is_better: tuple[str, ...] = ()  # which of them trainer.monitor maximises
    refusals: tuple[Refusal, ...] = ()  # what this family cannot be combined with (beyond the traits' rows)
    vary: Optional[Callable[[Mapping[str, Any], Traits], Traits]] = None  # traits that depend on the node's values
    values: Optional[Callable[[Mapping[str, Any]], None]] = None  # its ranges a type cannot express (UserError)

    def traits_of(self, node: Mapping[str, Any]) -> Traits:
        """The traits of this family for one run's node (`vary` adjusts the declared ones)."""
        return self.vary(node, self.traits) if self.vary is not None else self.traits
