"""The console: the progress bar's last display, in a log file, and log lines that cooperate with the bar."""
from __future__ import annotations

import io
import logging
import sys

from accutrain.train.console import ConsoleFormatter, ConsoleHandler, StepBar


def test_in_a_log_the_end_of_the_bar_is_one_line_with_the_last_steps_figures(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    bar = StepBar(3, 0, enabled=True)
    bar.mininterval = bar.miniters = 0  # every update draws a line, the last one included
    bar.dynamic_miniters = False
    for loss in (3.0, 2.0, 1.0):
        bar.step(loss, 0.1, "samples", 10.0)
    bar.close()
    ends = [line for line in log.getvalue().splitlines() if "3/3" in line]
    assert len(ends) == 1 and "loss=1.0000" in ends[0], log.getvalue()


def test_the_bar_closes_with_the_last_steps_figures_though_it_was_not_redrawn(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    bar = StepBar(3, 0, enabled=True)  # a log: one line every 30 s at most, so none between the first and the end
    for loss in (3.0, 2.0, 1.5):
        bar.step(loss, 0.1, "samples", 10.0)
    bar.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "3/3" in lines[-1] and "loss=1.5000" in lines[-1], lines


def test_the_console_shows_a_messages_first_line_and_the_file_all_of_it():
    record = logging.LogRecord("accutrain", logging.WARNING, __file__, 1, "short\nthe detail", None, None)
    assert ConsoleFormatter().format(record).endswith("] warning: short")
    assert logging.Formatter("%(message)s").format(record) == "short\nthe detail"


def test_a_log_line_lifts_the_bar_off_its_line_and_draws_it_again_below(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    bar = StepBar(10, 0, enabled=True)
    bar.step(2.0, 0.1, "samples", 10.0)
    handler = ConsoleHandler(screen)
    handler.setFormatter(ConsoleFormatter())
    handler.emit(logging.LogRecord("accutrain", logging.INFO, __file__, 1, "step 1", None, None))
    bar.close()
    written = screen.getvalue()
    line_start = written.index("] step 1") - len("[hh:mm:ss")
    assert written[line_start - 1] == "\r", repr(written)  # the log line starts at the first column
    assert "1/10" in written[written.index("] step 1"):], repr(written)  # and the bar is drawn again after it


def test_batchnorm_and_dropout_warnings_are_one_short_line_then_their_detail():
    from torch import nn

    from accutrain.models.norms import batchnorm_warning
    from accutrain.models.pitfalls import dropout_warning

    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.1), nn.Linear(4, 2)).train()
    for warning in (batchnorm_warning(net, 8, 32, 1, False), dropout_warning(net, 8, 32)):
        short, _, detail = warning.partition("\n")
        assert len(f"[hh:mm:ss] warning: {short}") <= 120 and detail, warning
    assert "Remedies: batchnorm.convert=group" in batchnorm_warning(net, 8, 32, 1, False).partition("\n")[2]


def test_the_summary_names_the_peak_memory_as_the_most_of_several_ranks():
    from accutrain.train.metrics import summary_lines

    assert summary_lines(4, 64, 64, 1.0, 1.5, None, 700.0, ranks=2)[-1].endswith("peak memory 700 MiB (the most of 2 "
                                                                                 "ranks)")
    assert summary_lines(4, 64, 64, 1.0, 1.5, None, 700.0)[-1].endswith("peak memory 700 MiB")
