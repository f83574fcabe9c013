"""``dataset.download=true`` without a network: pooch fetches from a local HTTP server.

Issue "The researcher's loop, round two", item 10. The server (127.0.0.1, a thread) serves
small files written in the exact official formats: the four gzipped MNIST IDX files, the
CIFAR-10/100 *binary* tarballs (``cifar-10-batches-bin/``, ``cifar-100-binary/``) and a tiny
``tiny-imagenet-200.zip``; :data:`fedexp.data.download.RESOURCES` is patched to their URLs and
MD5s. Checked: the loaders then read them, a wrong checksum is refused in one line, present
files are not fetched again (the server sees no request), ``download=false`` says how to fetch.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import tarfile
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from data_prep import synthetic_images as images
from fedexp.config.instantiate import instantiate_checked
from fedexp.data import download
from fedexp.data.download import Resource
from fedexp.data.images import cifar10
from fedexp.data.images import cifar100
from fedexp.data.images import mnist
from fedexp.data.images import tiny_imagenet
from fedexp.errors import DataError
from helpers import compose_config

MNIST_GZ = [
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
]


class Server:
    """A local HTTP server of ``root``'s files that records the paths it is asked for."""

    def __init__(self, root: Path):
        self.root, self.requests, self.delay = root, [], 0.0
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(root), **kwargs)

            def do_GET(self):  # noqa: N802 - http.server's name
                server.requests.append(self.path.lstrip("/"))
                time.sleep(server.delay)
                super().do_GET()

            def log_message(self, *args):  # quiet
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def publish(self, name: str, data: bytes, md5: str | None = None) -> str:
        """Serve ``data`` as ``name``; return the checksum the table should list."""
        (self.root / name).write_bytes(data)
        return f"md5:{md5 or hashlib.md5(data).hexdigest()}"


@pytest.fixture
def server(tmp_path, monkeypatch):
    """The server, with RESOURCES pointing every official name at it (unpublished: 404)."""
    www = tmp_path / "www"
    www.mkdir()
    srv = Server(www)
    for var in ("NO_PROXY", "no_proxy"):  # never send 127.0.0.1 through a proxy
        monkeypatch.setenv(var, "127.0.0.1,localhost")
    table = {name: Resource(srv.url + name, r.known_hash) for name, r in download.RESOURCES.items()}
    monkeypatch.setattr(download, "RESOURCES", table)
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()
    srv.thread.join(5)


def publish(server: Server, name: str, data: bytes, md5: str | None = None) -> None:
    download.RESOURCES[name] = Resource(server.url + name, server.publish(name, data, md5))


# ----------------------------------------------------------------------------- archives
def _tar_gz(folder: Path) -> bytes:
    """``folder`` as a .tar.gz whose members start with ``folder.name/`` (as the official)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    return buffer.getvalue()


def _zip(folder: Path) -> bytes:
    """``folder`` as a .zip with directory entries, members under ``folder.name/``."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted([folder, *folder.rglob("*")]):
            name = path.relative_to(folder.parent).as_posix()
            if path.is_dir():
                archive.writestr(name + "/", b"")
            else:
                archive.write(path, name)
    return buffer.getvalue()


@pytest.fixture
def releases(tmp_path):
    """The four official releases, small: source folders and the bytes served for them."""
    src = tmp_path / "src"
    mnist_dir = images.write_mnist(src / "mnist", n_train=6, n_test=4, gz=True)
    c10 = images.write_cifar10(src, per_file=2)
    (c10 / "batches.meta.txt").write_text("airplane\nautomobile\n")
    (c10 / "readme.html").write_text("<html></html>\n")
    c100 = images.write_cifar100(src, n_train=4, n_test=2)
    (c100 / "fine_label_names.txt").write_text("apple\n")
    (c100 / "coarse_label_names.txt").write_text("fruit\n")
    tiny = images.write_tiny_imagenet(src, classes=2, train_per_class=2, val=2)
    (tiny / "words.txt").write_text("n10000000\tthing\n")
    (tiny / "test" / "images").mkdir(parents=True)
    (tiny / "test" / "images" / "test_0.JPEG").write_bytes(
        next((tiny / "val" / "images").iterdir()).read_bytes()
    )
    served = {name: (mnist_dir / name).read_bytes() for name in MNIST_GZ}
    served["cifar-10-binary.tar.gz"] = _tar_gz(c10)
    served["cifar-100-binary.tar.gz"] = _tar_gz(c100)
    served["tiny-imagenet-200.zip"] = _zip(tiny)
    folders = {"mnist": mnist_dir, "cifar10": c10, "cifar100": c100, "tiny_imagenet": tiny}
    return folders, served


