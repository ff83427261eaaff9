"""Every refusal before the run directory (issue 39): each row of the refusal table (accutrain.config.refusals), and
the mistakes only the data or a plug-in shows, through the command line — exit 2, one line, no run directory, under 5
s of CPU."""
from __future__ import annotations

import ctypes
import os
import resource
import struct
import time

import pytest
from conftest import TINY, TINY_DATA, assert_one_line_error, run_cli

from accutrain.config.refusals import rows

CONTRASTIVE = ["debug=fast", "loss=contrastive", "augment.views=2", "augment=crop_flip"]
FSDP = [*TINY, "strategy=fsdp"]
LM = ["debug=fast", "model=hf_causal_lm", "+model.config.model_type=gpt2"]
BUDGET = ["micro_batch=auto", "global_batch=32", "trainer.memory_budget_mb=1000"]
TOKENS = ["micro_tokens=auto", "global_batch=32", "trainer.memory_budget_mb=1000"]
FREE = ["model=hf_causal_lm", "+model.config.model_type=gpt2", "data=text", "data.train=lm.txt", "data.padding=free"]
STREAM = ["data=hf", "data.train=chat.jsonl", "data.streaming=true", "data.val=val.jsonl", "trainer.max_steps=10"]

# One command per row of the table: (the row's option, the other key as the message names it) → the overrides.
# One command per row of the table: (the option as the message names it, the other key) → the overrides. The rows
# every family with a trait refuses are run with one such family (accutrain.config.refusals.TRAIT_ROWS).
ROWS = {
    ("resume=auto", "trainer.overwrite=true"): [*TINY, "resume=auto", "trainer.overwrite=true"],
    ("batch_schedule", "accum=2"): [*TINY, "batch_schedule=ramp", "accum=2"],
    ("batch_schedule", "global_batch=64"): [*TINY, "batch_schedule=ramp", "global_batch=64"],
    ("micro_tokens=64", "micro_batch=auto"): [*TINY, "micro_tokens=64", "micro_batch=auto", "global_batch=8"],
    ("micro_tokens=64", "batch_schedule"): [*TINY, "micro_tokens=64", "batch_schedule=ramp"],
    ("micro_batch=auto", "global_batch=null"): [*TINY, "micro_batch=auto", "trainer.memory_budget_mb=500"],
    ("micro_batch=auto", "accum=2"): [*TINY, "micro_batch=auto", "global_batch=32", "accum=2"],
    ("scaling.lr=linear", "scaling.base_batch=null"): [*TINY, "scaling.lr=linear"],
    ("scaling.beta2=half_life", "scaling.base_batch=null"): [*TINY, "scaling.beta2=half_life"],
    ("scaling.beta2=half_life", "optim._target_=accutrain.models.optim.sgd"):
        [*TINY, "scaling.beta2=half_life", "scaling.base_batch=32", "optim=sgd"],
    ("scaling.ema=true", "trainer.ema=null"): [*TINY, "scaling.ema=true", "scaling.base_batch=32"],
    ("scaling.ema=true", "scaling.base_batch=null"): [*TINY, "scaling.ema=true", "trainer.ema=0.99"],
    ("trainer.monitor=val_acc_ema", "trainer.ema=null"): [*TINY, "trainer.monitor=val_acc_ema"],
    ("trainer.noise_scale=true", "accum=1 on one device"): [*TINY, "trainer.noise_scale=true", "micro_batch=8"],
    ("trainer.compile_mode=max-autotune", "trainer.compile=false"): [*TINY, "trainer.compile_mode=max-autotune"],
    ("loss=contrastive", "strategy=fsdp"): [*CONTRASTIVE, "strategy=fsdp"],
    ("loss=contrastive", "trainer.noise_scale=true"): [*CONTRASTIVE, "trainer.noise_scale=true", "accum=2"],
    ("loss=contrastive", "micro_batch=auto"): [*CONTRASTIVE, *BUDGET],
    ("loss=contrastive", "micro_tokens=auto"): [*CONTRASTIVE, *TOKENS],
    ("loss=contrastive", "trainer.accum_dtype / trainer.offload_grads"): [*CONTRASTIVE, "trainer.offload_grads=true"],
    ("loss=contrastive", "augment.mixup_alpha / cutmix_alpha"): [*CONTRASTIVE, "augment.mixup_alpha=0.2"],
    ("loss=contrastive", "data.padding=free"): [*FREE, "loss=contrastive"],
    ("loss=contrastive", "an effective batch of 1"): [*CONTRASTIVE, "micro_batch=1"],
    ("loss=mse", "trainer.noise_scale=true"): [*TINY, "loss=mse", "data.target=regression", "trainer.noise_scale=true",
                                              "accum=2"],
    ("loss=moe", "model._target_=accutrain.models.mlp"): ["debug=fast", "loss=moe"],
    ("loss=moe", "strategy=fsdp"): [*LM, "loss=moe", "strategy=fsdp"],
    ("loss=dpo", "strategy=fsdp"): [*LM, "loss=dpo", "strategy=fsdp"],
    ("loss=orpo", "strategy=fsdp"): [*LM, "loss=orpo", "strategy=fsdp"],
    ("loss=kto", "strategy=fsdp"): [*LM, "loss=kto", "strategy=fsdp"],
    ("loss=dpo", "loss.reference=precompute"): [*LM, "loss=dpo", "loss.kind=simpo", "loss.reference=precompute"],
    ("loss=orpo", "loss.reference=precompute"): [*LM, "loss=orpo", "loss.reference=precompute"],
    ("loss=kto", "loss.reference=precompute"): [*LM, "loss=kto", "loss.reference=precompute"],
    ("loss=moe", "data.packing=true"): ["model=hf_causal_lm", "+model.config.model_type=mixtral", "loss=moe",
                                        "loss.router_aux=model", "data=text", "data.train=corpus.txt",
                                        "data.packing=true"],
    ("augment.views=2", "loss=cross_entropy"): ["debug=fast", "augment.views=2", "augment=crop_flip"],
    ("augment.views=2", "augment=none (no random crop, flip, policy or erasing)"):
        ["debug=fast", "loss=contrastive", "augment.views=2"],
    ("strategy=fsdp", "micro_batch=auto"): [*FSDP, *BUDGET],
    ("strategy=fsdp", "micro_tokens=auto"): [*FSDP, *TOKENS],
    ("strategy=fsdp", "trainer.offload_grads=true"): [*FSDP, "trainer.offload_grads=true"],
    ("strategy=fsdp", "trainer.accum_dtype=float32"): [*FSDP, "trainer.accum_dtype=float32"],
    ("strategy=fsdp", "trainer.precision=16-mixed"): [*FSDP, "trainer.precision=16-mixed"],
    ("strategy=fsdp", "batchnorm.sync=true"): [*FSDP, "batchnorm.sync=true"],
    ("strategy=fsdp", "trainer.ema_device=cpu"): [*FSDP, "trainer.ema=0.9", "trainer.ema_device=cpu"],
    ("strategy=fsdp", "trainer.compile=true"): [*FSDP, "trainer.compile=true"],
    ("strategy=fsdp", "trainer.channels_last=true"): [*FSDP, "trainer.channels_last=true"],
    ("strategy=fsdp", "trainer.noise_scale=true"): [*FSDP, "trainer.noise_scale=true", "accum=2"],
    ("strategy=fsdp", "model.adapter=lora"): [*LM, "strategy=fsdp", "model.adapter=lora"],
    ("strategy=fsdp", "trainer.export=weights"): [*FSDP, "trainer.export=weights"],
    ("model.adapter=lora", "model.lora.alpha=0"): [*LM, "model.adapter=lora", "model.lora.alpha=0"],
    ("model.adapter=lora", "model.lora.r=0"): [*LM, "model.adapter=lora", "model.lora.r=0"],
    ("model.adapter=lora", "model.lora.dropout=1"): [*LM, "model.adapter=lora", "model.lora.dropout=1"],
    ("model.adapter=lora", "model.lora.target_modules=[]"): [*LM, "model.adapter=lora", "model.lora.target_modules=[]"],
    ("data.streaming=true", "trainer.max_steps=null"): [*STREAM, "trainer.max_steps=null"],
    ("data.streaming=true", "data.val=null"): [*STREAM, "data.val=null"],
    ("data.streaming=true", "data.packing=True"): [*STREAM, "data.packing=true"],
    ("data.streaming=true", "micro_batch=auto"): [*STREAM, *BUDGET],
    ("data.streaming=true", "micro_tokens=auto"): [*STREAM, *TOKENS],
    ("data.streaming=true", "batch_schedule"): [*STREAM, "batch_schedule=ramp"],
    ("data.streaming=true", "loader.num_workers=2"): [*STREAM, "loader.num_workers=2"],
    ("data.padding=free", "loss.normalize=sequences"): [*FREE, "loss.normalize=sequences"],
    ("data.padding=free", "model.neftune_alpha=5.0"): [*FREE, "model.neftune_alpha=5"],
    ("model.kernels=liger", "trainer.device=cpu"): [*LM, "model.kernels=liger", "trainer.device=cpu"],
    ("model.quantize=4bit", "trainer.device=cpu"):
        [*LM, "model.adapter=lora", "model.quantize=4bit", "trainer.device=cpu"],
    ("trainer.export=hf", "model._target_=accutrain.models.mlp"): [*TINY, "trainer.export=hf"],
    ("trainer.export=merged", "model.adapter=null"): [*LM, "trainer.export=merged"],
}

