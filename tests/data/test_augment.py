"""Augmentation that keeps the promise: per-sample views from (seed, epoch, sample), MixUp/CutMix over the window,
label smoothing — the same run under any micro_batch, accum, devices or loader.num_workers."""
import random
import signal

import numpy as np
import pytest
import torch
from conftest import (
    RUN,
    TINY,
    WAIT_S,
    assert_identical,
    assert_one_line_error,
    assert_one_line_user_error,
    assert_same_weights,
    final_weights,
    read_metrics,
    run_cli,
    run_of,
    start,
    train_here,
    train_run,
    wait_for_steps,
)

from accutrain.core.loader import WindowData
from accutrain.core.losses.cross_entropy import SummedLoss
from accutrain.core.mixing import Mix, Mixer
from accutrain.core.options import LastWindow
from accutrain.core.plan import make_plan
from accutrain.core.step import accumulate
from accutrain.core.windows import MicroBatch, Window, WindowSampler
from accutrain.data import views
from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.train.build import build
from accutrain.train.check import components_for_check, run_check

# 110 samples = windows of 32, 32, 32 and 14: micro_batch=8 leaves a micro-batch of 6, devices=2 a rank with less.
# grad_clip would show a per-micro-batch clip; label smoothing and MixUp's soft targets go through the summed loss.
WINDOWS = [*TINY, "data.size=110", "trainer.epochs=2", "trainer.grad_clip=0.5"]
RECIPES = {
    "crop_flip": ["augment=crop_flip"],
    "rrc_erasing_mix_window": ["augment=rrc_flip", "augment.random_erasing=0.5", "augment.mixup_alpha=0.4",
                               "augment.cutmix_alpha=1.0", "augment.mix_mode=window"],
    "crop_flip_mix_sample_smoothing": ["augment=crop_flip", "augment.mixup_alpha=0.4", "augment.cutmix_alpha=1.0",
                                       "augment.mix_mode=sample", "augment.mix_prob=0.8", "loss.label_smoothing=0.1"],
}
SEQ = ["data=sequences", "data.size=40", "data.val_size=8", "data.max_length=8", "model=char_lm", "trainer.epochs=1"]
SPLITS = {"accum": ["micro_batch=8", "accum=4"], "workers": ["micro_batch=8", "accum=4", "loader.num_workers=2"],
          "devices": ["devices=2", "micro_batch=8", "accum=2"]}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_augmented_runs_are_the_same_run_under_any_split(tmp_path, recipe):
    args = [*WINDOWS, *RECIPES[recipe]]
    big, _ = train_here(tmp_path, "big", *args, "micro_batch=32", "accum=1")
    splits = ["accum", "workers"] + (["devices"] if recipe.endswith("sample_smoothing") else [])  # spawns: once
    for split in splits:
        run, _ = train_here(tmp_path, split, *args, *SPLITS[split])
        assert_same_weights(final_weights(run), final_weights(big))
        assert [r["loss"] for r in read_metrics(run)[0]] == pytest.approx([r["loss"] for r in read_metrics(big)[0]],
                                                                          rel=1e-5)
    assert [r["samples"] for r in read_metrics(big)[0]] == [32, 32, 32, 14] * 2
    plain, _ = train_here(tmp_path, "plain", *WINDOWS, "micro_batch=32", "accum=1", "augment=none")
    assert any(not torch.allclose(a, b) for a, b in zip(final_weights(plain).values(),
                                                       final_weights(big).values())), "augmentation changed nothing"


def loader_views(compose, *args, epoch=0):
    """{dataset index: (image, target)} of the first window of `epoch`, as the train loader yields them."""
    c = build(run_of(*args), World(), torch.device("cpu"))
    c.sampler.set_epoch(epoch)
    out = {}
    for micro_batch in next(c.sampler.windows()):
        _, batch = c.loader.dataset.__getitems__(micro_batch)
        out.update({i: (batch.inputs[k], batch.target[k]) for k, i in enumerate(micro_batch)})
    return out, c


