"""trainer.export=weights: the model's weights alone, as a safetensors file — no optimizer, RNG or config — loadable
with safetensors.torch.load_file into the bare model (load_state_dict, strict)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from accutrain.errors import UserError
from accutrain.store.files import write_atomic

WEIGHTS_FILE = "model.safetensors"


def save_weights(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, Any]) -> int:
    """Write the state dict `state` to `path` (safetensors, atomically), `metadata` as its text header; the bytes
    written. Each tensor is its own contiguous CPU copy: tied weights (an embedding shared with the output layer) are
    stored under each name, so that every key load_state_dict expects is in the file."""
    try:
        from safetensors.torch import save
    except ImportError:
        raise UserError("trainer.export=weights needs the safetensors package: pip install safetensors") from None
    tensors = {name: value.detach().to("cpu", copy=True).contiguous() for name, value in state.items()}
    data = save(tensors, metadata={key: str(value) for key, value in metadata.items()})
    write_atomic(path, data, durable=True)
    return len(data)
