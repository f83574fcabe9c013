"""Image classification data sets read from their official distribution files.

* ``digits``: scikit-learn's 1797 real 8x8 handwritten digits (shipped, no download).
* ``mnist``: the four IDX files of MNIST (or Fashion-MNIST), gzipped or not.
* ``cifar10`` / ``cifar100``: the *binary* CIFAR releases (``cifar-10-binary.tar.gz``,
  ``cifar-100-binary.tar.gz``).
* ``tiny_imagenet``: the ``tiny-imagenet-200`` folder (JPEGs, ``wnids.txt``, validation
  annotations).

Every loader returns x float32 (n, C, H, W) in [0, 1] (pixel / 255) and y int64, with the
official train and test parts MERGED, as pFedMe and pFedSOP §V do: the data are partitioned
over the clients, then each client's share is split 80/20 by ``federate``. ``groups`` stays
None (there are no natural sites). Loading executes no code: bytes are parsed with
``numpy.frombuffer`` (never pickle), JPEGs are decoded by PIL.

``download=True`` (``dataset.download=true``) first fetches the missing official files into
``path`` with checksums checked (:mod:`fedexp.data.download`, needs internet); present files
are kept.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from fedexp.config.ranges import PositiveInt
from fedexp.data.dataset import ArrayDataset
from fedexp.errors import DataError

_MNIST_FILES = (
    ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
)
_MNIST_LAYOUT = (
    "expected the four MNIST IDX files from http://yann.lecun.com/exdb/mnist/ "
    "(train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
    "t10k-labels-idx1-ubyte; Fashion-MNIST's have the same names), gzipped or not"
)
_IDX_IMAGES, _IDX_LABELS = 0x00000803, 0x00000801
_CIFAR_PICKLED = (
    "holds the pickled python version; fedexp reads only the binary version ({archive}) "
    "because unpickling can execute code"
)
_DOWNLOAD_HINT = (
    "; or set dataset.download=true to fetch it there (needs internet; checksums are checked)"
)
_TINY_LAYOUT = (
    "expected the official tiny-imagenet-200 folder (http://cs231n.stanford.edu/"
    "tiny-imagenet-200.zip): wnids.txt, train/<wnid>/images/*.JPEG, val/images/*.JPEG and "
    "val/val_annotations.txt"
)


def _unit(pixels: np.ndarray) -> np.ndarray:
    """uint8 pixels as float32 in [0, 1]."""
    return pixels.astype(np.float32) / np.float32(255)


def digits() -> ArrayDataset:
    """scikit-learn's handwritten digits: 1797 real 8x8 images of 10 classes, no download.

    The embedded default for image runs. Pixel values 0..16 are divided by 16.

    Returns:
        Classification data: x float32 (1797, 1, 8, 8) in [0, 1], y int64 in 0..9.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images.astype(np.float32) / np.float32(16))[:, None]
    return ArrayDataset("digits", x, bunch.target.astype(np.int64), 10)


# ----------------------------------------------------------------------------- MNIST (IDX)
def _read_idx(path: str, folder: Path, name: str) -> tuple[Path, bytes]:
    """The bytes of ``name`` or ``name.gz`` in ``folder`` (a plain file is preferred)."""
    for file in (folder / name, folder / f"{name}.gz"):
        if file.is_file():
            if file.suffix != ".gz":
                return file, file.read_bytes()
            try:
                with gzip.open(file) as stream:
                    return file, stream.read()
            except (OSError, EOFError) as exc:
                raise DataError(f"{file}: not a readable gzip file ({exc})") from None
    raise DataError(
        f"dataset.path={path!r}: {folder / name}(.gz) not found; {_MNIST_LAYOUT}{_DOWNLOAD_HINT}"
    )


