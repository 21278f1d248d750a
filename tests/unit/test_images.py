"""Real images (data/images.py): the folder and CIFAR-10 readers, normalisation, the augmentation's
determinism, and the one-line errors. Every file is written by the test."""

import re
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from shoal.config import DataConfig, load_config
from shoal.data.images import CIFAR_MEAN, CIFAR_RECORD, CIFAR_STD, augment
from shoal.data.sources import build_source
from shoal.errors import UserError, install_hint


def folder(cfg_path, **kw) -> DataConfig:
    return DataConfig(source="image-folder", path=str(cfg_path), **kw)


def write_folder(root, per_class=5, size=6):
    """cat/: grayscale PNGs of one level each; dog/: RGB JPEGs, twice the size (resized on reading)."""
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
    for i in range(per_class):
        Image.fromarray(np.full((size, size), 10 * i, np.uint8), mode="L").save(root / "cat" / f"{i}.png")
        rgb = np.zeros((2 * size, 2 * size, 3), np.uint8)
        rgb[..., 0] = 200
        Image.fromarray(rgb).save(root / "dog" / f"{i}.JPG", quality=95)


def test_folder_classes_split_and_pixels(tmp_path):
    write_folder(tmp_path / "pets", per_class=10)
    (tmp_path / "pets" / "cat" / "notes.txt").write_text("not an image")  # ignored, as hidden files are
    (tmp_path / "pets" / "dog" / "._0.JPG").write_bytes(b"\x00\x05\x16\x07")  # macOS metadata, not a JPEG
    src = build_source(folder(tmp_path / "pets", val_fraction=0.2, augment=False), None)
    assert src.classes == ["cat", "dog"] and src.spec.num_classes == 2 and src.spec.image_size == 6
    assert (src.num_train, src.num_val) == (16, 4)  # 2 of each class held out: stratified
    assert src.val_labels.tolist() == [0, 0, 1, 1]
    assert not set(src.train_files) & set(src.val_files)
    again = build_source(folder(tmp_path / "pets", val_fraction=0.2), None)
    assert again.val_files == src.val_files  # chosen by a hash of the path, not at random

    b = src.train_batch(torch.arange(src.num_train))
    assert b["image"].shape == (16, 3, 6, 6) and b["image"].dtype == torch.float32
    assert b["label"].dtype == torch.int64
    # statistics of every training image (16 < STATS_IMAGES): the normalised set has mean 0, std 1
    torch.testing.assert_close(b["image"].mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(b["image"].std(dim=(0, 2, 3)), torch.ones(3), atol=1e-4, rtol=0)
    raw = b["image"] * src.std[:, None, None] + src.mean[:, None, None]  # back to [0, 1]
    cat = int(src.train_files[0].stem)  # a PNG is lossless: its level, in all three channels
    torch.testing.assert_close(raw[0], torch.full((3, 6, 6), 10 * cat / 255), atol=1e-5, rtol=0)
    dog = raw[b["label"] == 1]  # a JPEG, resized from 12x12: red, near enough
    assert (dog[:, 0] - 200 / 255).abs().max() < 0.03 and dog[:, 1:].max() < 0.03


def test_a_val_folder_beside_train_is_the_validation_set(tmp_path):
    write_folder(tmp_path / "train", per_class=3)
    write_folder(tmp_path / "val", per_class=2)
    for path in (tmp_path, tmp_path / "train"):  # data.path: the parent, or train/ itself
        src = build_source(folder(path, image_size=4), None)
        assert (src.num_train, src.num_val) == (6, 4) and src.spec.image_size == 4
        assert all(f.parent.parent.name == "val" for f in src.val_files)
        assert src.val_batch(torch.arange(4))["image"].shape == (4, 3, 4, 4)


def write_cifar(root, sizes=(3, 2), val=2):
    """data_batch_1..n.bin and test_batch.bin; record k has label k % 10 and pixel value k in red,
    k + 1 in green, k + 2 in blue (planes in that order, as in CIFAR-10's binary version)."""
    root.mkdir(parents=True, exist_ok=True)
    k = 0
    for name, n in [*((f"data_batch_{i + 1}.bin", s) for i, s in enumerate(sizes)), ("test_batch.bin", val)]:
        records = np.zeros((n, CIFAR_RECORD), np.uint8)
        for r in range(n):
            records[r, 0] = k % 10
            records[r, 1:] = np.repeat([k, k + 1, k + 2], 1024)
            k += 1
        records.tofile(root / name)


def test_cifar10_binary_records(tmp_path):
    write_cifar(tmp_path / "cifar-10-batches-bin")
    src = build_source(DataConfig(source="cifar10", path=str(tmp_path / "cifar-10-batches-bin"), augment=False), None)
    assert (src.num_train, src.num_val, src.spec.num_classes, src.spec.image_size) == (5, 2, 10, 32)
    b = src.train_batch(torch.tensor([4, 0]))
    assert b["label"].tolist() == [4, 0] and b["image"].shape == (2, 3, 32, 32)
    want = (torch.tensor([4.0, 5.0, 6.0]) / 255 - torch.tensor(CIFAR_MEAN)) / torch.tensor(CIFAR_STD)
    torch.testing.assert_close(b["image"][0, :, 7, 9], want)  # the standard CIFAR-10 statistics
    v = src.val_batch(torch.tensor([1]))
    assert v["label"].tolist() == [6]  # the test batch follows the 5 training records
    small = build_source(DataConfig(source="cifar10", path=str(tmp_path / "cifar-10-batches-bin"), image_size=16), None)
    torch.testing.assert_close(small.val_batch(torch.tensor([1]))["image"], v["image"][:, :, :16, :16])


def test_augmentation_is_a_function_of_seed_step_and_index(tmp_path):
    write_cifar(tmp_path, sizes=(20,), val=4)
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (20, 3, 32, 32), dtype=torch.uint8, generator=gen)
    src = build_source(DataConfig(source="cifar10", path=str(tmp_path)), None, seed=7)
    src.train_pixels = pixels.numpy()
    idx = torch.arange(20)
    a = src.train_batch(idx, step=3)
    assert torch.equal(a["image"], src.train_batch(idx, step=3)["image"])  # same (seed, step, index)
    swapped = src.train_batch(idx.flip(0), step=3)["image"]  # a sample's pixels do not depend on its batch
    assert torch.equal(swapped, a["image"].flip(0))
    assert not torch.equal(a["image"], src.train_batch(idx, step=4)["image"])  # another step: other crops
    reseeded = build_source(DataConfig(source="cifar10", path=str(tmp_path)), None, seed=8)
    reseeded.train_pixels = src.train_pixels
    assert not torch.equal(a["image"], reseeded.train_batch(idx, step=3)["image"])
    plain = build_source(DataConfig(source="cifar10", path=str(tmp_path), augment=False), None, seed=7)
    plain.train_pixels = src.train_pixels
    assert torch.equal(plain.train_batch(idx, step=3)["image"], plain.normalize(pixels))
    assert torch.equal(src.val_batch(torch.arange(4))["image"], plain.val_batch(torch.arange(4))["image"])

    # each augmented image is a window of the zero-padded original, mirrored or not; both happen
    out = augment(pixels, seed=7, step=3, idx=idx, padding=4, flip=True)
    padded = torch.nn.functional.pad(pixels, (4, 4, 4, 4))
    kinds = []
    for i in range(20):
        windows = [(f, dy, dx) for f in (False, True) for dy in range(9) for dx in range(9)
                   if torch.equal(out[i], (lambda w: w.flip(-1) if f else w)(padded[i, :, dy:dy + 32, dx:dx + 32]))]
        assert len(windows) == 1, f"image {i} is not one window of its padded original"
        kinds.append(windows[0])
    assert {f for f, _, _ in kinds} == {False, True} and len({(dy, dx) for _, dy, dx in kinds}) > 5
    assert torch.equal(augment(pixels, 7, 3, idx, padding=0, flip=False), pixels)


