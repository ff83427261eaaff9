"""logger=tensorboard: event files in the run directory (`tensorboard --logdir outputs/`; a sweep's jobs are its
subdirectories). Scalars per optimizer step, the config as text and as hyperparameters with the final summary, the
loss plot as an image. A resumed run purges the steps after its checkpoint (SummaryWriter's purge_step)."""
from __future__ import annotations

import logging
import threading
from typing import Any, Optional

import yaml

from accutrain.trackers.base import RunEnd, RunInfo, Tracker, needs, scalars

log = logging.getLogger("accutrain")


class TensorBoard(Tracker):
    def __init__(self, log_dir: Optional[str] = None, flush_secs: int = 30) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise needs("tensorboard", "tensorboard") from None
        self.make_writer, self.log_dir, self.flush_secs = SummaryWriter, log_dir, flush_secs
        self.writer: Any = None
        self.params: dict[str, Any] = {}
        self.step = 0

    def start(self, run: RunInfo) -> dict[str, Any]:
        where = run.run_dir / self.log_dir if self.log_dir else run.run_dir
        quiet_writer_thread()
        # Steps after run.step that an earlier session wrote (killed after its checkpoint) are dropped by the readers.
        self.writer = self.make_writer(str(where), purge_step=run.step + 1, flush_secs=self.flush_secs)
        self.params, self.step = run.params, run.step
        if not (run.resumed and run.saved):  # a new TensorBoard run (if resumed, with the steps so far)
            self.writer.add_text("config", "```yaml\n" + yaml.safe_dump(run.config, sort_keys=False) + "```", 0)
            for record in run.history() if run.resumed else ():
                self._scalars(record)
        log.info(f"tensorboard: event files in {where} (view: tensorboard --logdir {run.group or where})")
        return {"log_dir": str(where)}

    def log_step(self, record: dict[str, Any]) -> None:
        self._scalars(record)

    def log_eval(self, record: dict[str, Any]) -> None:
        self._scalars(record)

    def _scalars(self, record: dict[str, Any]) -> None:
        self.step = record["step"]
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, self.step)

    def flush(self) -> None:
        self.writer.flush()

    def finish(self, end: RunEnd) -> None:
        if end.loss_plot is not None:
            import numpy as np
            from PIL import Image

            with Image.open(end.loss_plot) as image:
                pixels = np.asarray(image.convert("RGB"))
            self.writer.add_image("loss_plot", pixels, self.step, dataformats="HWC")
        # The HParams tab: the config beside the summary (written in the run's own directory, not a new run).
        self.writer.add_hparams(self.params, {f"summary/{k}": v for k, v in end.summary.items()}, run_name=".",
                                global_step=self.step)
        self.writer.close()


def quiet_writer_thread() -> None:
    """TensorBoard's writer thread prints a traceback when its file goes away; the next call on the writer raises
    the same error, which switches the tracker off with one warning line. Other threads' errors print as before."""
    previous = threading.excepthook
    if getattr(previous, "accutrain", False):
        return

    def hook(args: Any) -> None:
        if type(args.thread).__name__ != "_AsyncWriterThread":
            previous(args)

    hook.accutrain = True  # type: ignore[attr-defined]
    threading.excepthook = hook
