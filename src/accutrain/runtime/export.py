"""trainer.export: the trained model written for use outside accutrain — its weights alone (model.safetensors),
or save_pretrained's folder (hf; merged: the adapter merged in) — each with what loading it needs said and
recorded (the class names by output index; an adapter's base, models.adapter_export)."""
from __future__ import annotations

import logging
from pathlib import Path

from accutrain.store import classes
from accutrain.store.weights import WEIGHTS_FILE, save_weights
from accutrain.train.components import Components

log = logging.getLogger("accutrain")


def export(parts: Components, run_dir: Path, step: int) -> None:
    """trainer.export: the trained model's weights alone (weights: run_dir/model.safetensors), or the model saved with
    save_pretrained (hf, merged) into run_dir/hf."""
    if parts.trainer.export == "weights":
        path = run_dir / WEIGHTS_FILE
        size = save_weights(parts.model.state_dict(), path, dict(step=step, model=parts.run.model.target,
                                                                 **classes.metadata(parts.class_names)))
        log.info(f"exported the weights ({size / 2**20:.3g} MiB) to {path} (safetensors.torch.load_file, then "
                 "load_state_dict" + ("; its metadata's `classes` names each output" if parts.class_names else "")
                 + ")")
        return
    from accutrain.models import adapter_export
    from accutrain.models.hf import export as save_pretrained

    merged = parts.trainer.export == "merged"
    directory = save_pretrained(parts.model, parts.tokenizer, run_dir / 'hf', merged=merged)
    log.info(f"exported with save_pretrained{' (the adapter merged in)' if merged else ''} to {directory}")
    if parts.base is not None and getattr(parts.model, "adapted", False):  # the adapter alone: its base, said
        log.info(adapter_export.complete(parts.model, parts.base, directory))