def _idx_array(file: Path, data: bytes, magic: int, dims: tuple[int, ...]) -> np.ndarray:
    """Parse an IDX file of unsigned bytes: big-endian magic, dimensions, then the data.

    ``dims`` gives the expected size of each dimension after the first (the count).
    """
    ndim = len(dims) + 1
    kind = "images" if magic == _IDX_IMAGES else "labels"
    if len(data) < 4:
        raise DataError(f"{file}: {len(data)} bytes, too short for an IDX {kind} header")
    found = int(np.frombuffer(data, dtype=">u4", count=1)[0])
    if found != magic:
        raise DataError(
            f"{file}: magic number 0x{found:08x}, expected 0x{magic:08x} (IDX {kind}: "
            f"unsigned bytes, {ndim} dimensions); is this the right file?"
        )
    if len(data) < 4 + 4 * ndim:
        raise DataError(f"{file}: {len(data)} bytes, too short for an IDX {kind} header")
    header = np.frombuffer(data, dtype=">u4", count=1 + ndim)
    shape = tuple(int(d) for d in header[1:])
    if shape[1:] != dims:
        expected = ", ".join(["n", *map(str, dims)])
        raise DataError(f"{file}: dimensions {list(shape)}, expected [{expected}]")
    if shape[0] == 0:
        raise DataError(
            f"{file}: holds no samples (its IDX header counts 0 {kind}), the data set would be "
            "empty; is the file complete?"
        )
    size = int(np.prod(shape))
    offset = 4 * (1 + ndim)
    if len(data) - offset != size:
        raise DataError(
            f"{file}: {len(data) - offset} data bytes after the header, expected {size} for "
            f"dimensions {list(shape)} (truncated or corrupt file)"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(shape)


def mnist(path: str, download: bool = False) -> ArrayDataset:
    """MNIST (or Fashion-MNIST) from the four official IDX files, train and test merged.

    Fashion-MNIST (https://github.com/zalandoresearch/fashion-mnist) ships the same format and
    file names: point ``path`` at its folder and this function reads it the same way.

    Args:
        path: the folder holding ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
            ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte``, each plain or ``.gz``.
        download: first fetch the missing files (gzipped) into ``path``, checksums checked.

    Returns:
        Classification data: x float32 (70000, 1, 28, 28) in [0, 1] (60000 train images, then
        10000 test images), y int64 in 0..9.

    Raises:
        DataError: a file is missing, holds no samples, or its magic number, dimensions or
            counts are wrong (an images and a labels file of different counts name both), or
            a download fails.
    """
    if download:
        from fedexp.data.download import fetch_mnist

        fetch_mnist(path)
    folder = Path(path).expanduser()
    xs, ys = [], []
    for images_name, labels_name in _MNIST_FILES:
        images_file, images_data = _read_idx(path, folder, images_name)
        labels_file, labels_data = _read_idx(path, folder, labels_name)
        images = _idx_array(images_file, images_data, _IDX_IMAGES, (28, 28))
        labels = _idx_array(labels_file, labels_data, _IDX_LABELS, ())
        if len(labels) != len(images):
            raise DataError(
                f"{labels_file}: {len(labels)} labels but {images_file} holds {len(images)} "
                "images; expected one label per image (both files of the same release)"
            )
        if len(labels) and labels.max() > 9:
            raise DataError(f"{labels_file}: label {int(labels.max())}, expected 0..9")
        xs.append(images)
        ys.append(labels)
    x = _unit(np.concatenate(xs))[:, None]
    return ArrayDataset("mnist", x, np.concatenate(ys).astype(np.int64), 10)


# ----------------------------------------------------------------------------- CIFAR (binary)
def _cifar_folder(path: str, sub: str, probe: str, pickled: tuple[str, str], archive: str) -> Path:
    """``path`` or ``path/sub``, whichever holds ``probe``; refuses the pickled release."""
    root = Path(path).expanduser()
    for folder in (root, root / sub):
        if (folder / probe).is_file():
            return folder
    for folder in (root, root / pickled[0]):
        if (folder / pickled[1]).is_file():
            raise DataError(
                f"dataset.path={path!r}: {folder} {_CIFAR_PICKLED.format(archive=archive)}"
            )
    state = "does not exist" if not root.exists() else f"has no {probe} (nor {sub}/{probe})"
    raise DataError(
        f"dataset.path={path!r}: {root} {state}; expected the folder {sub}/ extracted from "
        f"{archive} (https://www.cs.toronto.edu/~kriz/cifar.html), or its parent{_DOWNLOAD_HINT}"
    )


def _cifar_records(file: Path, label_bytes: int, label_max: tuple[int, ...]) -> np.ndarray:
    """The records of a CIFAR binary file: ``label_bytes`` label bytes then 3x32x32 pixels."""
    if not file.is_file():
        raise DataError(f"{file} not found; the binary CIFAR release holds it next to the others")
    data = file.read_bytes()
    width = label_bytes + 3 * 32 * 32
    if len(data) == 0:
        raise DataError(
            f"{file}: holds no samples (0 bytes), the data set would be empty; expected records "
            f"of {label_bytes} label byte(s) + 3072 pixel bytes (truncated download?)"
        )
    if len(data) % width:
        raise DataError(
            f"{file}: {len(data)} bytes is not a multiple of {width} (one record = "
            f"{label_bytes} label byte(s) + 3072 pixel bytes); truncated file or wrong release?"
        )
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, width)
    for k, top in enumerate(label_max):
        if records[:, k].max() > top:
            raise DataError(
                f"{file}: label byte {k} holds {int(records[:, k].max())}, expected 0..{top}"
            )
    return records


