"""The console entry points: accutrain, accutrain-check and accutrain-report."""
from accutrain.cli.process import prepare

prepare()  # before anything else the command imports
