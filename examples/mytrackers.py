"""An experiment tracker of your own for `logger=custom` (docs/trackers.md), run from the repository's top folder:
`accutrain 'logger=[tensorboard,custom]' logger.custom._target_=examples.mytrackers.Printer +logger.custom.every=10`.

accutrain calls the methods a tracker has (start, log_step, log_eval, flush, finish) on rank 0."""


class Printer:
    """Prints every `every`-th optimizer step's loss."""

    def __init__(self, every: int = 1):
        self.every = every

    def log_step(self, record: dict) -> None:
        if record["step"] % self.every == 0:
            print(f"step {record['step']}: loss {record['loss']:.4f} after {record['samples_seen']} samples")
