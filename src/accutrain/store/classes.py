"""The data's class names by output index: the log's words for them, and how a run records them — checkpoints and
status.json under `classes` (a list: entry i names output i), exported weights in their safetensors metadata (the
same list as JSON), a Hugging Face export in its config's id2label."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

from accutrain.errors import UserError

SHOWN = 12  # the log names this many classes, then counts the rest (status.json lists every one)


def describe(names: Sequence[str]) -> str:
    """The data line's words for the classes: ` (0 cat, 1 dog, 2 owl)`, the first SHOWN of many then a count; ''
    when the data has no names."""
    if not names:
        return ""
    shown = ", ".join(f"{i} {name}" for i, name in enumerate(names[:SHOWN]))
    more = f", … {len(names) - SHOWN} more (status.json: classes)" if len(names) > SHOWN else ""
    return f" ({shown}{more})"


def record(names: Sequence[str]) -> Optional[list[str]]:
    """What checkpoints and status.json hold under `classes`: the names in output order, or None without names."""
    return [str(name) for name in names] or None


def metadata(names: Sequence[str]) -> dict[str, str]:
    """The exported weights' metadata entry (safetensors metadata is text): {'classes': the JSON list}, or {}."""
    return {"classes": json.dumps(record(names))} if names else {}


def from_weights(path: Path) -> Optional[list[str]]:
    """The class names an exported model.safetensors records (None when it records none)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        found: Any = (f.metadata() or {}).get("classes")
    return json.loads(found) if found else None


def refuse_other_classes(path: Any, saved: Optional[list[str]], now: Optional[list[str]]) -> None:
    """A resume continues on the classes the checkpoint was trained on: other names, or another order, would change
    what an output means — refused in one line naming the first that differs."""
    if saved is None or now is None or saved == now:
        return
    i = next((i for i, (a, b) in enumerate(zip(saved, now)) if a != b), min(len(saved), len(now)))
    before, after = (names[i] if i < len(names) else "none" for names in (saved, now))
    raise UserError(f"{path} was trained on other classes: its output {i} is {before!r}, this data's {after!r} "
                    f"({len(saved)} classes there, {len(now)} here; status.json and the checkpoints list them as "
                    "`classes`): resume with the same class names, or start afresh")
