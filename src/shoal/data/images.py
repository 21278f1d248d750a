"""Real images: a folder with one sub-folder of PNG/JPEG files per class, or CIFAR-10's binary batches.

Both deliver the images batch format ({"image": (B, 3, S, S) float32, "label": (B,) int64}, see
models/spec.py). Files are decoded in train_batch / val_batch, which the prefetch thread calls
(data/loader.py), so decoding overlaps the model's step instead of adding to it.

Pixels are scaled to [0, 1] and normalised per channel: CIFAR-10 with the standard mean and std of its
50,000 training images; a folder with the mean and std of up to STATS_IMAGES of its training images
(evenly spaced in the sorted file list, so every rank computes the same values from the same files).

[Note: augmentation key] A training image is augmented (a random crop of the image padded by
`data.crop_padding` zero pixels on each side, then a horizontal flip with probability 1/2, as in He et
al. 2016 for CIFAR) with draws from a generator seeded by (train.seed, data step, sample index) alone.
The data step is the global batch's number (sampler.py), so a resumed run and every dp layout or
accumulation see the same pixels, and a sample drawn again in a later epoch gets a fresh crop.
Validation images are never augmented.
"""

from __future__ import annotations

import abc
import hashlib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from shoal.config import DataConfig
from shoal.errors import UserError, require
from shoal.models.spec import Batch, DataSpec

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
STATS_IMAGES = 256  # estimates the folder's channel means within ~1% of their value at a bounded cost
AUGMENT_STREAM = 0xA06  # keeps the augmentation's draws apart from the sampler's (seed, epoch) stream
# CIFAR-10's training set, pixels in [0, 1]: per-channel mean and standard deviation over all pixels
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR_SIDE, CIFAR_CLASSES = 32, 10
CIFAR_RECORD = 1 + 3 * CIFAR_SIDE * CIFAR_SIDE  # a label byte, then the R, G and B planes row by row


def augment(images: torch.Tensor, seed: int, step: int, idx: torch.Tensor, padding: int, flip: bool) -> torch.Tensor:
    """Random crop of each image padded by `padding` zeros, then maybe a horizontal flip, drawn from
    (seed, step, index) ([Note: augmentation key]). images: (B, C, H, W), any dtype; same shape out."""
    B, _, H, W = images.shape
    draws = np.array([np.random.default_rng([AUGMENT_STREAM, seed, step, i]).integers(0, 2**31, 3)
                      for i in idx.tolist()]).reshape(B, 3)  # (B, 3): row offset, column offset, flip
    dy = torch.from_numpy(draws[:, 0] % (2 * padding + 1))
    dx = torch.from_numpy(draws[:, 1] % (2 * padding + 1))
    flipped = torch.from_numpy(draws[:, 2] % 2 == 1) & flip
    padded = F.pad(images, (padding,) * 4)  # (B, C, H + 2p, W + 2p)
    rows = dy[:, None] + torch.arange(H)  # (B, H)
    cols = dx[:, None] + torch.arange(W)  # (B, W)
    cols = torch.where(flipped[:, None], cols.flip(1), cols)
    out = padded[torch.arange(B)[:, None, None], :, rows[:, :, None], cols[:, None, :]]  # (B, H, W, C)
    return out.permute(0, 3, 1, 2).contiguous()


class ImageSource(abc.ABC):
    """What the two readers share: labels, normalisation, training-only augmentation. A reader sets
    the attributes below and implements `decode(train, idx) -> (B, 3, S, S) uint8`."""

    train_labels: torch.Tensor  # (N,) int64
    val_labels: torch.Tensor
    mean: torch.Tensor  # (3,) float32, pixels in [0, 1]
    std: torch.Tensor

    def __init__(self, cfg: DataConfig, seed: int, num_classes: int, size: int):
        self.seed, self.augment = seed, cfg.augment
        self.padding, self.flip = cfg.crop_padding, cfg.horizontal_flip
        self.spec = DataSpec(kind="images", num_classes=num_classes, image_size=size)

    @property
    def num_train(self) -> int:
        return len(self.train_labels)

    @property
    def num_val(self) -> int:
        return len(self.val_labels)

    @abc.abstractmethod
    def decode(self, train: bool, idx: torch.Tensor) -> torch.Tensor:
        """The images at `idx` of the training (or validation) set, (B, 3, S, S) uint8."""

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        return (images.float() / 255 - self.mean[:, None, None]) / self.std[:, None, None]

    def train_batch(self, idx: torch.Tensor, step: int = 0) -> Batch:
        images = self.decode(True, idx)
        if self.augment:
            images = augment(images, self.seed, step, idx, self.padding, self.flip)
        return {"image": self.normalize(images), "label": self.train_labels[idx]}

    def val_batch(self, idx: torch.Tensor) -> Batch:
        return {"image": self.normalize(self.decode(False, idx)), "label": self.val_labels[idx]}


