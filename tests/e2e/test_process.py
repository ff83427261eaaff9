"""The command's own process (accutrain.cli.process): Ctrl-C while it imports is one line, and its exit skips the
interpreter's last garbage collections."""
import signal
import subprocess
import sys

import pytest
from conftest import WAIT_S

INTERRUPTED_WHILE_IMPORTING = """
import os, signal, sys, time
sys.argv[0] = {script!r}
import accutrain.cli  # what the console script imports first; accutrain.cli.main (Hydra, PyTorch) not yet
os.kill(os.getpid(), signal.SIGINT)
time.sleep(30)
"""

EXIT = """
import atexit, gc, sys
atexit.register(lambda: print("frozen" if gc.get_freeze_count() else "not frozen"))  # runs after accutrain's
sys.argv[0] = {script!r}
import accutrain.cli
"""


def test_ctrl_c_while_the_command_imports_is_one_line():
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED_WHILE_IMPORTING.format(script="/usr/bin/accutrain")],
                          capture_output=True, text=True, timeout=WAIT_S)
    assert proc.returncode == 128 + signal.SIGINT
    assert proc.stderr == "accutrain: interrupted while starting: nothing was trained\n"


@pytest.mark.parametrize("script, says", [("/venv/bin/accutrain", "frozen"), ("/venv/bin/accutrain-report", "frozen"),
                                          ("-c", "not frozen")])
def test_the_command_exits_without_collecting_what_it_leaves(script, says):
    """gc.freeze at exit, in the commands only (a program importing accutrain keeps Python's own exit)."""
    proc = subprocess.run([sys.executable, "-c", EXIT.format(script=script)], capture_output=True, text=True,
                          timeout=WAIT_S, check=True)
    assert proc.stdout.strip() == says
