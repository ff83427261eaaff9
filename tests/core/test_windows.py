"""The sampler: the seed alone decides which samples share a window, however the window is cut."""
import pytest
import torch

from accutrain.core.loader import window_loader, windows_of
from accutrain.core.options import LastWindow
from accutrain.core.plan import make_plan
from accutrain.core.windows import WindowSampler, epoch_order, rank_share


def sampler_of(micro_batch, accum, devices=1, rank=0, n=110, seed=0, last_window=LastWindow.step):
    plan = make_plan(micro_batch=micro_batch, accum=accum, devices=devices, global_batch=None, train_size=n,
                     last_window=last_window, epochs=1, max_steps=None)
    return WindowSampler(plan, seed, rank, devices)


def windows(micro_batch, accum, devices=1, rank=0, n=110, seed=0, epoch=0, last_window=LastWindow.step):
    sampler = sampler_of(micro_batch, accum, devices, rank, n, seed, last_window)
    sampler.set_epoch(epoch)
    return list(sampler.windows())


def members(window_list):
    return [sorted(i for mb in w for i in mb) for w in window_list]


@pytest.mark.quick
def test_same_windows_whatever_the_split():
    reference = members(windows(32, 1))
    assert members(windows(8, 4)) == reference
    assert members(windows(4, 8)) == reference
    assert members(windows(16, 2)) == reference
    # several ranks together hold exactly the window
    two_ranks = [windows(8, 2, devices=2, rank=r) for r in (0, 1)]
    assert [sorted(a + b) for a, b in zip(members(two_ranks[0]), members(two_ranks[1]))] == reference


def test_windows_cover_the_epoch_once():
    seen = [i for w in members(windows(8, 4)) for i in w]
    assert sorted(seen) == list(range(110))


def test_short_tail_is_split_in_micro_batches_never_padded():
    last = windows(8, 4)[-1]
    assert last[0].window.size == 14 and last[0].window.sizes == (8, 6)
    assert [len(mb) for mb in last] == [8, 6]
    assert [len(mb) for mb in windows(8, 4)[0]] == [8, 8, 8, 8]


def test_drop_policy_leaves_out_the_tail():
    ws = windows(8, 4, last_window=LastWindow.drop)
    assert [w[0].window.size for w in ws] == [32, 32, 32]


def test_order_depends_on_seed_and_epoch():
    assert members(windows(8, 4, seed=0)) != members(windows(8, 4, seed=1))
    assert members(windows(8, 4, epoch=0)) != members(windows(8, 4, epoch=1))
    assert epoch_order(50, 3, 2).tolist() == epoch_order(50, 3, 2).tolist()


def test_rank_share_gives_every_rank_the_same_number_of_micro_steps():
    samples = list(range(13))  # a short window: micro-batches of 4 → 4, 4, 4, 1 over 3 ranks
    parts = [rank_share(samples, 4, r, 3) for r in range(3)]
    assert [len(p) for p in parts] == [2, 2, 2]
    assert parts[0] == [[0, 1, 2, 3], [12]]
    assert parts[1] == [[4, 5, 6, 7], []]
    assert sorted(i for p in parts for mb in p for i in mb) == samples


def test_resume_position_skips_whole_windows():
    plan = make_plan(micro_batch=8, accum=4, devices=1, global_batch=None, train_size=110,
                     last_window=LastWindow.step, epochs=1, max_steps=None)
    sampler = WindowSampler(plan, 0)
    sampler.set_epoch(0, start_window=2)
    rest = list(sampler.windows())
    assert [w[0].window.index for w in rest] == [2, 3]
    assert members(rest) == members(windows(8, 4))[2:]
    assert list(sampler) == [mb for w in rest for mb in w]
    assert len(sampler) == len(list(sampler))


@pytest.mark.parametrize("n, micro_batch, accum, devices, start", [
    (110, 8, 4, 1, 0), (110, 8, 2, 2, 0), (117, 8, 2, 2, 3), (117, 8, 2, 2, 4), (96, 8, 2, 2, 1), (5, 4, 2, 3, 0)])
def test_length_counts_every_micro_batch_empty_ones_included(n, micro_batch, accum, devices, start):
    plan = make_plan(micro_batch=micro_batch, accum=accum, devices=devices, global_batch=None, train_size=n,
                     last_window=LastWindow.step, epochs=1, max_steps=None)
    for rank in range(devices):
        sampler = WindowSampler(plan, 0, rank, devices)
        sampler.set_epoch(0, start_window=start)
        assert len(sampler) == len(list(sampler))


