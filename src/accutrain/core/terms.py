"""|W| for element-normalised losses (tokens): the window's loss terms counted from its samples' targets alone,
before its first backward, without loading the window — each sample's count is taken once, from the sample as the
loss sees it (its target after the shift, less ignore_index), and kept."""
from __future__ import annotations

import torch

from accutrain.core.loader import WindowData
from accutrain.core.loss import Loss
from accutrain.core.windows import Window, WindowSampler


class TermCounts:
    """This rank's loss terms of a window: the sum of its samples' counts. A sample's count is the same in every
    micro-batch it may land in (padding carries ignore_index), so the sum is what counting the loaded micro-batches
    gives, whatever the split. With random views (`augment=`), which may change a target, each epoch counts anew; a
    stream's samples (core/streams.py) are counted from the window's own."""

    def __init__(self, data: WindowData, sampler: WindowSampler, loss: Loss) -> None:
        self.data, self.sampler, self.loss = data, sampler, loss
        self.per_epoch = getattr(data.dataset, "view", None) is not None
        self.counts = torch.full((len(data),), -1, dtype=torch.int64)  # -1: not counted yet
        self.epoch = -1

    def __call__(self, window: Window) -> int:
        if self.sampler.streamed:  # a stream's window holds its samples: each counted once, as it comes
            return sum(self.loss.terms([self.data.format(list(m.items))]) for m in self.sampler.micro_batches_of(window)
                       if m)
        if self.per_epoch and window.epoch != self.epoch:
            self.counts.fill_(-1)
        self.epoch = window.epoch
        share = torch.tensor(self.sampler.share_of(window), dtype=torch.int64)
        if not len(share):
            return 0
        for i in share[self.counts[share] < 0].tolist():  # one sample loaded at a time, never the window
            self.counts[i] = self.count(window.epoch, i)
        return int(self.counts[share].sum())

    def count(self, epoch: int, index: int) -> int:
        """The loss terms of sample `index` as epoch `epoch` sees it."""
        return self.loss.terms([self.data.format([self.data.item(epoch, index)])])