# loader, archive, release folder, number of samples in the small release
ARCHIVES = {
    "cifar10": (cifar10, "cifar-10-binary.tar.gz", "cifar-10-batches-bin", 12),
    "cifar100": (cifar100, "cifar-100-binary.tar.gz", "cifar-100-binary", 6),
    "tiny_imagenet": (tiny_imagenet, "tiny-imagenet-200.zip", "tiny-imagenet-200", 6),
}


def _same(a, b) -> None:
    assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)
    assert a.num_classes == b.num_classes


# ----------------------------------------------------------------------------- MNIST
def test_mnist_download_through_the_config_then_nothing_is_fetched_again(
    server, releases, tmp_path
):
    folders, served = releases
    for name in MNIST_GZ:
        publish(server, name, served[name])
    path = tmp_path / "data" / "mnist"
    assert compose_config("dataset=mnist").dataset.download is False
    cfg = compose_config("dataset=mnist", f"dataset.path={path}", "dataset.download=true")
    data = instantiate_checked(cfg.dataset, "dataset")
    assert data.x.shape == (10, 1, 28, 28)
    _same(data, mnist(str(folders["mnist"])))
    assert sorted(server.requests) == sorted(MNIST_GZ)
    assert sorted(p.name for p in path.iterdir()) == sorted(MNIST_GZ)  # gzipped, as served
    server.requests.clear()
    _same(mnist(str(path), download=True), data)
    assert server.requests == []


def test_mnist_fetches_only_the_missing_files(server, releases, tmp_path):
    folders, served = releases
    for name in MNIST_GZ:
        publish(server, name, served[name])
    path = tmp_path / "mnist"
    images.write_mnist(path, n_train=6, n_test=4, gz=False)  # plain files count as present
    (path / "t10k-labels-idx1-ubyte").unlink()
    data = mnist(str(path), download=True)
    assert server.requests == ["t10k-labels-idx1-ubyte.gz"]
    assert data.x.shape == (10, 1, 28, 28)


# ----------------------------------------------------------------------------- archives
@pytest.mark.parametrize("kind", list(ARCHIVES))
@pytest.mark.parametrize("named", [True, False], ids=["release-folder", "parent"])
def test_archive_is_fetched_extracted_and_read(server, releases, tmp_path, kind, named):
    """dataset.path = the release folder itself (data/cifar-10-batches-bin) or its parent."""
    folders, served = releases
    loader, archive, release, n = ARCHIVES[kind]
    publish(server, archive, served[archive])
    data_dir = tmp_path / "data"
    path = data_dir / release if named else data_dir
    data = loader(str(path), download=True)
    assert len(data.y) == n and server.requests == [archive]
    _same(data, loader(str(folders[kind])))
    # the official layout, the archive fetched here deleted, no scratch folder left
    assert sorted(p.name for p in data_dir.iterdir()) == [release]
    extracted = sorted(p.relative_to(data_dir) for p in (data_dir / release).rglob("*"))
    assert extracted == sorted(
        p.relative_to(folders[kind].parent) for p in folders[kind].rglob("*")
    )
    server.requests.clear()
    _same(loader(str(path), download=True), data)
    assert server.requests == []


@pytest.mark.parametrize("kind", list(ARCHIVES))
def test_a_complete_release_is_kept_without_a_request(server, releases, tmp_path, kind):
    folders, served = releases
    loader, archive, release, _ = ARCHIVES[kind]
    publish(server, archive, served[archive])
    writer = {
        "cifar10": images.write_cifar10,
        "cifar100": images.write_cifar100,
        "tiny_imagenet": images.write_tiny_imagenet,
    }[kind]
    present = writer(tmp_path / "mine", seed=7)  # different from what the server has
    data = loader(str(present), download=True)
    assert server.requests == []
    _same(data, loader(str(present)))


def test_an_incomplete_release_is_completed_from_the_archive(server, releases, tmp_path):
    folders, served = releases
    publish(server, "cifar-10-binary.tar.gz", served["cifar-10-binary.tar.gz"])
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    (folder / "data_batch_1.bin").write_bytes(
        (folders["cifar10"] / "data_batch_1.bin").read_bytes()
    )
    data = cifar10(str(folder), download=True)
    assert server.requests == ["cifar-10-binary.tar.gz"]
    _same(data, cifar10(str(folders["cifar10"])))


