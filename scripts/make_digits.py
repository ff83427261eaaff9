"""Build src/accutrain/assets/digits.npz, the handwritten-digits set that ships with accutrain.

Source: UCI "Optical Recognition of Handwritten Digits" (optdigits), file optdigits.tes: 1,797 images of
8x8 pixels with values 0..16, digits 0-9. Alpaydin & Kaynak (1998), https://doi.org/10.24432/C50P49,
licensed CC BY 4.0. The same 1,797 images ship inside scikit-learn as `load_digits`; this script downloads
them from UCI and falls back to scikit-learn's copy when offline.

The held-out split is fixed here, once (a stratified 20% chosen with seed 0), and stored in the file, so every
accutrain run evaluates on the same 360 images whatever its seed.

    python scripts/make_digits.py            # writes src/accutrain/assets/digits.npz
"""
from __future__ import annotations

import argparse
import io
import urllib.request
from pathlib import Path

import numpy as np

UCI_URL = "https://archive.ics.uci.edu/ml/machine-learning-databases/optdigits/optdigits.tes"
OUT = Path(__file__).resolve().parents[1] / "src" / "accutrain" / "assets" / "digits.npz"


def load() -> tuple[np.ndarray, np.ndarray, str]:
    try:
        with urllib.request.urlopen(UCI_URL, timeout=20) as r:
            table = np.loadtxt(io.StringIO(r.read().decode()), delimiter=",", dtype=np.int64)
        return table[:, :64], table[:, 64], UCI_URL
    except OSError as e:
        print(f"UCI download failed ({e}); using scikit-learn's bundled copy of the same file")
        from sklearn.datasets import load_digits

        d = load_digits()
        return d.data.astype(np.int64), d.target.astype(np.int64), "sklearn.datasets.load_digits"


def stratified_val_mask(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    val = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        val[rng.permutation(idx)[: round(fraction * len(idx))]] = True
    return val


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    pixels, labels, source = load()
    assert pixels.shape == (1797, 64) and pixels.min() >= 0 and pixels.max() <= 16, pixels.shape
    images = pixels.reshape(-1, 8, 8).astype(np.uint8)
    val = stratified_val_mask(labels, 0.2, seed=0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, images=images, labels=labels.astype(np.uint8), val=val)
    print(f"{args.out}: {len(images)} images ({(~val).sum()} train / {val.sum()} val) from {source}, "
          f"{args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
