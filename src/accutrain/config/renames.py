"""Keys that moved to nodes of their own (so that the model, data, optim and sched nodes hold only their factory's
arguments): the old spelling on a command line still works, rewritten to the new one with a one-line notice."""
from __future__ import annotations

from typing import Callable, Optional

RENAMED = {
    "model.norm": "batchnorm.convert",
    "model.norm_groups": "batchnorm.groups",
    "model.sync_batchnorm": "batchnorm.sync",
    "data.num_workers": "loader.num_workers",
    "data.input_keys": "loader.input_keys",
    "data.target_key": "loader.target_key",
    "optim.lr_scaling": "scaling.lr",
    "optim.base_batch": "scaling.base_batch",
}


def notice(old: str, value: str = "") -> str:
    new = RENAMED[old] + (f"={value}" if value else "")
    return f"{old} is now {RENAMED[old]}: write {new} (the old spelling stops working in a later version)"


def renamed(overrides: list[str], say: Optional[Callable[[str], None]] = None) -> list[str]:
    """`overrides` with each moved key (`model.norm=group`, `+optim.base_batch=32`, `~data.num_workers`) spelled
    as its new home, each rewrite said once through `say`. Hydra's own flags and other keys are left alone."""
    out = []
    for arg in overrides:
        body = arg.lstrip("+~")
        key, eq, value = body.partition("=")
        if arg.startswith("-") or key not in RENAMED:
            out.append(arg)
            continue
        if say is not None:
            say(notice(key, value))
        prefix = arg[: len(arg) - len(body)]
        out.append(f"{prefix.replace('+', '') if prefix.startswith('+') else prefix}{RENAMED[key]}{eq}{value}")
    return out
