"""Imported by the fork server alone, first of what it preloads (workers.start_method): from then on it dies with the
command that started it, and the ranks it forks die with it (workers._worker) — none trains on as an orphan. Ctrl-C
reaches every process of the terminal's group: the fork server, importing PyTorch for seconds, leaves it to the
command (which stops or kills the ranks) instead of printing the traceback of an interrupted import. The ranks it
forks run in a session of their own and take the Ctrl-C the command passes on: before they train it stops them at
once (workers._worker), then their stop request's handler takes it."""
import signal

from accutrain.signals import die_with_parent

die_with_parent()
signal.signal(signal.SIGINT, signal.SIG_IGN)
