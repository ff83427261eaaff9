"""What a person sees in a terminal: a real run driven through a pseudo-terminal 120 columns wide, its bytes rendered
into the screen's lines as a terminal would draw them (carriage returns, erase-line and cursor-up sequences, soft
wrapping at the last column)."""
from __future__ import annotations

import codecs
import fcntl
import json
import os
import re
import select
import struct
import subprocess
import termios
from pathlib import Path

import pytest
from conftest import COMMAND_S, ONE_THREAD, TINY, cli_command, train_run

from accutrain.runtime import malloc

COLUMNS, ROWS = 120, 40
CSI = re.compile(r"\x1b\[([?0-9;]*)([A-Za-z])")
TIMESTAMP = re.compile(r"\[\d\d:\d\d:\d\d\]")
BAR = re.compile(r"\d+%\||\d+/\d+ \[|step/s|█")


def run_in_terminal(args: list[str], cwd: Path, timeout: float = COMMAND_S) -> tuple[int, bytes]:
    """Run the command with a pseudo-terminal of COLUMNS × ROWS as its stdin, stdout and stderr: (exit code, every
    byte it wrote)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
    env = {**os.environ, **ONE_THREAD, "COLUMNS": str(COLUMNS), "LINES": str(ROWS), "TERM": "xterm"}
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out = bytearray()
    try:
        while True:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the last holder of the terminal's other end has closed it
                    break
                if not data:
                    break
                out += data
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=timeout), bytes(out)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


def screen_lines(data: bytes, columns: int = COLUMNS) -> list[str]:
    """The lines a terminal `columns` wide shows for `data`, a soft-wrapped row joined to the row it continues."""
    text = codecs.decode(data, "utf-8", "replace")
    rows: list[list[str]] = [[]]
    continues = [False]
    row = col = 0
    wrap_next = False  # the cursor sits past the last column: the next character starts a new row

    def at(r: int) -> list[str]:
        while len(rows) <= r:
            rows.append([])
            continues.append(False)
        return rows[r]

    i = 0
    while i < len(text):
        ch = text[i]
        match = CSI.match(text, i) if ch == "\x1b" else None
        if match:
            arg, op = match.groups()
            n = int(arg) if arg.isdigit() else None
            line = at(row)
            if op == "K" and n in (None, 0):
                del line[col:]
            elif op == "K" and n == 2:
                line.clear()
            elif op == "A":
                row, wrap_next = max(0, row - (n or 1)), False
            elif op == "B":
                row = row + (n or 1)
            i = match.end()
            continue
        if ch == "\r":
            col, wrap_next = 0, False
        elif ch == "\n":
            row, wrap_next = row + 1, False
            at(row)
        elif ch == "\b":
            col, wrap_next = max(0, col - 1), False
        elif ch >= " ":
            if wrap_next:
                row, col, wrap_next = row + 1, 0, False
                at(row)
                continues[row] = True
            line = at(row)
            line.extend(" " * (col + 1 - len(line)))
            line[col] = ch
            if col == columns - 1:
                wrap_next = True
            else:
                col += 1
        i += 1
    logical: list[str] = []
    for cells, continued in zip(rows, continues):
        text_row = "".join(cells).rstrip()
        if continued and logical:
            logical[-1] += text_row
        else:
            logical.append(text_row)
    return logical


def test_screen_renderer_joins_glued_and_wrapped_lines():
    """The renderer itself: a bar redrawn in place, then a log line written after it without a newline."""
    bar = "\r 50%|█████     | 1/2 [00:01<00:01, 1.0step/s, loss=1.0000]"
    glued = screen_lines((bar + "[12:00:00] step 1\r\n").encode(), columns=80)
    assert any(BAR.search(line) and TIMESTAMP.search(line) for line in glued)
    wrapped = screen_lines((bar + "[12:00:00] step 1\r\n").encode(), columns=60)  # the bar's text wraps
    assert len(wrapped) == 2 and BAR.search(wrapped[0]) and TIMESTAMP.search(wrapped[0])
    cleared = screen_lines((bar + "\r" + " " * 60 + "\r[12:00:00] step 1\r\n" + bar).encode(), columns=80)
    assert cleared[0] == "[12:00:00] step 1" and BAR.search(cleared[1]) and not TIMESTAMP.search(cleared[1])


@pytest.mark.slow
def test_log_lines_never_share_a_screen_line_with_the_bar_and_the_last_bar_shows_the_last_step(tmp_path):
    run_dir = tmp_path / "run"
    code, data = run_in_terminal(
        [*cli_command(), *TINY, "trainer.progress=true", "micro_batch=4", "trainer.log_every=10",
         f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    lines = screen_lines(data)
    screen = "\n".join(lines)
    assert code == 0, screen
    assert not [line for line in lines if BAR.search(line) and TIMESTAMP.search(line)], screen
    assert sum(bool(re.match(r"\[\d\d:\d\d:\d\d\] step \d+/150 ", line)) for line in lines) == 15, screen
    bars = [line for line in lines if "150/150" in line and BAR.search(line)]
    assert len(bars) == 1, screen  # the finished bar, left in place once
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in steps if "loss" in r][-1]
    assert last["step"] == 150
    assert re.search(r"loss=([0-9.]+)", bars[0]).group(1) == f"{last['loss']:.4f}", screen


def test_the_console_says_each_thing_in_one_short_line_and_train_log_keeps_the_detail(tmp_path):
    """Start-up lines that fit a 120-column terminal (malloc's and dropout's explanations included), with their detail
    in train.log only; no line labelled a warning for what is information."""
    run_dir, proc = train_run(tmp_path, "run", "debug=fast", "model.dropout=0.2", "micro_batch=8", "accum=4",
                              "trainer.max_steps=2")
    console = proc.stderr.splitlines()
    assert all(len(line) <= COLUMNS for line in console if "warning:" in line or "malloc" in line), proc.stderr
    assert any("dropout layers are active" in line and line.count("warning:") == 1 for line in console)
    assert "their random masks depend" not in proc.stderr
    assert f"run directory {run_dir}" in proc.stderr
    detail = (run_dir / "train.log").read_text()
    assert "their random masks depend" in detail and "model.dropout=0 (hf_*, mlp, cnn)" in detail
    if malloc.glibc_version() is not None:
        assert "freed activations stay in the heap" in detail and "freed activations" not in proc.stderr
