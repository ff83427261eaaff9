"""`accutrain resume=auto hydra.run.dir=DIR` with only the run directory: the run goes on as it was started. The
overrides Hydra recorded in DIR/.hydra/overrides.yaml are added to the command line, but those whose key the
command line sets itself; what the command line changes is named. A change its checkpoints cannot take — another
model, dataset or optimizer, seed or data.seed, effective batch — is one line naming both sides and the remedy,
before anything heavy is imported."""
from __future__ import annotations

import os
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any, Optional

import yaml

from accutrain.config.messages import override_key
from accutrain.errors import UserError
from accutrain.store import mark
from accutrain.store.status import read_status

# Never carried over: what this command decides (resume, the run directory, Hydra's own settings), and
# trainer.overwrite=true, which would delete the very run being resumed.
NOT_CARRIED = ("resume", "trainer.overwrite")
# Config groups whose option the checkpoints were written for (their weights, their data, their optimizer state).
GROUPS = ("model", "data", "optim")
# Values that decide which samples a window holds: another one continues another run.
VALUES = ("seed", "data.seed")
BATCH = ("micro_batch", "accum", "global_batch", "devices")


def value_of(override: str) -> Any:
    """An override's value as YAML reads it (`seed=0` → 0)."""
    text = override.split("=", 1)[1] if "=" in override else ""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def select(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


class Recorded:
    """What Hydra recorded of the run in `run_dir` — its task overrides, the option of each config group, the
    composed config (unresolved) — and the plan its status.json holds (the effective batch it trained with)."""

    def __init__(self, run_dir: Path, subdir: str):
        record = run_dir / subdir
        overrides = read_yaml(record / "overrides.yaml")
        self.overrides: list[str] = [str(o) for o in overrides] if isinstance(overrides, list) else []
        self.choices: dict[str, Any] = select(read_yaml(record / "hydra.yaml"), "hydra.runtime.choices") or {}
        self.config: dict[str, Any] = read_yaml(record / "config.yaml") or {}
        self.plan: dict[str, Any] = (read_status(run_dir) or {}).get("plan") or {}
        self.found = (record / "overrides.yaml").is_file()

    def value(self, key: str) -> Any:
        found = select(self.config, key)
        return None if isinstance(found, str) and "${" in found else found  # an interpolation: not comparable


def effective_batch(values: dict[str, Any]) -> Optional[int]:
    """micro_batch × accum × devices (or global_batch) where these alone decide it and agree, else None (the
    checks that follow name what is wrong with them)."""
    micro, accum, total, devices = (values.get(k) for k in BATCH)
    accum = 1 if accum is None and total is None else accum
    known = [v for v in (micro, accum, total, devices) if v is not None]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in known) or None in (micro, devices) \
            or "RANK" in os.environ:  # micro_batch=auto, devices=auto, a world torchrun or a scheduler started
        return None
    if total is not None:
        return total if accum is None or total == micro * accum * devices else None
    return micro * accum * devices


def refuse_what_the_checkpoints_cannot_take(run_dir: Path, record: Recorded, given: list[str]) -> None:
    """UserError, one line, when the command line changes a config group, seed or effective batch of the run."""
    remedy = "or choose a new hydra.run.dir (or trainer.overwrite=true) for a new run"
    last = {override_key(o): o.lstrip("+") for o in given}  # the last override of each key counts
    for key, override in last.items():
        before = record.choices.get(key) if key in GROUPS else record.value(key) if key in VALUES else None
        if before is not None and str(before) != str(value_of(override)):
            raise UserError(f"resume=auto: {run_dir} was trained with {key}={before}; this command line gives "
                            f"{override}: resuming needs the same {key} (its checkpoints are of that run): drop "
                            f"{override} to continue the run as it was started, {remedy}")
    if any(key in ("batch_schedule", "micro_tokens") for key in last) or record.value("batch_schedule") or \
            record.value("micro_tokens"):
        return
    recorded = {key: record.value(key) for key in BATCH}
    now = effective_batch({**recorded, **{key: value_of(last[key]) for key in BATCH if key in last}})
    plan = record.plan  # what the run trained with (a world torchrun started counts its ranks as devices)
    before = plan.get("effective") if isinstance(plan.get("effective"), int) else effective_batch(recorded)
    if before is not None and now is not None and before != now:
        changed = " ".join(last[key] for key in BATCH if key in last)
        split = " × ".join(f"{key} {plan[key] if key in plan else recorded[key] or 1}" for key in
                           ("micro_batch", "accum", "devices"))
        undo = (f"drop {changed}" if changed else f"start it on the run's {plan.get('devices', '?')} devices (devices="
                f"{plan.get('devices', '?')}, or the same torchrun or srun)")
        raise UserError(f"resume=auto: {run_dir} was trained with effective batch {before} ({split}); "
                        f"{changed or 'this command'} makes it {now}: resuming needs the same effective batch (its "
                        f"windows): keep it with global_batch={before} and accum derived, {undo} to continue the run "
                        f"as it was started, {remedy}")


