"""A command's claim on the directory it writes into (a run's or a sweep's), from before Hydra writes anything there
to the command's end: the directory held (rundir.held), looked at again under the hold (another command may have
made it an earlier run's, or someone a folder of their own, since the command line was checked), and marked as
accutrain's (store.mark). What the claim wrote is the first of the command's changes (store.record.Changes): a claim
refused puts it back at once, a command refused later puts it back with the rest."""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator

from accutrain.errors import UserError
from accutrain.store import mark, rundir
from accutrain.store.record import Changes


@contextmanager
def claimed(directory: Path, kind: str, key: str, look: Callable[[], None], changes: Changes) -> Iterator[Changes]:
    """Hold `directory` (a `kind` directory, the value of `key`), call `look()` (the command's checks of it, which
    raise UserError) under the hold, then mark it as accutrain's unless it is marked; the hold lasts to the block's
    end. Raises UserError (in use, refused by `look`) after putting back what the claim wrote."""
    with ExitStack() as hold:
        try:
            hold.enter_context(rundir.held(directory, key, changes))
            look()
            if mark.read(directory) is None:  # new, empty, or made before the mark existed: accutrain's from now
                path = directory / mark.MARK_FILE
                written = mark.write_new(directory, kind)
                if written is None:  # something else at the mark's name: never written over
                    raise UserError(f"{path} is not accutrain's mark (no run id accutrain can read): move it away, "
                                    "or choose another directory")
                changes.wrote(path, written, None)
        except BaseException as e:
            changes.put_back()  # while the directory is still held
            if isinstance(e, OSError):  # a full disk, a directory made read-only since the checks
                raise UserError(f"cannot write the run's files into {directory} ({key}): {e.strerror or e}") from None
            raise
        yield changes

