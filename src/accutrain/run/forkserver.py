"""Imported by the fork server alone, first of what it preloads (launch.start_method): from then on it dies with the
command that started it, and the ranks it forks die with it (launch._worker) — none trains on as an orphan."""
from accutrain.signals import die_with_parent

die_with_parent()