BAD_MODULE = "def make(:\n    pass\n"
RAISING = "raise RuntimeError('no GPU driver found')\n"
DATA_RAISING = "def make(**arguments):\n    raise ValueError(\"the csv has no column 'label'\")\n"
LOSSES = """
import sys
import torch.nn.functional as F

def focal(output, target, gamma):
    return F.cross_entropy(output, target, reduction="none") * gamma

def detached(output, target):
    return F.cross_entropy(output, target, reduction="none").detach()

def leaves(output, target):
    sys.exit(0)
"""
PAIRS = "".join('{"anchor": "q%d", "positive": "p%d", "negative": "n%d"}\n' % (i, i, i) for i in range(40))
TEXT_PAIRS = ["model=mlp", "data=text", "data.train=pairs.jsonl", "loss=contrastive", "micro_batch=8"]
PREFERENCE = ('{"prompt": "a", "chosen": " c0", "rejected": " r0"}\n{"prompt": "b", "chosen": " c1", '
              '"rejected": " r1"}\n')
FEEDBACK = '{"prompt": "a", "completion": " c0", "label": true}\n{"prompt": "b", "completion": " c1", "label": false}\n'
PREFERENCE_RUN = ["model=hf_causal_lm", "+model.config.model_type=gpt2", "+model.config.n_layer=1",
                  "+model.config.n_embd=16", "+model.config.n_head=2", "data=text", "data.train=p.jsonl",
                  "data.val=p.jsonl", "data.max_length=32"]