class ImageFolder(ImageSource):
    """data.path holds one sub-folder per class (classes: the sorted folder names) of PNG/JPEG files,
    found at any depth below it. The validation set is a `val/` (else `test/`) folder of the same
    classes, beside data.path when data.path is named `train`, or inside data.path next to its
    `train/`; without one, `data.val_fraction` of each class's images is held out, chosen by a hash
    of the file's path (the same every run; adding files moves few). Images are converted to RGB (grayscale too)
    and resized to data.image_size (default: the first training image's size)."""

    def __init__(self, cfg: DataConfig, seed: int):
        self.Image = require("PIL.Image", "vision", 'data.source = "image-folder"')
        self.where = f"data.path = {cfg.path!r}"
        root = Path(cfg.path).expanduser()
        if not root.is_dir():
            raise UserError(f"{self.where} is not a folder; point it at a folder with one sub-folder of PNG/JPEG "
                            f"images per class")
        train_dir, val_dir = split_folders(root)
        classes, per_class = self._scan(train_dir)
        if val_dir is None:
            train, val = hold_out(per_class, cfg.val_fraction, train_dir, self.where)
        else:
            val_classes, val_per_class = self._scan(val_dir)
            if val_classes != classes:
                raise UserError(f"{self.where}: the validation folder {val_dir} has classes {val_classes}, the "
                                f"training folder {classes}; give both the same class sub-folders")
            train, val = flatten(per_class), flatten(val_per_class)
        self.train_files, self.val_files = [f for f, _ in train], [f for f, _ in val]
        self.train_labels = torch.tensor([c for _, c in train], dtype=torch.int64)
        self.val_labels = torch.tensor([c for _, c in val], dtype=torch.int64)
        self.classes = classes
        self.size = cfg.image_size or self._first_size(self.train_files[0])
        super().__init__(cfg, seed, len(classes), self.size)
        self.mean, self.std = self._stats()

    def _scan(self, folder: Path) -> tuple[list[str], list[list[Path]]]:
        classes = sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
        per_class = [sorted(p for p in (folder / c).rglob("*") if is_image_file(p)) for c in classes]
        empty = [c for c, files in zip(classes, per_class, strict=True) if not files]
        if not classes or len(empty) == len(classes):
            raise UserError(f"{self.where}: {folder} has no class sub-folders of PNG/JPEG images; put each class's "
                            f"images in a sub-folder named after the class")
        if empty:
            raise UserError(f"{self.where}: the class folder {folder / empty[0]} has no PNG/JPEG images; add some "
                            f"or remove the folder")
        if len(classes) < 2:
            raise UserError(f"{self.where}: {folder} has one class ({classes[0]}); a classifier needs at least two "
                            f"class sub-folders")
        return classes, per_class

    def _first_size(self, path: Path) -> int:
        with self._open(path) as im:
            w, h = im.size
        if w != h:
            raise UserError(f"{self.where}: the first image {path} is {w}x{h}, not square; set data.image_size to "
                            f"the side to resize every image to")
        return w

    def _open(self, path: Path):
        try:
            return self.Image.open(path)
        except (OSError, ValueError) as e:  # PIL.UnidentifiedImageError is an OSError
            raise UserError(f"{self.where}: cannot read {path} ({e}); replace or remove the file") from None

    def _load(self, path: Path) -> np.ndarray:
        """(S, S, 3) uint8."""
        with self._open(path) as im:
            try:
                rgb = im.convert("RGB")
            except (OSError, ValueError) as e:  # a truncated file fails only when decoded
                raise UserError(f"{self.where}: cannot read {path} ({e}); replace or remove the file") from None
        if rgb.size != (self.size, self.size):
            rgb = rgb.resize((self.size, self.size), self.Image.Resampling.BILINEAR)
        return np.asarray(rgb)

    def decode(self, train: bool, idx: torch.Tensor) -> torch.Tensor:
        files = self.train_files if train else self.val_files
        out = np.empty((len(idx), self.size, self.size, 3), dtype=np.uint8)  # (B, S, S, 3)
        for j, i in enumerate(idx.tolist()):
            out[j] = self._load(files[i])
        return torch.from_numpy(out).permute(0, 3, 1, 2)  # (B, 3, S, S)

    def _stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        pick = np.unique(np.linspace(0, self.num_train - 1, min(self.num_train, STATS_IMAGES)).round().astype(np.int64))
        x = self.decode(True, torch.from_numpy(pick)).float() / 255  # (n, 3, S, S)
        # a constant channel (a blank image set) would divide by zero; one grey level is the floor
        return x.mean(dim=(0, 2, 3)), x.std(dim=(0, 2, 3)).clamp(min=1 / 255)


