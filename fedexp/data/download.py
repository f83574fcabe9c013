"""``dataset.download=true``: fetch MNIST, CIFAR-10/100 and Tiny ImageNet where they are missing.

The files are fetched with pooch (https://www.fatiando.org/pooch), which streams each one to a
temporary file, checks its checksum against :data:`RESOURCES` and only then gives it its name,
and are laid out exactly as :mod:`fedexp.data.images` reads them:

* ``mnist``: the four ``*-idx?-ubyte.gz`` files into ``dataset.path`` (read gzipped as they are);
* ``cifar10`` / ``cifar100``: the *binary* archive (never the pickled python one), extracted to
  its ``cifar-10-batches-bin/`` / ``cifar-100-binary/`` folder: ``dataset.path`` itself when it
  has that name, else that folder inside ``dataset.path``;
* ``tiny_imagenet``: ``tiny-imagenet-200.zip``, extracted the same way to ``tiny-imagenet-200/``.

Files already present are kept and not downloaded again (the loader then checks their
format). An archive is extracted into a hidden folder beside it first and moved into place
after, so an interrupted extraction never leaves a half release that looks complete; an archive
fetched here is deleted once extracted, one a user put in place by hand (checked the same way)
is kept. A failed download or a checksum mismatch is one :class:`~fedexp.errors.DataError`
naming the URL, the path and how to download it by hand. A progress bar is shown on a terminal
(when tqdm is installed). The jobs of a parallel sweep fetch one at a time (a file lock): the
first downloads, the others then find the files present.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fedexp.errors import DataError

try:
    import fcntl
except ImportError:  # Windows: no lock (concurrent first fetches then each download)
    fcntl = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Resource:
    """A file to fetch: its URL and pooch's ``known_hash`` (``"md5:<hex>"``)."""

    url: str
    known_hash: str


#: MNIST: the mirror torchvision lists beside http://yann.lecun.com/exdb/mnist/ (``MNIST.mirrors``;
#: the original site has refused downloads at times), and the MD5s torchvision checks
#: (``MNIST.resources``), https://github.com/pytorch/vision/blob/main/torchvision/datasets/mnist.py
MNIST_MIRROR = "https://ossci-datasets.s3.amazonaws.com/mnist/"
#: CIFAR: the authors' page https://www.cs.toronto.edu/~kriz/cifar.html lists the URLs and the
#: md5sums of the "binary version (suitable for C programs)" of CIFAR-10 and CIFAR-100.
CIFAR_SITE = "https://www.cs.toronto.edu/~kriz/"

# Tiny ImageNet: the URL the CS231n course (http://cs231n.stanford.edu/) publishes; the site
# lists no checksum, the MD5 is the one data-set libraries check, e.g. ``TinyImagenet.md5`` in
# https://github.com/ContinualAI/avalanche/blob/master/avalanche/benchmarks/datasets/tiny_imagenet/tiny_imagenet.py

#: Every file ``dataset.download=true`` may fetch, by its official name (sources above).
RESOURCES: dict[str, Resource] = {
    "train-images-idx3-ubyte.gz": Resource(
        MNIST_MIRROR + "train-images-idx3-ubyte.gz", "md5:f68b3c2dcbeaaa9fbdd348bbdeb94873"
    ),
    "train-labels-idx1-ubyte.gz": Resource(
        MNIST_MIRROR + "train-labels-idx1-ubyte.gz", "md5:d53e105ee54ea40749a09fcbcd1e9432"
    ),
    "t10k-images-idx3-ubyte.gz": Resource(
        MNIST_MIRROR + "t10k-images-idx3-ubyte.gz", "md5:9fb629c4189551a2d022fa330f9573f3"
    ),
    "t10k-labels-idx1-ubyte.gz": Resource(
        MNIST_MIRROR + "t10k-labels-idx1-ubyte.gz", "md5:ec29112dd5afa0611ce80d1b7f02629c"
    ),
    "cifar-10-binary.tar.gz": Resource(
        CIFAR_SITE + "cifar-10-binary.tar.gz", "md5:c32a1d4ab5d03f1284b67883e8d87530"
    ),
    "cifar-100-binary.tar.gz": Resource(
        CIFAR_SITE + "cifar-100-binary.tar.gz", "md5:03b5dce01913d631647c71ecec9e9cb8"
    ),
    "tiny-imagenet-200.zip": Resource(
        "http://cs231n.stanford.edu/tiny-imagenet-200.zip", "md5:90528d7ca1a48142e341f4ef8d21d0de"
    ),
}

_MNIST_NAMES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_CIFAR10_FILES = tuple(f"data_batch_{k}.bin" for k in range(1, 6)) + ("test_batch.bin",)


def _progressbar() -> bool:
    """Whether to show pooch's tqdm bar: on a terminal, when tqdm is installed."""
    return sys.stderr.isatty() and importlib.util.find_spec("tqdm") is not None