# What only the data or a plug-in shows: (files to write, the overrides, what the one line names).
OTHERS = {
    "a _target_ module with a syntax error": ({"badmodel.py": BAD_MODULE}, [*TINY_DATA, "model=custom",
        "model._target_=badmodel.Net"], ["model._target_=badmodel.Net", "SyntaxError", "badmodel.py:1"]),
    "a _target_ module raising at import": ({"raising.py": RAISING}, [*TINY, "data=custom",
        "data._target_=raising.make"], ["data._target_=raising.make", "RuntimeError: no GPU driver found"]),
    "a data factory raising as it makes the data": ({"baddata.py": DATA_RAISING}, [*TINY, "data=custom",
        "data._target_=baddata.make"], ["the data baddata.make raised ValueError: the csv has no column 'label'"]),
    "a malformed .csv file": ({"bad.csv": 'text,label\n"unterminated,1\n'}, ["model=hf_causal_lm",
        "+model.config.model_type=gpt2", "data=hf", "data.train=bad.csv", "data.cache_dir=hf-cache"],
        ["data.train=bad.csv could not be read: Error tokenizing data"]),
    "a custom loss missing a required argument": ({"mylosses.py": LOSSES}, [*TINY, "loss=custom",
        "loss._target_=mylosses.focal"], ["loss._target_=mylosses.focal", "+loss.gamma"]),
    "a custom loss without gradient": ({"mylosses.py": LOSSES}, [*TINY, "loss=custom",
        "loss._target_=mylosses.detached"], ["loss=mylosses.detached returned a loss without gradient"]),
    "a custom loss calling sys.exit(0)": ({"mylosses.py": LOSSES}, [*TINY, "loss=custom",
        "loss._target_=mylosses.leaves"], ["loss=mylosses.leaves called sys.exit(0)"]),
    "loss=bce with targets outside [0, 1]": ({}, [*TINY, "loss=bce", "data.target=regression"],
        ["loss=bce takes targets in [0, 1]"]),
    "loss=contrastive with a last window of one pair": ({}, [*CONTRASTIVE, "data.size=33"],
        ["loss=contrastive needs 2 or more samples in every window", "trainer.last_window=drop"]),
    "strategy=fsdp on two devices with BatchNorm": ({}, ["model=resnet18", "strategy=fsdp", "devices=2"],
        ["strategy=fsdp with batchnorm.convert=keep", "batchnorm.convert=group"]),
    "loss=contrastive on images without their views": ({}, ["debug=fast", "loss=contrastive"],
        ["loss=contrastive needs pairs per sample", "augment.views=2"]),
    "a text pair without its positive": ({"pairs.jsonl": PAIRS.replace(', "positive": "p1"', "")},
        [*TEXT_PAIRS], ["pairs.jsonl:2 has no positive (data.columns.positive=positive)"]),
    "a text pair with an empty positive": ({"pairs.jsonl": PAIRS.replace('"p1"', '" "')}, [*TEXT_PAIRS],
        ["pairs.jsonl:2 has an empty positive"]),
    "text pairs with a loss that does not compare them": ({"pairs.jsonl": PAIRS},
        [*TEXT_PAIRS, "loss=cross_entropy"], ["holds text pairs", "loss=contrastive"]),
    "a preference pair whose chosen equals its rejected": ({"p.jsonl": PREFERENCE.replace('" r1"', '" c1"')},
        [*PREFERENCE_RUN, "loss=dpo"], ["p.jsonl:2: its chosen equals its rejected"]),
    "a feedback label that is not a boolean": ({"p.jsonl": FEEDBACK.replace("false", '"no"')},
        [*PREFERENCE_RUN, "loss=kto"], ["p.jsonl:2: label is 'no'", "true (desirable) or false"]),
    "preference pairs with a loss that does not take them": ({"p.jsonl": PREFERENCE},
        [*PREFERENCE_RUN, "loss=cross_entropy"], ["holds preference records", "loss=dpo"]),
    "feedback records with loss=dpo": ({"p.jsonl": FEEDBACK}, [*PREFERENCE_RUN, "loss=dpo"],
        ["loss=dpo trains on preference pairs"]),
    "loss.beta=0": ({"p.jsonl": PREFERENCE}, [*PREFERENCE_RUN, "loss=dpo", "loss.beta=0"],
        ["loss.beta=0.0 is not valid"]),
}