def test_a_samples_view_depends_on_seed_epoch_and_sample_only(compose):
    args = [*TINY, "augment=crop_flip", "augment.padding=2"]
    first, c = loader_views(compose, *args, "micro_batch=8", "accum=4")
    again, _ = loader_views(compose, *args, "micro_batch=32")
    assert first.keys() == again.keys()
    for i in first:  # the same view whatever the split, and the same as the dataset's own view of epoch 0
        assert torch.equal(first[i][0], again[i][0])
        assert torch.equal(first[i][0], c.loader.dataset.dataset.view(0, i)[0])
    data = c.loader.dataset.dataset
    raw = torch.stack([data.raw[i][0] for i in first])
    assert not torch.equal(torch.stack([first[i][0] for i in first]), raw), "no sample was augmented"
    epochs = [torch.stack([data.view(e, i)[0] for i in first]) for e in (0, 1)]
    assert not torch.equal(*epochs)  # another epoch, another view
    other_seed = views.Views(data.raw, data.transform, seed=1)
    assert not torch.equal(epochs[0], torch.stack([other_seed.view(0, i)[0] for i in first]))
    state = torch.get_rng_state()
    data.view(3, 5)
    assert torch.equal(torch.get_rng_state(), state)  # the run's own stream (dropout, …) never moves


def test_evaluation_is_never_augmented(compose):
    c = build(run_of(*TINY, "augment=rrc_flip", "augment.random_erasing=1.0"), World(), torch.device("cpu"))
    val = c.val_loader.dataset.dataset  # this rank's share of the held-out split
    source = c.loader.dataset.dataset
    assert isinstance(val, views.Views) and val.seed is None  # a fixed view: resize 8 / 0.875 → 9, centre-crop 8
    first = [b.inputs.clone() for b in c.val_loader]
    assert all(torch.equal(a, b.inputs) for a, b in zip(first, c.val_loader))
    expected = torch.nn.functional.interpolate(val.raw[0][0][None], size=(9, 9), mode="bilinear", antialias=True,
                                               align_corners=False)[0, :, :8, :8]
    torch.testing.assert_close(val[0][0], expected, rtol=1e-4, atol=1e-4)
    assert source.seed == 0 and not torch.equal(source.view(0, 0)[0], source.view(1, 0)[0])


def test_mixing_draws_depend_on_the_window_only_and_pairs_stay_in_it():
    mixer = Mixer(seed=0, num_classes=3, height=8, width=8, mixup_alpha=0.4, cutmix_alpha=1.0, per_sample=True)
    samples = list(range(100, 132))
    plan = mixer.plan(epoch=2, window=5, samples=samples)
    assert plan == mixer.plan(2, 5, samples) and plan != mixer.plan(2, 6, samples) and plan != mixer.plan(3, 5, samples)
    assert {m.partner for m in plan} <= set(samples)
    assert len({m.lam for m in plan}) > 10  # per sample: a λ each
    for m in plan:
        assert 0 <= m.lam <= 1
        if m.box is not None:  # CutMix's λ is the share of the image left unboxed
            y0, y1, x0, x1 = m.box
            assert m.lam == pytest.approx(1 - (y1 - y0) * (x1 - x0) / 64)
    window = Mixer(0, 3, 8, 8, mixup_alpha=0.4, per_sample=False).plan(0, 0, samples)
    assert len({m.lam for m in window}) == 1  # per window: one λ
    image, other = torch.zeros(1, 8, 8), torch.ones(1, 8, 8)
    x, y = mixer.mixed((image, 0), (other, 2), Mix(1, 0.75))
    assert torch.allclose(x, torch.full_like(x, 0.25)) and torch.allclose(y, torch.tensor([0.75, 0, 0.25]))
    x, y = mixer.mixed((image, 0), (other, 2), Mix(1, 0.75, (0, 4, 0, 4)))
    assert x.sum() == 16 and torch.allclose(y, torch.tensor([0.75, 0, 0.25]))