def cifar10(path: str, download: bool = False) -> ArrayDataset:
    """CIFAR-10 from its binary release (``cifar-10-binary.tar.gz``), train and test merged.

    Each record of ``data_batch_1.bin`` .. ``data_batch_5.bin`` and ``test_batch.bin`` is one
    label byte and 3072 pixel bytes: the red, green and blue 32x32 planes, row-major.

    Args:
        path: the ``cifar-10-batches-bin`` folder or its parent.
        download: first fetch and extract ``cifar-10-binary.tar.gz`` (checksum checked) if
            the folder is not complete.

    Returns:
        Classification data: x float32 (60000, 3, 32, 32) in [0, 1] (50000 train images, then
        10000 test images), y int64 in 0..9.

    Raises:
        DataError: a file is missing or its size is not a whole number of records, a label
            is out of range, the folder holds the pickled python release, or a download fails.
    """
    if download:
        from fedexp.data.download import fetch_cifar10

        fetch_cifar10(path)
    folder = _cifar_folder(
        path,
        "cifar-10-batches-bin",
        "data_batch_1.bin",
        ("cifar-10-batches-py", "data_batch_1"),
        "cifar-10-binary.tar.gz",
    )
    names = [f"data_batch_{k}.bin" for k in range(1, 6)] + ["test_batch.bin"]
    records = np.concatenate([_cifar_records(folder / n, 1, (9,)) for n in names])
    x = _unit(records[:, 1:]).reshape(-1, 3, 32, 32)
    return ArrayDataset("cifar10", x, records[:, 0].astype(np.int64), 10)


def cifar100(path: str, labels: str = "fine", download: bool = False) -> ArrayDataset:
    """CIFAR-100 from its binary release (``cifar-100-binary.tar.gz``), train and test merged.

    Each record of ``train.bin`` and ``test.bin`` is the coarse label byte, the fine label
    byte and 3072 pixel bytes (red, green, blue 32x32 planes, row-major).

    Args:
        path: the ``cifar-100-binary`` folder or its parent.
        labels: ``fine`` (100 classes) or ``coarse`` (20 superclasses).
        download: first fetch and extract ``cifar-100-binary.tar.gz`` (checksum checked) if
            the folder is not complete.

    Returns:
        Classification data: x float32 (60000, 3, 32, 32) in [0, 1] (50000 train images, then
        10000 test images), y int64.

    Raises:
        DataError: an unknown ``labels``, a missing file, a size that is not a whole number
            of records, a label out of range, the pickled python release, or a failed download.
    """
    if labels not in ("fine", "coarse"):
        raise DataError(f"dataset.labels={labels!r}: expected 'fine' (100) or 'coarse' (20)")
    if download:
        from fedexp.data.download import fetch_cifar100

        fetch_cifar100(path)
    folder = _cifar_folder(
        path,
        "cifar-100-binary",
        "train.bin",
        ("cifar-100-python", "train"),
        "cifar-100-binary.tar.gz",
    )
    records = np.concatenate(
        [_cifar_records(folder / n, 2, (19, 99)) for n in ("train.bin", "test.bin")]
    )
    column, num_classes = (1, 100) if labels == "fine" else (0, 20)
    x = _unit(records[:, 2:]).reshape(-1, 3, 32, 32)
    return ArrayDataset("cifar100", x, records[:, column].astype(np.int64), num_classes)


# ----------------------------------------------------------------------------- Tiny ImageNet
def _jpegs(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if f.suffix.lower() in (".jpeg", ".jpg"))


def _tiny_root(path: str) -> Path:
    root = Path(path).expanduser()
    for folder in (root, root / "tiny-imagenet-200"):
        if (folder / "wnids.txt").is_file():
            return folder
    raise DataError(
        f"dataset.path={path!r}: {root / 'wnids.txt'} not found; {_TINY_LAYOUT}{_DOWNLOAD_HINT}"
    )


