"""|W| of an element-normalised loss counted from each sample's targets (core/terms.py): the count the loaded
micro-batches give, on every rank, under any split — without the window ever being loaded whole."""
import pytest
import torch

from accutrain.config.validate import typed_run
from accutrain.core.losses.cross_entropy import SummedLoss
from accutrain.core.terms import TermCounts
from accutrain.core.windows import WindowSampler
from accutrain.dist import World
from accutrain.train.build import build

SEQ = ["data=sequences", "data.size=53", "data.val_size=8", "data.min_length=2", "data.max_length=12",
       "model=char_lm", "model.hidden=8", "model.embedding=8", "loss.normalize=elements", "trainer.epochs=2"]


@pytest.mark.parametrize("split", [["micro_batch=4", "accum=3"], ["micro_batch=16", "accum=1"]])
@pytest.mark.parametrize("shift", [False, True])
def test_kept_counts_equal_the_loaded_micro_batches_on_every_rank(compose, tmp_path, split, shift):
    cfg = compose(*SEQ, *split, f"loss.shift_labels={str(shift).lower()}")
    c = build(typed_run(cfg), World(), torch.device("cpu"))
    data, loss = c.loader.dataset, c.loss
    assert loss.elements and loss.shift_labels is shift
    for world in (1, 2):
        samplers = [WindowSampler(c.plan, cfg.seed, rank, world) for rank in range(world)]
        counts = [TermCounts(data, sampler, loss) for sampler in samplers]
        for epoch in range(2):
            per_rank = []
            for sampler in samplers:
                sampler.set_epoch(epoch)
                per_rank.append(list(sampler.windows()))
            for windows in zip(*per_rank):  # the same window, as each rank sees it
                loaded = [loss.terms([data.__getitems__(m)[1] for m in micro_batches]) for micro_batches in windows]
                kept = [count(micro_batches[0].window) for count, micro_batches in zip(counts, windows)]
                assert kept == loaded
    assert (counts[0].counts >= 0).any() and not counts[0].per_epoch


def test_a_padded_target_adds_no_term():
    loss = SummedLoss(elements=True, ignore_index=-100)
    assert loss.terms([(torch.zeros(2, 3), torch.tensor([[1, 2, -100], [3, -100, -100]]))]) == 3
