"""An adapter's export (trainer.export=hf with model.adapter=lora) made loadable: PEFT writes the adapter alone and
names its base by `base_model_name_or_path` — null for a base initialised at random from `model.config`, which no
hub holds. Beside the adapter go what the base was (accutrain_base.json: the factory, its arguments, the weights'
fingerprint) and, for a base no name loads (initialised at random), the base itself in `base/` (its config and
weights, save_pretrained's), which adapter_config.json then names; the log says how to load the two."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from torch import nn

BASE_RECORD = "accutrain_base.json"
BASE_DIR = "base"
AUTO_CLASSES = {"causal_lm": "AutoModelForCausalLM", "seq_cls": "AutoModelForSequenceClassification",
                "encoder": "AutoModel"}  # accutrain.models.hf(_encoder)'s factories → the class that loads the base
PEFT_ONLY = re.compile(r"\.(lora_\w+|modules_to_save)\.")  # keys an adapted model's state adds to its base's


def base_state(peft_model: nn.Module) -> dict[str, Any]:
    """The base's own state dict under its own names, out of a PEFT model whose layers wrap it: the adapter's
    entries left out, a wrapped layer's `base_layer` / `original_module` under the layer's name."""
    state = peft_model.get_base_model().state_dict()
    return {key.replace(".base_layer.", ".").replace(".original_module.", "."): value
            for key, value in state.items() if not PEFT_ONLY.search(key)}


def complete(model: nn.Module, base: dict[str, Any], directory: Path) -> str:
    """Write what the base was beside the adapter PEFT saved in `directory` (and the base itself where no name loads
    it, with the modules `model`, accutrain's wrapper, set aside: model=hf_encoder's pooler); the sentence that says
    how to load the adapter."""
    directory, peft_model = Path(directory).resolve(), model.model
    (directory / BASE_RECORD).write_text(json.dumps(base, indent=2, default=str) + "\n")
    auto = AUTO_CLASSES.get(str(base.get("factory")).rsplit(".", 1)[-1], "AutoModel")
    arguments = base.get("arguments") or {}
    by_name = base.get("name_or_path") and arguments.get("pretrained", True)
    if by_name:
        revision = f", revision={base['revision']!r}" if base.get("revision") else ""
        source = f"{base['name_or_path']!r}{revision}"
    else:  # initialised at random: the weights the adapter was trained on exist nowhere else
        saved = directory / BASE_DIR
        aside = {f"{name}.{key}": value for name, module in getattr(model, "set_aside", {}).items()
                 for key, value in module.state_dict().items()}
        peft_model.get_base_model().save_pretrained(saved, state_dict={**base_state(peft_model), **aside})
        config_file = directory / "adapter_config.json"
        adapter_config = json.loads(config_file.read_text())
        adapter_config["base_model_name_or_path"] = str(saved)
        config_file.write_text(json.dumps(adapter_config, indent=2) + "\n")
        source = repr(str(saved))
    where = "" if by_name else f"; its base, initialised at random, saved beside it in {directory / BASE_DIR}"
    return (f"the adapter is trained on the base {BASE_RECORD} records{where}: load it with peft, "
            f"PeftModel.from_pretrained(transformers.{auto}.from_pretrained({source}), {str(directory)!r})")