def test_image_errors_are_one_line_naming_data_path(tmp_path):
    def fails(cfg, match):
        with pytest.raises(UserError, match=match) as e:
            build_source(cfg, None)
        assert "\n" not in str(e.value) and "data.path" in str(e.value)

    fails(folder(tmp_path / "none"), "is not a folder")
    (tmp_path / "empty").mkdir()
    fails(folder(tmp_path / "empty"), "no class sub-folders of PNG/JPEG images")
    write_folder(tmp_path / "one")
    for f in (tmp_path / "one" / "dog").iterdir():
        f.unlink()
    (tmp_path / "one" / "dog").rmdir()
    fails(folder(tmp_path / "one"), r"has one class \(cat\); a classifier needs at least two")
    write_folder(tmp_path / "bad")
    (tmp_path / "bad" / "cat" / "3.png").write_bytes(b"not a png")
    fails(folder(tmp_path / "bad"), r"cannot read .*3\.png .*replace or remove the file")
    write_folder(tmp_path / "wide")
    Image.new("RGB", (8, 6)).save(tmp_path / "wide" / "cat" / "0.png")
    fails(folder(tmp_path / "wide"), "is 8x6, not square; set data.image_size")
    assert build_source(folder(tmp_path / "wide", image_size=5), None).spec.image_size == 5
    write_folder(tmp_path / "split" / "train")
    (tmp_path / "split" / "val" / "cat").mkdir(parents=True)
    Image.new("L", (6, 6)).save(tmp_path / "split" / "val" / "cat" / "0.png")
    (tmp_path / "split" / "val" / "owl").mkdir()
    Image.new("L", (6, 6)).save(tmp_path / "split" / "val" / "owl" / "0.png")
    fails(folder(tmp_path / "split"), r"has classes \['cat', 'owl'\], the training folder \['cat', 'dog'\]")
    write_folder(tmp_path / "few", per_class=1)
    fails(folder(tmp_path / "few"), "has 1 image.*too few to hold out")

    cifar = DataConfig(source="cifar10", path=str(tmp_path / "c"))
    fails(cifar, "has no data_batch_.*extract cifar-10-binary.tar.gz")
    write_cifar(tmp_path / "c")
    (tmp_path / "c" / "data_batch_2.bin").write_bytes(b"\x00" * (CIFAR_RECORD + 1))
    fails(cifar, f"data_batch_2.bin is {CIFAR_RECORD + 1} bytes, not a whole number of {CIFAR_RECORD}-byte")
    write_cifar(tmp_path / "c")
    records = np.fromfile(tmp_path / "c" / "test_batch.bin", np.uint8)
    records[CIFAR_RECORD] = 57
    records.tofile(tmp_path / "c" / "test_batch.bin")
    fails(cifar, "test_batch.bin record 1 has label 57")

    with pytest.raises(UserError, match='data.source = "image-folder" needs data.path'):
        load_config(None, ['data.source="image-folder"', 'model.name="resnet"'])


def test_without_pillow_the_folder_source_names_the_install(tmp_path, monkeypatch):
    write_folder(tmp_path)
    monkeypatch.setitem(sys.modules, "PIL.Image", None)  # import PIL.Image now raises ImportError
    with pytest.raises(UserError, match=r"data.source = \"image-folder\" needs the PIL package; install it with: "
                                        + re.escape(install_hint("vision"))):
        build_source(folder(tmp_path), None)
