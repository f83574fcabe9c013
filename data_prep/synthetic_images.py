"""Small image sets written in the *official* MNIST, CIFAR and Tiny ImageNet file formats.

The loaders of ``fedexp.data.images`` read the releases as they are distributed; nobody can
download them on the development machines, so tests and dry runs use these look-alikes:
random images whose mean brightness of one colour depends on the class (learnable), MNIST's
strokes on black instead (below), in

* MNIST: the four IDX files (big-endian headers, uint8 pixels), optionally gzipped;
* CIFAR-10 / CIFAR-100: the *binary* records (label byte(s), then 3072 bytes R, G, B planes);
* Tiny ImageNet: ``tiny-imagenet-200/`` with ``wnids.txt``, ``train/<wnid>/images/*.JPEG``
  and ``val/images`` + ``val/val_annotations.txt``.

Usage::

    python -m data_prep.synthetic_images mnist|cifar100 --out DIR [--n-train N] [--n-test N]
        [--seed S]
    python -m data_prep.synthetic_images cifar10|tiny_imagenet --out DIR [--seed S]
"""

from __future__ import annotations

import argparse
import gzip
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def _class_images(labels: np.ndarray, shape: tuple[int, ...], classes: int, rng) -> np.ndarray:  # noqa: ANN001
    """uint8 images: noise plus a class-dependent brightness (so a model can learn them)."""
    base = rng.integers(0, 128, size=(len(labels), *shape))
    level = (labels.astype(np.int64) * 127 // max(classes - 1, 1)).reshape(-1, *[1] * len(shape))
    return (base + level).clip(0, 255).astype(np.uint8)


def _stroke_templates(classes: int, rng) -> np.ndarray:  # noqa: ANN001
    """[classes, 28, 28] in {0, 1}: each class three straight strokes, three pixels wide.

    The strokes lie inside the 20 x 20 box at the centre, where MNIST's digits are.
    """
    templates = np.zeros((classes, 28, 28))
    along = np.linspace(0.0, 1.0, 40)
    for c in range(classes):
        for _ in range(3):
            (r0, c0), (r1, c1) = rng.uniform(5, 22, size=(2, 2))
            rows = np.round(r0 + (r1 - r0) * along).astype(int)
            cols = np.round(c0 + (c1 - c0) * along).astype(int)
            for dr in (0, 1, 2):
                for dc in (0, 1, 2):
                    templates[c, rows + dr, cols + dc] = 1.0
    return templates


def _digit_images(labels: np.ndarray, templates: np.ndarray, rng) -> np.ndarray:  # noqa: ANN001
    """uint8 28 x 28 images with MNIST's statistics: black, a seventh or so of the pixels ink.

    Each image is its class's strokes shifted by up to 3 pixels either way, each pixel's ink
    between 60 % and 100 %: the pixel mean is about 0.11 of the range, as MNIST's 0.13 (a
    brighter look-alike has several times MNIST's curvature, and step sizes tuned for MNIST
    diverge on it).
    """
    shifts = rng.integers(-3, 4, size=(len(labels), 2))
    out = np.empty((len(labels), 28, 28))
    for dy in range(-3, 4):
        for dx in range(-3, 4):
            rows = (shifts[:, 0] == dy) & (shifts[:, 1] == dx)
            out[rows] = np.roll(templates[labels[rows]], (dy, dx), axis=(1, 2))
    ink = rng.uniform(0.6, 1.0, size=out.shape)
    return np.round(out * ink * 255).astype(np.uint8)


def _idx(magic: int, array: np.ndarray) -> bytes:
    header = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(
    out: Path, n_train: int = 60, n_test: int = 20, seed: int = 0, gz: bool = False
) -> Path:
    """The four MNIST IDX files (28x28 images of strokes, labels 0..9) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 28])
    templates = _stroke_templates(10, rng)  # one set for both splits
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = np.arange(n) % 10
        images = _digit_images(labels, templates, rng)
        for name, data in (
            (f"{prefix}-images-idx3-ubyte", _idx(0x803, images)),
            (f"{prefix}-labels-idx1-ubyte", _idx(0x801, labels)),
        ):
            if gz:
                with gzip.open(out / f"{name}.gz", "wb") as stream:
                    stream.write(data)
            else:
                (out / name).write_bytes(data)
    return out


def _cifar_records(n: int, classes: int, coarse: bool, rng) -> bytes:  # noqa: ANN001
    labels = np.arange(n) % classes
    images = _class_images(labels, (3, 32, 32), classes, rng).reshape(n, 3072)
    heads = [labels[:, None] // 5] if coarse else []
    return np.concatenate([*heads, labels[:, None], images], axis=1).astype(np.uint8).tobytes()


def write_cifar10(out: Path, per_file: int = 10, seed: int = 0) -> Path:
    """``cifar-10-batches-bin/`` (data_batch_1..5.bin, test_batch.bin) under ``out``."""
    folder = out / "cifar-10-batches-bin"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 10])
    for name in [f"data_batch_{k}.bin" for k in range(1, 6)] + ["test_batch.bin"]:
        (folder / name).write_bytes(_cifar_records(per_file, 10, False, rng))
    return folder


def write_cifar100(out: Path, n_train: int = 200, n_test: int = 100, seed: int = 0) -> Path:
    """``cifar-100-binary/`` (train.bin, test.bin: coarse, fine label bytes) under ``out``."""
    folder = out / "cifar-100-binary"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 100])
    for name, n in (("train.bin", n_train), ("test.bin", n_test)):
        (folder / name).write_bytes(_cifar_records(n, 100, True, rng))
    return folder


def write_tiny_imagenet(
    out: Path, classes: int = 4, train_per_class: int = 3, val: int = 4, seed: int = 0
) -> Path:
    """``tiny-imagenet-200/`` with ``classes`` wnids, JPEG train images and annotated val."""
    from PIL import Image

    root = out / "tiny-imagenet-200"
    rng = np.random.default_rng([seed, 200])
    wnids = [f"n{10_000_000 + 17 * c:08d}" for c in range(classes)]
    root.mkdir(parents=True, exist_ok=True)
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")

    def jpeg(file: Path, label: int) -> None:
        file.parent.mkdir(parents=True, exist_ok=True)
        pixels = _class_images(np.array([label]), (64, 64, 3), classes, rng)[0]
        Image.fromarray(pixels, "RGB").save(file, "JPEG", quality=95)

    for c, wnid in enumerate(wnids):
        for k in range(train_per_class):
            jpeg(root / "train" / wnid / "images" / f"{wnid}_{k}.JPEG", c)
    notes = []
    for k in range(val):
        c = k % classes
        jpeg(root / "val" / "images" / f"val_{k}.JPEG", c)
        notes.append(f"val_{k}.JPEG\t{wnids[c]}\t0\t0\t63\t63")
    (root / "val" / "val_annotations.txt").write_text("\n".join(notes) + "\n")
    return root


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: write one look-alike release."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["mnist", "cifar10", "cifar100", "tiny_imagenet"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-train", type=int, help="mnist, cifar100: training images")
    parser.add_argument("--n-test", type=int, help="mnist, cifar100: test images")
    args = parser.parse_args(argv)
    sizes = {k: v for k, v in (("n_train", args.n_train), ("n_test", args.n_test)) if v is not None}
    if sizes and args.kind not in ("mnist", "cifar100"):
        parser.error(f"--n-train and --n-test are for mnist and cifar100, not {args.kind}")
    if any(v < 1 for v in sizes.values()):
        parser.error(f"--n-train and --n-test: expected at least 1 image, got {sizes}")
    writer = {
        "mnist": write_mnist,
        "cifar10": write_cifar10,
        "cifar100": write_cifar100,
        "tiny_imagenet": write_tiny_imagenet,
    }[args.kind]
    print(writer(args.out, seed=args.seed, **sizes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
