"""The callable a `_target_` names (module.attribute), imported — with the homes of paths that moved (said once in
the log) and one clear line for what cannot be imported. Imports nothing of the config, so the registry of loss
families and the models' traits can load a user's plug-in without a cycle."""
from __future__ import annotations

import importlib
import logging
import os
import traceback
from typing import Any, Callable, Optional

from accutrain.errors import UserError, one_line

log = logging.getLogger("accutrain")


# accutrain 0.1's flat modules that a `_target_` may still name (a saved config, a user's yaml), and their homes since
# the package was layered; the built-in models' and data's factories kept their paths (accutrain.models.mlp, …).
MOVED = {
    "accutrain.optim": "accutrain.models.optim", "accutrain.sched": "accutrain.models.sched",
    "accutrain.hf": "accutrain.models.hf", "accutrain.ema": "accutrain.models.ema",
    "accutrain.text": "accutrain.data.text", "accutrain.views": "accutrain.data.views",
    "accutrain.tokenizer": "accutrain.data.tokenizer", "accutrain.batches": "accutrain.core.batches",
    "accutrain.sweep": "accutrain.report.sweep", "accutrain.metrics": "accutrain.train.metrics",
    "accutrain.core.contrastive": "accutrain.core.losses.contrastive", "accutrain.core.moe": "accutrain.core.losses.moe",
}


# The loss factories of accutrain.core.losses before it was a package of families (a saved config may name them).
RENAMED = {f"accutrain.core.losses.{name}": f"accutrain.core.losses.{module}.{name}" for module, names in
           (("cross_entropy", ("cross_entropy",)), ("elements", ("mse", "l1", "huber", "bce", "custom")))
           for name in names}


def moved(target: str) -> str:
    """`target` with a module of accutrain 0.1 replaced by its new home (said once in the log), else itself."""
    if target in RENAMED:
        log.warning(f"{target} is now {RENAMED[target]} (the old path stops working in a later version)")
        return RENAMED[target]
    for old, new in MOVED.items():
        if target.startswith(old + "."):
            log.warning(f"{target}: {old} is now {new}; write {new + target[len(old):]} (the old path stops working "
                        "in a later version)")
            return new + target[len(old):]
    return target


def load_target(key: str, target: str) -> Callable[..., Any]:
    """The callable a `_target_` names (module.attribute); one clear line when it cannot be imported."""
    parts = moved(target).split(".")
    first_error: Optional[ImportError] = None
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError as e:
            if isinstance(e, ModuleNotFoundError) and e.name is not None and not ".".join(parts[:i]).startswith(
                    e.name):  # the module exists but imports something missing: say so, not "cannot import it"
                raise UserError(f"{key}={target}: importing {'.'.join(parts[:i])} raised {one_line(e)}") from e
            first_error = first_error or e
            continue
        except Exception as e:  # a SyntaxError, or the module raising while it is imported
            raise UserError(f"{key}={target}: importing {'.'.join(parts[:i])} raised {one_line(e)}"
                            f"{where(e)}") from e
        for j, attr in enumerate(parts[i:]):
            if not hasattr(obj, attr):
                raise UserError(f"{key}={target}: {'.'.join(parts[: i + j])} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        if not callable(obj):
            raise UserError(f"{key}={target} is not callable: expected a class or function")
        return obj
    raise UserError(f"{key}={target}: cannot import it ({first_error or 'expected module.attribute'})")


def where(error: BaseException) -> str:
    """` (file.py:12)`: where in the user's file an import failed (a SyntaxError's line, else the last frame)."""
    if isinstance(error, SyntaxError) and error.filename:
        return f" ({os.path.basename(error.filename)}:{error.lineno})"
    frames = traceback.extract_tb(error.__traceback__)
    return f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
