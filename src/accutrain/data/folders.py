"""`data=imagefolder`: your own images, a folder per class (ImageNet's layout), read with Pillow — every file of a
known image extension, the classes named by their folders in sorted order."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from accutrain.config.schemas import Crop
from accutrain.data.splits import Datasets
from accutrain.data.views import ImageSource, Views, fixed_view
from accutrain.errors import UserError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _to_rgb(image: Any) -> Any:
    return image.convert("RGB")


def read_image(path: str) -> Any:
    """PIL's image at `path`, fully decoded; an unreadable or corrupt file is one clear line naming it."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            image = Image.open(f)
            image.load()
            return image
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise UserError(f"cannot read image {path}: {e}") from None


def image_folder(root: str, image_size: int, channels: int, test: Optional[str] = None) -> Datasets:
    """Images in `root/train/<class>/` and `root/val/<class>/`, resized and centre-cropped to image_size; `test`: a
    folder of the same classes (a name under root, or a path) as the test split."""
    if channels not in (1, 3):
        raise UserError(f"data.channels={channels} is not valid for imagefolder: expected 1 or 3")
    from torchvision import datasets as tvd
    from torchvision.transforms import v2

    root_path = Path(os.path.expanduser(root)).resolve()
    folders = {"train": root_path / "train", "val": root_path / "val"}
    if test is not None:
        folders["test"] = root_path / os.path.expanduser(test)
        if not folders["test"].is_dir():
            raise UserError(f"data.test={test}: no folder {folders['test']}; expected <class>/<image> folders there")
    for split in ("train", "val"):
        if not folders[split].is_dir():
            raise UserError(
                f"data.root={root_path}: no {split}/ folder there; imagefolder expects "
                f"{root_path}/train/<class>/<image> and {root_path}/val/<class>/<image>"
            )
    mean, std = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)) if channels == 3 else ((0.5,), (0.5,))
    splits = {}
    for split, folder in folders.items():
        try:  # raw PIL images: the views (accutrain.data.views) are made from them
            splits[split] = tvd.ImageFolder(str(folder), loader=read_image)
        except FileNotFoundError:
            raise UserError(
                f"no images found under {folder}: expected class folders holding "
                f"{', '.join(IMAGE_EXTENSIONS)} files"
            ) from None
    train, val = splits["train"], splits["val"]
    for split, other in splits.items():
        if other.classes != train.classes:
            raise UserError(
                f"{root_path}: train/ and {folders[split].name}/ hold different classes ({len(train.classes)} vs "
                f"{len(other.classes)}): every class needs a folder in each"
            )
    source = ImageSource(train, val, image_size, mean, std, resize=True, crop=Crop.resized,
                         convert=(v2.Grayscale(1) if channels == 1 else v2.Lambda(_to_rgb),), test=splits.get("test"))
    view = fixed_view(source)
    return Datasets(Views(train, view), Views(val, view), len(train.classes), (channels, image_size, image_size),
                    f"imagefolder ({root_path})", images=source, decoded=True, class_names=tuple(train.classes),
                    test=Views(splits["test"], view) if "test" in splits else None)