class Created:
    """The names created in (or moved into) a folder while it is watched: Linux's inotify, so that a directory made
    and removed again within the command is seen too. Elsewhere (no inotify) nothing is seen: only what is left."""

    IN_CREATE, IN_MOVED_TO = 0x100, 0x80

    def __init__(self, folder) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK) if hasattr(libc, "inotify_init1") else -1
        if self.fd >= 0:
            libc.inotify_add_watch(self.fd, str(folder).encode(), self.IN_CREATE | self.IN_MOVED_TO)

    def names(self) -> list[str]:
        found, data = [], b""
        while self.fd >= 0:
            try:
                data += os.read(self.fd, 65536)
            except BlockingIOError:
                break
        while data:  # struct inotify_event: wd, mask, cookie, len, then the name padded with NULs
            _, _, _, length = struct.unpack_from("iIII", data)
            found.append(data[16:16 + length].rstrip(b"\0").decode())
            data = data[16 + length:]
        if self.fd >= 0:
            os.close(self.fd)
        return found


def refused_quickly(tmp_path, files: dict[str, str], overrides: list[str], fragments: list[str], never_made: bool = True
                    ) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    watch = Created(tmp_path)
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    proc = run_cli(*overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, check=False,
                   fresh=True)  # a fresh interpreter: its CPU, what it imported before the refusal
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_one_line_error(proc, *fragments)
    made = "run" in watch.names()
    assert not (never_made and made), "the run directory was made (and removed)"
    assert not (tmp_path / "run").exists(), sorted(p.name for p in (tmp_path / "run").iterdir())
    # CPU time, not wall: another process on the cores does not count against it (though a busy machine still makes the
    # same work cost more CPU: up to twice as much was seen in CI). A table row is decided before PyTorch loads (about
    # 1 s of CPU on an idle machine); a mistake found at start imports PyTorch and builds the data and the model (3-6 s
    # idle), where a refusal from the workers or after a step would import it again per rank, or train (15 s and up).
    limit = 5.0 if never_made else 14.0
    assert cpu < limit, f"{cpu:.1f} s of CPU for a refusal"
    print(f"refused in {wall:.2f} s wall, {cpu:.2f} s of CPU: {' '.join(overrides)}")


