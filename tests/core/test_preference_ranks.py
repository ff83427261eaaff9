"""Every preference loss on 2 gloo ranks: a window of 7 samples shared unevenly (4 and 3, in micro-batches of 2 and a
last of 1), each rank accumulating its share with world=2 and the gradients averaged as DDP averages them, equals
the window as one micro-batch in one process — each loss.kind, loss.nll_coef, loss=orpo and loss=kto, whose
reference point is taken over both ranks' samples; the window's figures are every rank's."""
import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from test_preference import files  # noqa: F401 (the records, a fixture)

from accutrain.core.batches import BatchFormat
from accutrain.core.losses.dpo import dpo, orpo
from accutrain.core.losses.kto import kto

pytest.importorskip("transformers")
pytest.importorskip("peft")

VARIANTS = {"sigmoid": ("pairs", lambda: dpo(kind="sigmoid", beta=0.5)),
            "ipo": ("pairs", lambda: dpo(kind="ipo", beta=0.5)),
            "hinge": ("pairs", lambda: dpo(kind="hinge", beta=2.0)),
            "simpo": ("pairs", lambda: dpo(kind="simpo", beta=2.0)),
            "rpo": ("pairs", lambda: dpo(kind="sigmoid", beta=0.5, nll_coef=0.7)),
            "orpo": ("pairs", lambda: orpo(beta=0.5)),
            "kto": ("feedback", lambda: kto(beta=0.5, undesirable_weight=1.33, seed=7))}
WINDOW = 7


def step(variant, files, shares, world):  # noqa: F811
    """This process's gradient and figures after accumulating its micro-batches of the window."""
    from test_preference import data_of, tiny_lora, trained

    kind, make = VARIANTS[variant]
    data = data_of(files / f"{kind}.jsonl")
    fmt = BatchFormat(data.collate)
    model, loss = tiny_lora(seed=2), make()  # seed 2: the window's KTO reference point z0 > 0
    loss.attach(model)
    batches = [fmt([data.train[i] for i in share]) for share in shares]
    loss.accumulate(model, batches, WINDOW, torch.device("cpu"), world=world)
    grads = [p.grad.clone() for p in trained(model)]
    if world > 1:  # DDP's mean of the ranks' gradients
        for g in grads:
            tdist.all_reduce(g)
            g /= world
    return grads, {k: float(v) for k, v in loss.figures().items()}


def rank_main(rank, world, init, files, out):  # noqa: F811
    tdist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mine = list(range(WINDOW))[rank::world]  # rank 0: 0, 2, 4, 6; rank 1: 1, 3, 5
    shares = [mine[k:k + 2] for k in range(0, len(mine), 2)]
    results = {variant: step(variant, files, shares, world) for variant in VARIANTS}
    if rank == 0:
        torch.save(results, out)
    tdist.destroy_process_group()


def test_two_ranks_take_the_big_batch_step_for_every_loss(files, tmp_path):  # noqa: F811
    torch.set_num_threads(1)
    mp.spawn(rank_main, args=(2, tmp_path / "init", files, tmp_path / "ranks.pt"), nprocs=2, join=True)
    ranks = torch.load(tmp_path / "ranks.pt")
    for variant in VARIANTS:
        grads, figures = step(variant, files, [list(range(WINDOW))], 1)
        theirs, their_figures = ranks[variant]
        scale = max(g.abs().max().item() for g in grads)
        assert max((a - b).abs().max().item() for a, b in zip(grads, theirs)) < 1e-5 * scale, variant
        if variant == "kto":
            assert figures["kl"] > 0.1  # z0 in play: taken per rank, it would differ
        for name, value in figures.items():
            assert their_figures[name] == pytest.approx(value, abs=1e-6), (variant, name)