def _tiny_files(root: Path, max_per_class: int | None) -> tuple[list[Path], list[int], int]:
    """The image files and class indices of train then val, and the number of classes."""
    wnids_file = root / "wnids.txt"
    wnids: dict[str, int] = {}
    for line_no, line in enumerate(wnids_file.read_text().splitlines(), start=1):
        wnid = line.strip()
        if not wnid:
            continue
        if wnid in wnids:
            raise DataError(f"{wnids_file}, line {line_no}: {wnid} listed twice")
        wnids[wnid] = len(wnids)
    if not wnids:
        raise DataError(f"{wnids_file}: no class ids (expected one wnid a line); {_TINY_LAYOUT}")
    per_class: list[list[Path]] = [[] for _ in wnids]
    for wnid, c in wnids.items():
        folder = root / "train" / wnid / "images"
        if not folder.is_dir():
            raise DataError(
                f"{folder} not found: class {wnid} of {wnids_file} has no training images; "
                f"{_TINY_LAYOUT}"
            )
        per_class[c] = _jpegs(folder)
        if not per_class[c]:
            raise DataError(
                f"{folder}: holds no samples (no .JPEG files for class {wnid} of {wnids_file}); "
                f"{_TINY_LAYOUT}"
            )
    notes = root / "val" / "val_annotations.txt"
    if not notes.is_file():
        raise DataError(f"{notes} not found; {_TINY_LAYOUT}")
    for line_no, line in enumerate(notes.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2:
            raise DataError(
                f"{notes}, line {line_no}: expected tab-separated file, wnid and 4 box ints, "
                f"got {line!r}"
            )
        name, wnid = fields[0].strip(), fields[1].strip()
        if wnid not in wnids:
            raise DataError(f"{notes}, line {line_no}: wnid {wnid} is not in {wnids_file}")
        file = root / "val" / "images" / name
        if not file.is_file():
            raise DataError(f"{notes}, line {line_no}: {file} not found")
        per_class[wnids[wnid]].append(file)
    files, classes = [], []
    for c, class_files in enumerate(per_class):
        kept = class_files if max_per_class is None else class_files[:max_per_class]
        files += kept
        classes += [c] * len(kept)
    return files, classes, len(wnids)


def tiny_imagenet(
    path: str, max_per_class: PositiveInt | None = None, download: bool = False
) -> ArrayDataset:
    """Tiny ImageNet (200 classes of 64x64 images) from the official ``tiny-imagenet-200``.

    The labelled parts are merged (pFedSOP §V: 550 images a class): ``train/<wnid>/images``
    (500 a class) and ``val/images`` labelled by ``val/val_annotations.txt`` (50 a class);
    ``test/`` has no labels and is ignored. The class index of a wnid is its line in
    ``wnids.txt``. Images are decoded with PIL and converted to RGB (a few are greyscale). The
    full set is 110000 images, about 5.4 GB as float32.

    Args:
        path: the ``tiny-imagenet-200`` folder or its parent.
        max_per_class: keep at most this many images of each class (its train images in file
            name order first, then its val images), for quick runs; null keeps all.
        download: first fetch and extract ``tiny-imagenet-200.zip`` (checksum checked) if
            the folder is not there.

    Returns:
        Classification data: x float32 (n, 3, 64, 64) in [0, 1], y int64, ordered by class.

    Raises:
        DataError: a missing wnids.txt, annotation file or class folder, a class folder
            without images, an annotation naming an unknown wnid or a missing file, or an
            image that is not a 64x64 picture, or a failed download.
    """
    from PIL import Image
    from PIL import UnidentifiedImageError

    if max_per_class is not None and max_per_class < 1:
        raise DataError(f"dataset.max_per_class={max_per_class}: expected ≥ 1 (or null for all)")
    if download:
        from fedexp.data.download import fetch_tiny_imagenet

        fetch_tiny_imagenet(path)
    files, classes, num_classes = _tiny_files(_tiny_root(path), max_per_class)
    x = np.empty((len(files), 3, 64, 64), dtype=np.float32)
    for i, file in enumerate(files):
        try:
            with Image.open(file) as image:
                pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
        except (OSError, UnidentifiedImageError) as exc:
            raise DataError(f"{file}: cannot be read as an image ({exc})") from None
        if pixels.shape != (64, 64, 3):
            raise DataError(f"{file}: {pixels.shape[1]}x{pixels.shape[0]} image, expected 64x64")
        x[i] = pixels.transpose(2, 0, 1)
    x /= np.float32(255)
    return ArrayDataset("tiny_imagenet", x, np.asarray(classes, dtype=np.int64), num_classes)