def test_a_window_read_again_has_the_same_mixes():
    """An out-of-memory re-split reads the window anew (WindowSampler.micro_batches_of): its MixUp/CutMix draws are
    the window's, not the walk's, so they are the ones the first reading had."""
    mixer = Mixer(seed=0, num_classes=3, height=8, width=8, mixup_alpha=0.4, cutmix_alpha=1.0, per_sample=True)
    plan = make_plan(micro_batch=3, accum=5, devices=2, global_batch=None, train_size=110, last_window=LastWindow.step,
                     epochs=1, max_steps=None)
    for rank in range(2):
        sampler = WindowSampler(plan, 0, rank, 2, mixer)
        for given in sampler.windows():
            again = sampler.micro_batches_of(given[0].window)
            assert [(list(m), m.mixes) for m in again] == [(list(m), m.mixes) for m in given]


def test_a_partner_in_another_micro_batch_or_rank_is_read_by_the_loader(compose):
    args = [*TINY, "augment.mixup_alpha=1.0", "augment.mix_mode=sample"]
    one, c = loader_views(compose, *args, "micro_batch=32")
    mixes = next(c.sampler.windows())[0].mixes
    data = c.loader.dataset
    for i, mix in zip(next(c.sampler.windows())[0], mixes):  # recomputed from the two samples' own views
        x, y = data.mixer.mixed(data.item(0, i), data.item(0, mix.partner), mix)
        assert torch.equal(one[i][0], x) and torch.equal(one[i][1], y)
    assert sum(m.partner != i for i, m in zip(next(c.sampler.windows())[0], mixes)) > 20
    plan = make_plan(micro_batch=8, accum=2, devices=2, global_batch=None, train_size=len(data),
                     last_window=LastWindow.step, epochs=1, max_steps=None)
    for rank in (0, 1):  # devices=2 micro_batch=8 accum=2: each rank reads its samples' partners, wherever they sit
        for micro_batch in next(WindowSampler(plan, 0, rank, 2, data.mixer).windows()):
            _, batch = data.__getitems__(micro_batch)
            for k, i in enumerate(micro_batch):
                assert torch.equal(batch.inputs[k], one[i][0]) and torch.equal(batch.target[k], one[i][1])


@pytest.mark.parametrize("per_element", [False, True])
def test_label_smoothing_is_exact_under_any_split(per_element):
    torch.manual_seed(0)
    model = torch.nn.Conv1d(4, 5, 1) if per_element else torch.nn.Linear(4, 5)
    x = torch.randn(11, 4, 6) if per_element else torch.randn(11, 4)
    y = torch.randint(5, (11, 6) if per_element else (11,))
    if per_element:
        y[:, 4:] = -100  # padding: neither in the loss nor in the count
    loss = SummedLoss(elements=per_element, label_smoothing=0.2)
    terms = loss.terms([(x, y)])
    grads = []
    for cut in ([11], [4, 4, 3]):
        model.zero_grad()
        parts = list(zip(x.split(cut), y.split(cut)))
        accumulate(model, parts, terms, torch.device("cpu"), loss=loss)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    logits = model(x)  # the formula: (1 - ε) × NLL + ε × the mean of -log p over the classes, per counted term
    logp = torch.log_softmax(logits, 1)
    counted = y != -100
    nll = -logp.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
    expected = ((0.8 * nll - 0.2 * logp.mean(1))[counted]).sum()
    torch.testing.assert_close(loss(logits, y), expected)


def test_the_check_compares_with_augmentation_and_mixing_on(compose):
    check = run_check(components_for_check(run_of(*TINY, "augment=crop_flip", "augment.cutmix_alpha=1.0",
                                                   "augment.mix_mode=sample", "loss.label_smoothing=0.1",
                                                   "micro_batch=8", "accum=4")))
    assert check.faithful and not check.causes


def test_pretrained_normalisation_comes_from_the_weights_metadata(compose):
    import torchvision

    transforms = torchvision.models.ResNet18_Weights.DEFAULT.transforms()
    cfg = run_of("model=resnet18", "model.pretrained=true").model
    assert views.pretrained_normalisation(cfg, 3) == (tuple(transforms.mean), tuple(transforms.std))
    assert views.pretrained_normalisation(cfg, 1) == ((np.mean(transforms.mean),), (np.mean(transforms.std),))
    assert views.pretrained_normalisation(run_of("model=resnet18").model, 3) is None


