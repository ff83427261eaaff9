"""The command's own process, from its first instant: Ctrl-C while Python imports the command (before
accutrain.cli.main installs its handler, which knows when the job runs) is one line and exit code 130, not the
traceback of whichever import it landed in; and at exit the interpreter skips its last garbage collections over
everything PyTorch and the run left in memory (gc.freeze: the objects are freed all the same, without being
traversed), which took most of the second between a run's last line and the shell's prompt."""
from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
from types import FrameType
from typing import Optional

COMMANDS = ("accutrain", "accutrain-check", "accutrain-report")


def is_command(argv: list[str]) -> bool:
    """This process is one of the console scripts (or `python -m accutrain`), not a program importing accutrain."""
    script = os.path.basename(argv[0]) if argv and argv[0] else ""
    return script in COMMANDS or (script == "__main__.py" and os.path.basename(os.path.dirname(argv[0])) == "accutrain")


def interrupted_while_importing(signum: int, frame: Optional[FrameType]) -> None:
    sys.stderr.write(f"{os.path.basename(sys.argv[0])}: interrupted while starting: nothing was trained\n")
    sys.stderr.flush()
    os._exit(128 + signal.SIGINT)


def prepare(argv: list[str] = sys.argv) -> None:
    """In a command's process: one line for an early Ctrl-C, and a quick exit (the last atexit step)."""
    if not is_command(argv):
        return
    signal.signal(signal.SIGINT, interrupted_while_importing)
    atexit.register(gc.freeze)  # registered first, so it runs last: after logging and the trackers have flushed