def carry(args: Namespace, prog: Optional[str]) -> list[str]:
    """For `resume=auto hydra.run.dir=DIR` (not a sweep): the overrides DIR's run was started with that the command
    line does not set, added to `args.overrides` and returned (the command line Hydra runs gets them too); `prog`:
    the command whose notice names them (None: say nothing, as torchrun's other ranks). Raises UserError."""
    given = list(args.overrides)
    if args.multirun or "resume=auto" not in given:
        return []
    run_dir = next((o.split("=", 1)[1] for o in reversed(given) if o.startswith("hydra.run.dir=")), None)
    if run_dir is None:
        return []
    subdir = next((o.split("=", 1)[1] for o in reversed(given) if o.startswith("hydra.output_subdir=")), ".hydra")
    record = Recorded(Path(run_dir).expanduser(), subdir)
    if mark.owner(Path(run_dir).expanduser()) != "run":  # (a folder that is not an accutrain run's carries nothing:
        return []  # the checks refuse it)
    own = [o for o in given if not override_key(o).startswith("hydra") and override_key(o) not in NOT_CARRIED]
    if not record.found:
        if not own:  # the command line says nothing of the run either: it would be the default config's
            refuse_a_run_without_its_plan(Path(run_dir).expanduser(), subdir)
        return []
    refuse_what_the_checkpoints_cannot_take(Path(run_dir), record, own)
    keys = {override_key(o) for o in given}
    carried = [o for o in record.overrides if override_key(o) not in keys and override_key(o) not in NOT_CARRIED
               and not override_key(o).startswith("hydra")]
    args.overrides = [*given, *carried]
    earlier = {override_key(o): o.lstrip("+") for o in record.overrides}
    changes = [o.lstrip("+") + (f" (was {earlier[override_key(o)]})" if override_key(o) in earlier else "")
               for o in own if earlier.get(override_key(o)) != o.lstrip("+")]
    if prog is not None and (carried or changes):
        print(f"{prog}: notice: resume=auto continues {run_dir} as it was started"
              + (f" ({' '.join(o.lstrip('+') for o in carried)}, from {Path(run_dir) / subdir / 'overrides.yaml'})"
                 if carried else "") + (f"; changed on this command line: {', '.join(changes)}" if changes else ""),
              file=sys.stderr)
    return carried


def refuse_a_run_without_its_plan(run_dir: Path, subdir: str) -> None:
    """A run directory accutrain marked whose run left no plan — neither Hydra's record (`subdir`/overrides.yaml) nor
    accutrain's config.yaml: its run was stopped between the mark and Hydra's record, so resume=auto cannot know
    what it was (and the command line gives no override of the run's). UserError, rather than filling the
    directory with the default config's run."""
    if subdir in ("null", "None", "~", "") or (run_dir / "config.yaml").is_file():
        return  # a run started with hydra.output_subdir=null records its config in config.yaml alone
    raise UserError(f"resume=auto: {run_dir} holds no run plan ({Path(subdir) / 'overrides.yaml'} and config.yaml "
                    "are missing: its run was stopped before it wrote them, before training), so there is nothing "
                    f"to continue: start that run again with its own overrides, accutrain <overrides> "
                    f"hydra.run.dir={run_dir}, or choose a new hydra.run.dir")