def is_image_file(p: Path) -> bool:
    # a leading dot: hidden, e.g. the "._x.jpg" metadata files macOS leaves on shared drives
    return p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".") and p.is_file()


def split_folders(root: Path) -> tuple[Path, Path | None]:
    """(training folder, validation folder or None) for data.path = root."""
    for val in ("val", "test"):
        if (root / "train").is_dir() and (root / val).is_dir():
            return root / "train", root / val
        if root.name == "train" and (root.parent / val).is_dir():
            return root, root.parent / val
    return root, None


def hold_out(per_class: list[list[Path]], fraction: float, root: Path, where: str):
    """(training, validation) lists of (file, class): `fraction` of each class, at least one image,
    the files whose path relative to `root` hashes lowest."""
    train, val = [], []
    for c, files in enumerate(per_class):
        ranked = sorted(files, key=lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest())
        n_val = max(round(len(files) * fraction), 1)
        if n_val >= len(files):
            raise UserError(f"{where}: the class folder {files[0].parent.name} has {len(files)} image(s), too few to "
                            f"hold out data.val_fraction = {fraction} of them; add images or a val/ folder")
        val += [(f, c) for f in sorted(ranked[:n_val])]
        train += [(f, c) for f in sorted(ranked[n_val:])]
    return train, val


def flatten(per_class: list[list[Path]]) -> list[tuple[Path, int]]:
    return [(f, c) for c, files in enumerate(per_class) for f in files]


class Cifar10(ImageSource):
    """data.path is the folder extracted from CIFAR-10's binary tarball (cifar-10-batches-bin):
    data_batch_*.bin train, test_batch.bin validates. Records are read with numpy, never unpickled."""

    def __init__(self, cfg: DataConfig, seed: int):
        self.where = f"data.path = {cfg.path!r}"
        root = Path(cfg.path).expanduser()
        files = sorted(root.glob("data_batch_*.bin")) if root.is_dir() else []
        if not files or not (root / "test_batch.bin").is_file():
            raise UserError(f"{self.where} has no data_batch_*.bin and test_batch.bin; extract cifar-10-binary.tar.gz "
                            f"and point data.path at its cifar-10-batches-bin folder")
        train = np.concatenate([self._records(f) for f in files])  # (N, 3073)
        val = self._records(root / "test_batch.bin")
        self.train_pixels = train[:, 1:].reshape(-1, 3, CIFAR_SIDE, CIFAR_SIDE)
        self.val_pixels = val[:, 1:].reshape(-1, 3, CIFAR_SIDE, CIFAR_SIDE)
        self.train_labels = torch.from_numpy(train[:, 0].astype(np.int64))
        self.val_labels = torch.from_numpy(val[:, 0].astype(np.int64))
        self.size = cfg.image_size or CIFAR_SIDE
        super().__init__(cfg, seed, CIFAR_CLASSES, self.size)
        self.mean, self.std = torch.tensor(CIFAR_MEAN), torch.tensor(CIFAR_STD)

    def _records(self, path: Path) -> np.ndarray:
        size = path.stat().st_size
        if size == 0 or size % CIFAR_RECORD:
            raise UserError(f"{self.where}: {path.name} is {size} bytes, not a whole number of {CIFAR_RECORD}-byte "
                            f"CIFAR-10 records; extract cifar-10-binary.tar.gz (the binary version) again")
        records = np.fromfile(path, dtype=np.uint8).reshape(-1, CIFAR_RECORD)
        bad = np.flatnonzero(records[:, 0] >= CIFAR_CLASSES)
        if len(bad):
            raise UserError(f"{self.where}: {path.name} record {bad[0]} has label {records[bad[0], 0]}, but CIFAR-10 "
                            f"has 10 classes; point data.path at CIFAR-10's binary version (cifar-10-batches-bin)")
        return records

    def decode(self, train: bool, idx: torch.Tensor) -> torch.Tensor:
        images = torch.from_numpy((self.train_pixels if train else self.val_pixels)[idx.numpy()])  # (B, 3, 32, 32)
        if self.size != CIFAR_SIDE:
            images = F.interpolate(images.float(), size=self.size, mode="bilinear", antialias=True)
            images = images.round().clamp(0, 255).to(torch.uint8)
        return images