def test_an_archive_put_in_place_by_hand_is_checked_extracted_and_kept(server, releases, tmp_path):
    _, served = releases
    archive = "cifar-100-binary.tar.gz"
    publish(server, archive, served[archive])
    (tmp_path / archive).write_bytes(served[archive])
    data = cifar100(str(tmp_path), download=True)
    assert server.requests == [] and len(data.y) == 6
    assert (tmp_path / archive).is_file() and (
        tmp_path / "cifar-100-binary" / "train.bin"
    ).is_file()


def test_concurrent_jobs_download_once(server, releases, tmp_path):
    """A parallel sweep's jobs: the first fetches, the others wait and find the release."""
    _, served = releases
    archive = "cifar-10-binary.tar.gz"
    publish(server, archive, served[archive])
    server.delay = 0.5  # the first download is still running when the others ask
    path = str(tmp_path / "cifar-10-batches-bin")
    results: list = [None] * 3

    def job(i: int) -> None:
        results[i] = cifar10(path, download=True)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert server.requests == [archive]
    for data in results:
        _same(data, results[0])


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kind", ["mnist", *ARCHIVES])
def test_a_wrong_checksum_is_refused_in_one_line_and_nothing_is_kept(
    server, releases, tmp_path, kind
):
    _, served = releases
    names = MNIST_GZ if kind == "mnist" else [ARCHIVES[kind][1]]
    for name in names:
        publish(server, name, served[name], md5="0" * 32)
    loader = mnist if kind == "mnist" else ARCHIVES[kind][0]
    path = tmp_path / "data"
    with pytest.raises(DataError) as err:
        loader(str(path), download=True)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("dataset.download=true: ")
    assert f"{server.url}{names[0]}" in msg and str(path) in msg
    assert "checksum mismatch" in msg and f"md5 is {'0' * 32}" in msg
    assert f"download it by hand into {path}" in msg
    assert list(path.iterdir()) == []  # no file, no half release, no scratch folder


def test_a_failed_download_names_the_url_the_path_and_the_manual_way(server, tmp_path):
    path = tmp_path / "tiny"  # nothing published: the server answers 404
    with pytest.raises(DataError) as err:
        tiny_imagenet(str(path), download=True)
    msg = str(err.value)
    url = f"{server.url}tiny-imagenet-200.zip"
    assert "\n" not in msg and f"{url} -> {path / 'tiny-imagenet-200.zip'}" in msg
    assert "download failed (HTTPError: 404" in msg
    assert f"download it by hand into {path} and extract it there" in msg


def test_an_unreachable_server_is_one_line(monkeypatch, tmp_path):
    # a port nothing listens on (bound, then closed)
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(var, "127.0.0.1,localhost")
    url = f"http://127.0.0.1:{port}/train-images-idx3-ubyte.gz"
    monkeypatch.setitem(download.RESOURCES, "train-images-idx3-ubyte.gz", Resource(url, "md5:0"))
    with pytest.raises(DataError, match="download failed .*ConnectionError") as err:
        mnist(str(tmp_path), download=True)
    assert url in str(err.value) and "is the network reachable?" in str(err.value)


@pytest.mark.parametrize(
    "loader", [mnist, cifar10, cifar100, tiny_imagenet], ids=lambda f: f.__name__
)
def test_missing_files_without_download_say_how_to_fetch_them(loader, tmp_path):
    with pytest.raises(DataError) as err:
        loader(str(tmp_path / "nowhere"))
    msg = str(err.value)
    assert "or set dataset.download=true to fetch it there" in msg and "\n" not in msg
    assert not (tmp_path / "nowhere").exists()  # nothing fetched, nothing created


def test_the_progress_bar_only_on_a_terminal_with_tqdm(monkeypatch):
    import importlib.util
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert download._progressbar() is False
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert download._progressbar() is (importlib.util.find_spec("tqdm") is not None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert download._progressbar() is False


def test_the_table_lists_the_official_urls_and_md5s():
    table = download.RESOURCES
    for name in MNIST_GZ:
        assert table[name].url == f"https://ossci-datasets.s3.amazonaws.com/mnist/{name}"
    assert table["cifar-10-binary.tar.gz"].url == (
        "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
    )
    assert table["cifar-100-binary.tar.gz"].known_hash == "md5:03b5dce01913d631647c71ecec9e9cb8"
    assert table["tiny-imagenet-200.zip"].url == "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
    assert all(r.known_hash.startswith("md5:") and len(r.known_hash) == 36 for r in table.values())