@contextmanager
def _exclusive(folder: Path) -> Iterator[None]:
    """One fetch into ``folder`` at a time across processes (the jobs of a parallel sweep).

    The lock file lives in the temporary directory, keyed by the folder, so the data folder
    holds nothing but the official layout. Without ``fcntl`` (or that file) there is no lock.
    """
    key = hashlib.sha1(str(folder.resolve()).encode(), usedforsecurity=False).hexdigest()[:16]
    lock = Path(tempfile.gettempdir()) / f"fedexp-download-{key}.lock"
    try:
        handle = None if fcntl is None else open(lock, "a")  # noqa: SIM115 - closed below
    except OSError:
        handle = None
    if handle is None:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _retrieve(name: str, folder: Path, by_hand: str, processor=None) -> None:  # noqa: ANN001
    """``pooch.retrieve`` of ``RESOURCES[name]`` as ``folder/name``; failures as one DataError.

    ``by_hand`` finishes the message: what to do with the file once downloaded by hand.
    """
    import pooch
    import requests

    resource = RESOURCES[name]
    target = folder / name
    what = f"dataset.download=true: {resource.url} -> {target}"
    manual = f"download it by hand into {folder}{by_hand}"
    try:
        pooch.retrieve(
            resource.url,
            known_hash=resource.known_hash,
            fname=name,
            path=folder,
            processor=processor,
            progressbar=_progressbar(),
        )
    except DataError:
        raise
    except requests.RequestException as exc:  # before OSError: it is one
        raise DataError(
            f"{what}: download failed ({_one_line(exc)}); is the network reachable? If not, "
            f"{manual}"
        ) from None
    except ValueError as exc:
        if "hash" not in str(exc):
            raise DataError(f"{what}: {_one_line(exc)}; {manual}") from None
        raise DataError(
            f"{what}: checksum mismatch, the download is not the published file "
            f"({_one_line(exc)}); the download was discarded. Retry later, or {manual} and check "
            f"its {resource.known_hash.split(':')[0]} is {resource.known_hash.split(':')[1]}"
        ) from None
    except (OSError, EOFError, tarfile.TarError, zipfile.BadZipFile) as exc:
        raise DataError(f"{what}: {_one_line(exc)}; {manual}") from None


class _Extract:
    """pooch processor: extract the archive beside it, then move its release folder in place.

    The archive is extracted (by pooch's :class:`~pooch.Untar` / :class:`~pooch.Unzip`) into
    a hidden folder next to it; ``<that>/<release>`` is then renamed to ``dest`` (or, if
    ``dest`` exists already, merged into it file by file, the ``markers`` the loaders probe
    last). An archive this call downloaded is deleted afterwards.
    """

    def __init__(self, kind: str, release: str, dest: Path, markers: Sequence[str]):
        self.kind, self.release, self.dest, self.markers = kind, release, dest, set(markers)

    def __call__(self, fname: str, action: str, pup: object) -> str:
        import pooch

        archive = Path(fname)
        scratch = archive.parent / f".{self.release}.extracting"
        shutil.rmtree(scratch, ignore_errors=True)  # left by an interrupted run
        extractor = pooch.Untar if self.kind == "tar" else pooch.Unzip
        try:
            extractor(extract_dir=scratch.name)(fname, action, pup)
            found = scratch / self.release
            if not found.is_dir():
                raise DataError(
                    f"dataset.download=true: {archive} holds no {self.release}/ folder; is it "
                    f"the official archive? Delete it and retry"
                )
            self._move(found)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if action in ("download", "update"):
            archive.unlink(missing_ok=True)
        return str(self.dest)

    def _move(self, found: Path) -> None:
        if not self.dest.exists():
            self.dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(found, self.dest)  # one rename: all or nothing
            return
        files = sorted(p for p in found.rglob("*") if p.is_file())
        files.sort(key=lambda p: p.relative_to(found).as_posix() in self.markers)
        for file in files:
            target = self.dest / file.relative_to(found)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(file, target)


def _has(folder: Path, names: Sequence[str]) -> bool:
    return all((folder / n).is_file() for n in names)


def _release_dest(path: str, release: str, markers: Sequence[str]) -> Path | None:
    """Where the release folder goes, or None if it is complete at ``path`` already.

    The loaders read ``path`` or ``path/<release>``: a complete one of these is kept; else the
    release goes to ``path`` when it holds the loader's first marker or is named ``release``,
    and to ``path/<release>`` otherwise.
    """
    root = Path(path).expanduser()
    if _has(root, markers) or _has(root / release, markers):
        return None
    if (root / markers[0]).is_file() or root.name == release:
        return root
    return root / release


def _fetch_release(
    path: str, archive: str, kind: str, release: str, markers: Sequence[str]
) -> None:
    dest = _release_dest(path, release, markers)
    if dest is None:
        return
    with _exclusive(dest.parent):
        if _release_dest(path, release, markers) is None:
            return  # another job fetched it while this one waited
        by_hand = f" and extract it there ({release}/ must end up at {dest})"
        _retrieve(archive, dest.parent, by_hand, _Extract(kind, release, dest, markers))


def fetch_mnist(path: str) -> None:
    """The four MNIST ``.gz`` IDX files into ``path``; a file present (plain or .gz) is kept."""
    folder = Path(path).expanduser()

    def missing() -> list[str]:
        return [
            n
            for n in _MNIST_NAMES
            if not ((folder / n).is_file() or (folder / f"{n}.gz").is_file())
        ]

    if not missing():
        return
    with _exclusive(folder):
        for name in missing():  # again: another job may have fetched some while this one waited
            _retrieve(f"{name}.gz", folder, " (the .gz as it is, or gunzipped)")


def fetch_cifar10(path: str) -> None:
    """``cifar-10-binary.tar.gz``, extracted to ``cifar-10-batches-bin/``, unless present."""
    _fetch_release(path, "cifar-10-binary.tar.gz", "tar", "cifar-10-batches-bin", _CIFAR10_FILES)


def fetch_cifar100(path: str) -> None:
    """``cifar-100-binary.tar.gz``, extracted to ``cifar-100-binary/``, unless present."""
    markers = ("train.bin", "test.bin")
    _fetch_release(path, "cifar-100-binary.tar.gz", "tar", "cifar-100-binary", markers)


def fetch_tiny_imagenet(path: str) -> None:
    """``tiny-imagenet-200.zip``, extracted to ``tiny-imagenet-200/``, unless present."""
    markers = ("wnids.txt", "val/val_annotations.txt")
    _fetch_release(path, "tiny-imagenet-200.zip", "zip", "tiny-imagenet-200", markers)