def test_the_watch_sees_a_directory_made_and_removed(tmp_path):
    watch = Created(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run").rmdir()
    if watch.fd < 0:
        pytest.skip("no inotify here")
    assert "run" in watch.names()


def test_the_docs_list_every_refused_combination():
    """docs/config.md's table names every option of the table and every other key a row refuses."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    section = page[page.index("## Refused combinations"):page.index("## Plug-ins")]
    for key, other in ROWS:
        if not key.startswith("loss="):
            assert key.split("=")[0] in section, key
        assert other.split("=")[0].split(" (")[0] in section or other.startswith(("an effective batch", "model._target_")), other


def test_every_row_of_the_table_has_a_command():
    assert len(rows()) == len(ROWS), "a row of accutrain.config.refusals has no command in ROWS (or one too many)"
    options = {key for key, _ in rows() if key != "the run's loss"}
    assert all(any(shown == option or shown.startswith(option + "=") for shown, _ in ROWS) for option in options), \
        sorted(options - {key for key, _ in ROWS})


@pytest.mark.parametrize("key, other", list(ROWS))
def test_a_refused_combination_is_one_line_before_the_run_directory(tmp_path, key, other):
    if other.startswith("model.") or "lora" in " ".join(ROWS[key, other]):
        pytest.importorskip("peft")
    refused_quickly(tmp_path, {}, ROWS[key, other], [f"{key} cannot be combined with {other}"])


@pytest.mark.parametrize("case", list(OTHERS))
def test_a_mistake_of_the_data_or_a_plug_in_is_one_line_before_the_run_directory(tmp_path, case):
    files, overrides, fragments = OTHERS[case]  # found by reading the data or building: the directory is left as it was
    refused_quickly(tmp_path, files, overrides, fragments, never_made=False)
