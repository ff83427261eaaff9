"""A measured example of augmentation: held-out accuracy with and without it, at one effective batch cut several
ways, on generated images (no download) read through data=imagefolder.

    python scripts/augment_accuracy.py [--train 32] [--epochs 100] [--size 16] [--seeds 0 1 2]

The images: four shapes (circle, square, triangle, cross) drawn at a random place, size and (light) colour on a
dark, noisy 32×32 background; few training images per class, many held out, so that what augmentation adds shows. Each
configuration trains `model=cnn` at effective batch 32 as `micro_batch=32` and as `micro_batch=8 accum=4`: the
two splits end with the same weights (accutrain's promise), hence the same accuracy, with or without augmentation.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import accutrain

SHAPES = ("circle", "square", "triangle", "cross")


def draw(shape: str, rng: np.random.Generator, size: int = 32):
    """One image: `shape` at a random place, size and colour on noise."""
    from PIL import Image, ImageDraw

    pixels = rng.normal(70, 30, (size, size, 3)).clip(0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    pen = ImageDraw.Draw(image)
    r = int(rng.integers(6, 12))
    cx, cy = (int(v) for v in rng.integers(r, size - r, 2))
    colour = tuple(int(c) for c in rng.integers(150, 256, 3))
    if shape == "circle":
        pen.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif shape == "square":
        pen.rectangle([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif shape == "triangle":
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    else:
        pen.rectangle([cx - r, cy - r // 3, cx + r, cy + r // 3], fill=colour)
        pen.rectangle([cx - r // 3, cy - r, cx + r // 3, cy + r], fill=colour)
    return image


def make_shapes(root: Path, train: int, val: int, seed: int = 0) -> Path:
    """root/train/<shape>/*.png and root/val/<shape>/*.png."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", train), ("val", val)):
        for shape in SHAPES:
            folder = root / split / shape
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                draw(shape, rng).save(folder / f"{i}.png")
    return root


RECIPES = {  # crop_flip's padding auto: an eighth of the image size (CIFAR's 4 pixels of 32), 2 at 16
    "augment=none": ["augment=none"],
    "augment=crop_flip": ["augment=crop_flip"],
    "crop_flip + MixUp/CutMix + smoothing": ["augment=crop_flip", "augment.mixup_alpha=0.2",
                                             "augment.cutmix_alpha=1.0", "loss.label_smoothing=0.1"],
}
SPLITS = {"micro_batch=32": ["micro_batch=32"], "micro_batch=8 accum=4": ["micro_batch=8", "accum=4"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=32, help="training images per class")
    parser.add_argument("--val", type=int, default=100, help="held-out images per class")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--size", type=int, default=16, help="data.image_size: the 32×32 images resized to it")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    print(f"$ python scripts/augment_accuracy.py {' '.join(sys.argv[1:])}".rstrip())
    with tempfile.TemporaryDirectory() as tmp:
        root = make_shapes(Path(tmp) / "shapes", args.train, args.val)
        common = ["data=imagefolder", f"data.root={root}", f"data.image_size={args.size}", "loader.num_workers=0",
                  "model=cnn", "model.channels=[16,32]", "optim=adamw", "optim.lr=3e-3",
                  f"trainer.epochs={args.epochs}", "trainer.progress=false", "trainer.log_every=1000"]
        print(f"{args.train} training / {args.val} held-out images per class, 4 classes, {args.size} px, model=cnn, "
              f"{args.epochs} epochs, effective batch 32; final val_acc per seed")
        for recipe, overrides in RECIPES.items():
            for split, cut in SPLITS.items():
                accs, start = [], time.perf_counter()
                for seed in args.seeds:
                    run = Path(tmp) / "runs" / f"{recipe}-{split}-{seed}".replace(" ", "_")
                    run.mkdir(parents=True)
                    accutrain.run(*common, *overrides, *cut, f"seed={seed}", run_dir=run)
                    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                             if '"val_acc"' in line]
                    accs.append(evals[-1]["val_acc"])
                print(f"{recipe:<38} {split:<22} " + " ".join(f"{a:.3f}" for a in accs)
                      + f"   mean {statistics.mean(accs):.3f}   ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