@pytest.mark.parametrize("args, fragments", [
    (["augment.mixup_alpha=-0.2"], ["augment.mixup_alpha=-0.2", "positive Beta"]),
    (["augment=rrc_flip", "augment.scale=[0.5,1.5]"], ["augment.scale=[0.5, 1.5]", "larger than the image"]),
    (["augment.cutmix_alpha=1.0", *SEQ], ["augment.cutmix_alpha=1.0", "per element"]),
    (["augment=crop_flip", *SEQ], ["augment.crop=pad", "no images to augment"]),
    (["loss.label_smoothing=1.5"], ["loss.label_smoothing=1.5"]),
])
def test_bad_augmentation_input_is_one_line_naming_the_key(tmp_path, args, fragments):
    from accutrain.runtime.launch import train

    with pytest.raises(UserError) as e:
        train(run_of(*(args if "data=sequences" in args else [*TINY, *args])), tmp_path / "run")
    assert_one_line_user_error(e.value, *fragments)


def test_an_unknown_recipe_is_one_line_from_the_command_line(tmp_path):
    proc = run_cli(*TINY, "augment=sharpen", cwd=tmp_path, check=False)
    assert_one_line_error(proc, "augment", "sharpen")
    assert proc.returncode == 2


@pytest.mark.long  # a feature's resume: the core kill-and-resume test runs every time
@pytest.mark.slow
def test_sigkilled_augmented_and_mixed_run_resumes_bit_identical(slow):
    args = [*RUN, "augment=crop_flip", "augment.padding=2", "augment.mixup_alpha=0.4", "augment.cutmix_alpha=1.0",
            "augment.mix_mode=sample", "loss.label_smoothing=0.1"]
    reference, _ = train_here(slow, "reference", *args)
    proc = start(slow, "killed", *args, "+model.delay=0.02")
    wait_for_steps(slow / "killed", random.Random().randint(2, 10), proc)
    proc.kill()
    assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL
    resumed, out = train_run(slow, "killed", *args, "resume=auto")
    assert "resumed from" in out.stderr
    assert_identical(final_weights(resumed), final_weights(reference))
    assert [r["loss"] for r in read_metrics(resumed)[0]] == [r["loss"] for r in read_metrics(reference)[0]]


def test_window_data_without_views_or_mixer_is_unchanged():
    data = [(torch.full((1, 2, 2), float(i)), torch.tensor(i % 3)) for i in range(6)]
    window = Window(0, 0, 3, (3,), 3)
    _, batch = WindowData(data).__getitems__(MicroBatch([4, 1, 2], window))
    assert batch.target.tolist() == [1, 1, 2] and batch.inputs[:, 0, 0, 0].tolist() == [4, 1, 2]


def test_image_folder_trains_on_random_resized_crops_and_evaluates_on_a_centre_crop(tmp_path, compose):
    from conftest import make_image_folder
    from torchvision.transforms import v2

    from accutrain.data.folders import image_folder

    root = make_image_folder(tmp_path, size=12)
    cfg = run_of("data=imagefolder", f"data.root={root}", "data.image_size=8", "model=resnet18",
                 "model.pretrained=true")
    assert cfg.augment.crop.name == "resized" and cfg.augment.eval_crop_ratio == 0.875  # the data's default recipe
    mean, std = views.pretrained_normalisation(cfg.model, 3)
    seen = views.apply(image_folder(str(root), 8, 3), cfg.augment, cfg.model, seed=0)
    expected = v2.Compose([v2.Resize(9, antialias=True), v2.CenterCrop(8), v2.ToImage(),
                           v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))])
    raw = seen.val.raw[0][0].convert("RGB")
    torch.testing.assert_close(seen.val[0][0], expected(raw).as_subclass(torch.Tensor))  # the weights' mean/std
    assert seen.train.view(0, 0)[0].shape == (3, 8, 8)
    assert not torch.equal(seen.train.view(0, 0)[0], seen.train.view(1, 0)[0])
    run, _ = train_here(tmp_path, "folder", "data=imagefolder", f"data.root={root}", "data.image_size=8",
                        "model=cnn", "model.channels=[8]", "trainer.epochs=1", "micro_batch=4", "accum=2",
                        "loader.num_workers=0",
                        "trainer.progress=false")
    assert read_metrics(run)[1]


