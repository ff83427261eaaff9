"""trainer.export at the end of a run, whole or not at all, with what loading it needs said and recorded: the weights
alone (model.safetensors, written atomically, the class names by output index in its metadata), or save_pretrained's
folder (hf; merged: the adapter merged in) written beside it (.hf.tmp/) and renamed into place, an adapter's base
recorded beside it (models.adapter_export). A write that fails (a full disk) is one line naming the remedy, with the
run's checkpoints whole; a resume=auto that finds the run trained to its end but its export missing or incomplete
exports it then."""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from accutrain.errors import UserError
from accutrain.store import classes
from accutrain.store.weights import WEIGHTS_FILE, save_weights
from accutrain.train.components import Components

log = logging.getLogger("accutrain")
HF_DIR = "hf"
WEIGHT_FILES = ("*.safetensors", "*.bin")  # a model's (model*.safetensors, sharded too) or an adapter's


def exported(parts: Components, run_dir: Path) -> bool:
    """Whether trainer.export's output is in run_dir, whole: the weights file, or hf/ with a config and weights."""
    if parts.trainer.export == "weights":
        return (run_dir / WEIGHTS_FILE).is_file()
    folder = run_dir / HF_DIR
    configured = (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file()
    return configured and any(any(folder.glob(pattern)) for pattern in WEIGHT_FILES)


def export(parts: Components, run_dir: Path, step: int) -> None:
    """trainer.export: the trained model's weights alone (weights: run_dir/model.safetensors), or the model saved with
    save_pretrained (hf, merged) into run_dir/hf. UserError (one line) when it cannot be written."""
    kind = parts.trainer.export
    target = run_dir / (WEIGHTS_FILE if kind == "weights" else HF_DIR)
    try:
        if kind == "weights":
            size = save_weights(parts.model.state_dict(), target, dict(step=step, model=parts.run.model.target,
                                                                       **classes.metadata(parts.class_names)))
            log.info(f"exported the weights ({size / 2**20:.3g} MiB) to {target} (safetensors.torch.load_file, then "
                     "load_state_dict" + ("; its metadata's `classes` names each output" if parts.class_names else "")
                     + ")")
        else:
            save_hf(parts, target)
            log.info(f"exported with save_pretrained{' (the adapter merged in)' if kind == 'merged' else ''} to "
                     f"{target}")
            if parts.base is not None and getattr(parts.model, "adapted", False):  # the adapter alone: its base
                from accutrain.models import adapter_export

                log.info(adapter_export.complete(parts.model, parts.base, target))
    except Exception as e:  # OSError, or safetensors' own error around the OS's (a full disk)
        if not isinstance(e, OSError) and type(e).__name__ != "SafetensorError":
            raise
        raise UserError(f"could not export the trained model (trainer.export={kind}) to {target}: {reason(e)}; the "
                        f"run's checkpoints are whole: make room, then the same command with resume=auto exports it "
                        "(nothing is trained again)") from e


def save_hf(parts: Components, target: Path) -> None:
    """save_pretrained into a folder beside `target`, renamed into place whole (a previous hf/ replaced)."""
    from accutrain.models.hf import export as save_pretrained

    tmp, old = target.with_name(f".{target.name}.tmp"), target.with_name(f".{target.name}.old")
    for leftover in (tmp, old):
        remove_tree(leftover)
    try:
        save_pretrained(parts.model, parts.tokenizer, tmp, merged=parts.trainer.export == "merged")
        if target.is_symlink() or target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
    finally:
        remove_tree(tmp)
        remove_tree(old)


def remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def reason(error: Exception) -> str:
    """The OS's words for a failed write (safetensors wraps them: `IoError(Os { … message: "No space …" })`)."""
    if isinstance(error, OSError):
        return error.strerror or str(error)
    found = re.search(r'message: "([^"]+)"', str(error))
    return found.group(1) if found else str(error).splitlines()[0]


def export_if_missing(parts: Components, run_dir: Path, step: int) -> None:
    """A run already trained to its end whose export is missing or incomplete: export it now."""
    if parts.trainer.export and not exported(parts, run_dir):
        log.info(f"the run's export (trainer.export={parts.trainer.export}) is missing or incomplete in {run_dir}: "
                 "exporting the trained model now")
        export(parts, run_dir, step)