def test_the_loader_walks_the_sampler_once_and_groups_micro_batches_by_window():
    """Rank 1 of 2 on 20 samples in windows of 16: its share of the short last window is empty, and still comes."""
    data = torch.utils.data.TensorDataset(torch.arange(20.0)[:, None], torch.arange(20))
    plan = make_plan(micro_batch=4, accum=2, devices=2, global_batch=None, train_size=20,
                     last_window=LastWindow.step, epochs=1, max_steps=None)
    sampler = WindowSampler(plan, 0, rank=1, world=2)
    loader = window_loader(data, sampler, num_workers=0, pin_memory=False, generator=torch.Generator())
    seen = [(window, [[] if batch.stand_in else batch.target.tolist() for batch in batches])
            for window, batches in windows_of(loader)]
    expected = [[list(mb) for mb in w] for w in sampler.windows()]
    assert [batches for _, batches in seen] == expected
    assert [window.sizes for window, _ in seen] == [(4, 4), (0,)]  # the last window's 4 samples are rank 0's
    assert seen[-1][1] == [[]]  # a stand-in: two real samples that count for nothing


def two_ranks_sampler(rank):
    """Rank `rank` of 2 on 35 samples in windows of 16, 16 and 3: rank 0 reads a short micro-batch of 3 last, and
    rank 1 an empty share (a stand-in)."""
    return sampler_of(micro_batch=4, accum=2, devices=2, rank=rank, n=35, seed=3)


def test_in_memory_micro_batches_are_gathered_bit_for_bit_as_collated():
    """A micro-batch of in-memory tensors is taken in one indexing: the very tensors (values, dtype, shape, layout)
    that torch's default collate stacks from the items one by one."""
    from accutrain.core.batches import BatchFormat
    from accutrain.core.loader import WindowData
    from accutrain.data.datasets import InMemory

    g = torch.Generator().manual_seed(0)
    data = InMemory(torch.randn(37, 3, 5, 5, generator=g), torch.randint(0, 10, (37,), generator=g))
    gathered = WindowData(data)
    assert gathered.gather is not None
    sizes = set()
    for micro_batch in (mb for rank in (0, 1) for mb in two_ranks_sampler(rank)):
        window, batch = gathered.__getitems__(micro_batch)
        assert window is micro_batch.window
        sizes.add(len(batch))
        if not micro_batch:
            assert batch.stand_in
            continue
        collated = BatchFormat()([data[i] for i in micro_batch])
        for ours, theirs in ((batch.inputs, collated.inputs), (batch.target, collated.target)):
            assert torch.equal(ours, theirs)
            assert (ours.dtype, ours.shape, ours.stride()) == (theirs.dtype, theirs.shape, theirs.stride())
    assert sizes == {4, 3, 0}  # full, short and empty shares were all read
    # A collate of the data's own, or MixUp/CutMix, takes the items one by one as before.
    assert WindowData(data, BatchFormat(collate=lambda items: BatchFormat()(items))).gather is None


def test_the_loader_reads_the_same_batches_in_process_and_in_worker_processes():
    """num_workers=0 reads each micro-batch in this process, without torch's DataLoader; with workers the
    DataLoader reads them. Both yield the same windows and the same tensors, stand-ins included."""
    from accutrain.core.loader import InProcessLoader

    data = torch.utils.data.TensorDataset(torch.randn(35, 6), torch.arange(35))
    sampler = two_ranks_sampler(rank=1)
    here = window_loader(data, sampler, num_workers=0, pin_memory=False, generator=torch.Generator())
    workers = window_loader(data, sampler, num_workers=1, pin_memory=False, generator=torch.Generator())
    assert isinstance(here, InProcessLoader) and isinstance(workers, torch.utils.data.DataLoader)
    assert len(here) == len(workers) == len(sampler)
    for ours, theirs in zip(list(here), list(workers), strict=True):
        assert ours[0] == theirs[0] and ours[1].stand_in == theirs[1].stand_in
        assert torch.equal(ours[1].inputs, theirs[1].inputs) and torch.equal(ours[1].target, theirs[1].target)


@pytest.mark.parametrize("micro_batch, accum, devices", [(8, 4, 1), (3, 5, 2), (32, 1, 2)])
def test_a_window_read_again_is_the_window_the_sampler_gave(micro_batch, accum, devices):
    """micro_batches_of(window): the same micro-batches (samples, order, empty ones) as the walk gave, on every rank
    and in every epoch, so that an out-of-memory re-split reads a window anew instead of keeping it."""
    for rank in range(devices):
        sampler = sampler_of(micro_batch, accum, devices, rank)
        for epoch in (0, 3):
            sampler.set_epoch(epoch)
            for given in sampler.windows():
                window = given[0].window
                again = sampler.micro_batches_of(window)
                assert [list(m) for m in again] == [list(m) for m in given]
                assert all(m.window == window for m in again)
                assert sampler.share_of(window) == [i for m in given for i in m]
                assert sorted(sampler.samples_of(window)) == sorted(
                    i for r in range(devices) for m in sampler_of(micro_batch, accum, devices, r).micro_batches_of(
                        window) for i in m)