def _recipe(compose, *args):
    return compose("model=mlp", *args).augment


@pytest.mark.parametrize("size, expected", [(8, 1), (16, 2), (28, 4), (32, 4), (64, 8), (3, 1)])
def test_auto_padding_is_an_eighth_of_the_image_size(compose, size, expected):
    assert views.padding(_recipe(compose, "augment=crop_flip"), size) == expected
    assert views.padding(_recipe(compose, "augment=crop_flip", "augment.padding=3"), size) == 3


def test_recipes_fit_the_8x8_digits_and_say_when_they_would_ruin_them(compose):
    from accutrain.data.datasets import digits

    source = digits().images
    crop_flip = views.random_view(source, _recipe(compose, "augment=crop_flip"), source.mean, source.std)
    crop = next(t for t in crop_flip.transforms if type(t).__name__ == "RandomCrop")
    assert crop.padding == [1, 1, 1, 1]  # not CIFAR's 4 px: a shift of 1/8 of the image, as on 32×32
    assert not any("Flip" in type(t).__name__ for t in crop_flip.transforms)  # a mirrored 2 is no digit
    assert views.ruinous(_recipe(compose, "augment=crop_flip"), source) is None
    for args, fragment in ((["augment=crop_flip", "augment.padding=4"], "8×8 image: augment.padding=4"),
                           (["augment=trivialaugment"], "trivialaugment shifts up to 32 px"),
                           (["augment=rrc_flip"], "crops of 8%"),
                           (["augment=crop_flip", "augment.flip=true"], "augment.flip=true mirrors")):
        warning = views.ruinous(_recipe(compose, *args), source)
        assert warning is not None and fragment in warning.partition("\n")[0], (args, warning)
        assert len(f"[hh:mm:ss] warning: {warning.partition(chr(10))[0]}") <= 120, warning


def test_a_flip_stays_where_a_mirror_keeps_the_classes(compose):
    args = [*TINY, "augment=crop_flip", "data.image_size=32"]  # generated 32×32 images: mirrors keep the classes
    c = build(run_of(*args), World(), torch.device("cpu"))
    steps = [type(t).__name__ for t in c.loader.dataset.dataset.transform.transforms]
    assert "RandomHorizontalFlip" in steps
    crop = next(t for t in c.loader.dataset.dataset.transform.transforms if type(t).__name__ == "RandomCrop")
    assert crop.padding == [4, 4, 4, 4]  # CIFAR's recipe on a 32×32 image, as before


def test_trivialaugment_on_small_images_is_warned_about_at_start(tmp_path):
    from conftest import captured_log


    with captured_log() as log:
        build(run_of(*TINY, "augment=trivialaugment"), World(), torch.device("cpu"))
    assert "augment may erase most of each 8×8 image" in log.getvalue()
    with captured_log() as log:
        build(run_of(*TINY, "augment=crop_flip"), World(), torch.device("cpu"))
    assert "erase" not in log.getvalue()


@pytest.mark.parametrize("args, fragments", [
    (["augment=crop_flip", "augment.flip=maybe"], ["augment.flip=maybe", "true, false or auto"]),
    (["augment=crop_flip", "augment.padding=-1"], ["augment.padding=-1", "auto or 0 or more"]),
])
def test_bad_flip_or_padding_is_one_line(tmp_path, args, fragments):
    from accutrain.runtime.launch import train

    with pytest.raises(UserError) as e:
        train(run_of(*TINY, *args), tmp_path / "run")
    assert_one_line_user_error(e.value, *fragments)
