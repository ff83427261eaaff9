"""`trainer.compile`: the model compiled once by torch.compile, in place (nn.Module.compile: parameter names, hence
checkpoints, unchanged), after activation checkpointing and before DDP wraps it, so that DDP's no_sync still skips
the all-reduce of every micro-batch but the window's last.

Recompilation with accumulation: the first micro-batch size compiles a static graph; the first other size (the
epoch's short tail, an out-of-memory re-split) one graph with a dynamic batch dimension that serves every later
size. Sizes 0 and 1, which dynamo always specialises (a rank's empty share of a short window, a tail of one
sample), and evaluation (no_grad: a graph of its own) run the same module eagerly. So a run compiles at most 2
graphs, and the log says how long that took.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager, Optional

import torch
from torch import nn


def compile_model(model: nn.Module, mode: Optional[str], backend: str) -> None:
    """Compile `model` in place (its first call compiles); WATCH counts graphs and seconds from here.

    What nn.Module.compile does (torch.compile of the module's call, kept where Module.__call__ looks for it), but
    through a function of this file: a module built only of torch.nn code (nn.Sequential of torch layers) would
    otherwise start dynamo in a frame of torch.nn, which some PyTorch versions (2.11, seen on a GPU) skip, running
    the whole model eagerly without a word. From here dynamo traces the module's call inline."""
    global WATCH
    call = model._call_impl

    def compiled_call(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    model._compiled_call_impl = torch.compile(compiled_call, mode=mode, backend=backend)
    WATCH = CompileWatch(compiled_call.__code__)


def is_compiled(model: nn.Module) -> bool:
    """Whether `model` (or the module a DDP wrapper holds) was compiled in place. Asked once per micro-batch: a
    module's __getattr__ for an attribute it lacks raises inside, so the wrapper's `module` is looked up by type."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return getattr(inner, "_compiled_call_impl", None) is not None


def eager(model: nn.Module, samples: Optional[int] = None) -> ContextManager:
    """Run a compiled model eagerly inside the block — for a micro-batch of 0 or 1 samples (`samples`), or always
    (None: evaluation) — so that those never compile graphs of their own. Nothing for a model not compiled."""
    if (samples is not None and samples > 1) or not is_compiled(model):
        return nullcontext()
    return torch.compiler.set_stance("force_eager")


class CompileWatch:
    """Graphs compiled and seconds spent compiling since it was made (dynamo's process-wide counters), and whether
    the compiled call has graphs at all: a later run in the same process (a Hydra multirun's next job) reuses the
    graphs an earlier one compiled for the same code, so it compiles nothing new and still runs compiled."""

    def __init__(self, code: Optional[Any] = None) -> None:
        self.code = code
        self.graphs0, self.seconds0 = self._graphs(), self._seconds()

    @property
    def runs_graphs(self) -> bool:
        """Whether dynamo holds a compiled graph for the compiled call (compiled now or by an earlier run)."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return self.graphs > 0 or (self.code is not None and bool(_debug_get_cache_entry_list(self.code)))

    @staticmethod
    def _graphs() -> int:
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"]

    @staticmethod
    def _seconds() -> float:
        from torch._dynamo.utils import compilation_time_metrics

        # dynamo's tracing with the forward's compilation; the backward's, compiled at its first call
        return sum(sum(times) for key, times in compilation_time_metrics.items()
                   if key == "_compile.compile_inner" or key.startswith("backward."))

    @property
    def graphs(self) -> int:
        return self._graphs() - self.graphs0

    @property
    def seconds(self) -> float:
        return self._seconds() - self.seconds0


WATCH: Optional[CompileWatch] = None  # since the last compile_model (one run per process; a check before it counts)
