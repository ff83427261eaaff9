"""One rank's checkpoints: written at optimizer-step boundaries (rank 0 the file, or every rank its shards), best.pt
beside them, a write that fails (a full disk) said once while training goes on, non-finite weights never saved, the
disk's room looked at before the first."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Optional

import torch

from accutrain import dist
from accutrain.errors import UserError
from accutrain.parallel.state_dicts import write_sharded
from accutrain.store.progress import Progress
from accutrain.store.rotation import Rotation
from accutrain.store.status import add_to_status
from accutrain.trackers import Trackers
from accutrain.train.components import Components
from accutrain.train.resume import checkpoint_state

log = logging.getLogger("accutrain")
RESUME_ONLY = ("optimizer", "scheduler", "scaler", "rng")  # what best.pt leaves out


class Checkpoints:
    """What the loop calls to checkpoint: every rank's state into rank 0's rotating checkpoints/, every rank waiting
    for it to be on disk. A write that fails (disk full, I/O error) is one error line: the previous checkpoint stays
    whole, no temporary file is left, training goes on and the next checkpoint tries again; if the run's last one
    (at the end, or on a signal) fails, raise_if_the_last_failed ends the run with one line. best.pt holds what
    evaluation needs, without the optimizer's state (for_evaluation)."""

    def __init__(self, parts: Components, directory: Path, trackers: Trackers) -> None:
        self.parts, self.trackers = parts, trackers
        self.rotation = Rotation(directory, parts.trainer.keep_checkpoints)
        self.failure: Optional[str] = None  # why the latest checkpoint could not be written
        self.failed: list[int] = []  # the optimizer steps whose checkpoint could not be written, this session

    def last_good(self) -> str:
        steps = self.rotation.steps()
        if steps:
            return f"the last checkpoint, {steps[0]}, holds finite weights (resume=auto continues from it)"
        return "no checkpoint was written before it (trainer.checkpoint_every=N writes one every N optimizer steps)"

    def __call__(self, p: Progress, best: bool = False) -> Optional[Path]:
        """The next step-*.pt of the rotation, or (best) best.pt, the state at the best evaluation so far; with
        strategy.checkpoint=sharded a directory (step-*/, best/) each rank writes its shards into. Refused when the
        weights are not finite."""
        parts = self.parts
        self.trackers.flush()  # a resume from this checkpoint finds in the trackers every step up to it
        state, shards = checkpoint_state(parts, p)
        if not finite_weights(parts, state, shards):
            newest = self.rotation.steps()
            raise UserError(f"the weights are not finite at optimizer step {p.step}: no checkpoint written "
                            f"(the last good one is {newest[0] if newest else 'none'})")
        path = None
        try:
            if shards is not None:  # every rank writes; a failure is raised alike on every rank (write_sharded)
                path = write_sharded(self.rotation.directory / ("best" if best else f"step-{p.step:08d}"), shards,
                                     state, parts.world)
                if parts.world.main and not best:
                    self.rotation.commit(path)
            elif parts.world.main:
                epoch = p.last_epoch + 1  # the step's epoch, as the log and metrics.jsonl count it
                path = (self.rotation.save_best(for_evaluation(state), f"epoch{epoch}-step{p.step}-"
                                                f"{parts.monitor.metric}{p.best:.4g}") if best
                        else self.rotation.save(state, p.step, epoch))
            if not best:
                self.failure = None
        except OSError as e:
            path = None
            if parts.world.main:
                self.not_written(e, p, best)
        dist.wait_for_main(parts.world)  # no rank leaves before the checkpoint is on disk
        return path

    def not_written(self, e: OSError, p: Progress, best: bool) -> None:
        """The checkpoint of step p.step (or best.pt) could not be written: one error line, recorded."""
        newest = self.rotation.steps()
        failure = (f"could not write {'best.pt' if best else 'the checkpoint'} of optimizer step {p.step} into "
                   f"{self.rotation.directory} ({e.strerror or e}); the newest on disk is "
                   f"{newest[0].name if newest else 'none'}")
        if best or p.step < self.parts.plan.total_steps:  # the run's last one: raise_if_the_last_failed says it
            log.error(f"{failure}: training goes on, the next {'best evaluation' if best else 'checkpoint'} tries "
                      "again")
        if not best:  # a best.pt that could not be written leaves the run's last steps saved
            self.failure = failure
            self.failed.append(p.step)
            add_to_status(self.rotation.directory.parent, checkpoints_failed=dict(
                count=len(self.failed), steps=self.failed[:10], last_step=p.step, error=e.strerror or str(e)))

    def best_path(self) -> Path:
        """Where the best evaluation's checkpoint is (best.pt; best/ when sharded)."""
        return self.rotation.directory / ("best" if self.parts.strategy.sharded_checkpoints else "best.pt")

    def raise_if_the_last_failed(self) -> None:
        """At the end: the checkpoints that could not be written, said; if the last one failed, UserError."""
        if self.failed and not self.failure:
            newest = self.rotation.steps()
            log.error(f"{len(self.failed)} checkpoint{'s' if len(self.failed) > 1 else ''} could not be written "
                      f"(optimizer step{'s' if len(self.failed) > 1 else ''} "
                      f"{', '.join(map(str, self.failed[:10]))}{', …' if len(self.failed) > 10 else ''}); the newest "
                      f"on disk is {newest[0].name if newest else 'none'} (status.json: checkpoints_failed)")
        if self.failure:
            raise UserError(f"{self.failure}: the run's last steps are not saved (make room, then resume=auto "
                            "continues from that checkpoint)")


def for_evaluation(state: dict) -> dict:
    """best.pt's content: the checkpoint without what only a resume needs (optimizer, scheduler, scaler, RNG
    states) — the weights (and their average), the progress, plan and config; about half a full checkpoint with
    SGD's momentum, a third with Adam's moments. A resume continues from step-*.pt or last.pt, never from it."""
    return {key: value for key, value in state.items() if key not in RESUME_ONLY}


def warn_if_disk_is_short(parts: Components, rotation: Rotation) -> None:
    """A warning when the disk holding checkpoints/ has less room than the checkpoints kept at once will take (the
    weights and up to twice as much optimizer state each, keep_checkpoints + the one being written)."""
    weights = sum(t.numel() * t.element_size() for t in parts.model.state_dict().values())
    needed = 3 * weights * (rotation.keep + 1)
    try:
        free = shutil.disk_usage(rotation.directory.parent).free
    except OSError:
        return
    if free < needed:
        log.warning(f"the disk holding {rotation.directory} has {free / 2**20:.3g} MiB free; the "
                    f"{rotation.keep + 1} checkpoints on it at once may take up to {needed / 2**20:.3g} MiB "
                    "(weights and optimizer state): a checkpoint that cannot be written is reported and retried")


def finite_weights(parts: Components, state: dict, shards: Optional[dict]) -> bool:
    """Whether the weights about to be saved are finite: rank 0's whole ones (True elsewhere), or every rank's shards
    (then every rank gets the answer)."""
    if shards is None:
        return not parts.world.main or all(torch.isfinite(t).all() for t in state["model"].values()
                                       if t.is_floating_point())
    local = all(torch.isfinite(t.to_local() if dist.is_sharded(t) else t).all()
                for t in shards["model"].values() if t.is_floating_point())
    return bool(dist.all_reduce_min(torch.tensor(float(local)), parts.world).item())
