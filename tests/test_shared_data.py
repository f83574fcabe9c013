"""A data set over two ranks is loaded once (issue "Beyond one process": data written once by
the loaders and memory-mapped): rank 0 loads it and writes its arrays, both ranks map them and
hold what one process loads, the folder is gone after, and a wrong data set is rank 0's error
on both ranks."""

from __future__ import annotations

import hashlib
import json
import mmap

import numpy as np
import pytest

from fedexp.config.instantiate import instantiate_checked
from fedexp.data.dataset import ArrayDataset
from fedexp.engine.processes.shared_data import _open
from fedexp.engine.processes.shared_data import _write
from fedexp.engine.processes.shared_data import load_dataset
from fedexp.engine.processes.shared_data import mapped
from helpers import compose_config


@pytest.mark.slow
def test_two_ranks_map_one_copy_of_what_one_process_loads(tmp_path):
    from distributed_worker import shared_data
    from distributed_worker import spawn_ranks

    spawn_ranks(shared_data, str(tmp_path), timeout=300)
    node = compose_config("dataset=synthetic", "dataset.num_samples=700").dataset
    alone = instantiate_checked(node, "dataset")
    assert not mapped(alone.x)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["mapped"] == [True, True, True], rank
        assert got["x"] == hashlib.sha256(alone.x.tobytes()).hexdigest()
        assert got["y"] == hashlib.sha256(alone.y.tobytes()).hexdigest()
        assert got["groups"] == alone.groups.tolist()
        assert got["fields"] == [alone.name, alone.num_classes, alone.task, alone.feature_names]
        assert got["left"] == [], got["left"]  # rank 0 removed its folder once both had mapped
        assert got["error"] is not None and "num_features" in got["error"][1], got["error"]
    errors = [json.loads((tmp_path / f"rank{r}.json").read_text())["error"] for r in (0, 1)]
    assert errors[0][0] == "ConfigError" and errors[1] == errors[0]  # rank 0's class and line


def test_one_process_loads_as_before():
    node = compose_config("dataset=synthetic", "dataset.num_samples=300").dataset
    data = load_dataset(node, None)
    assert not mapped(data.x)
    np.testing.assert_array_equal(data.x, instantiate_checked(node, "dataset").x)


def test_files_are_read_only_with_their_token(tmp_path):
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    data = ArrayDataset("t", x, np.arange(6) % 2, 2, np.array(list("aabbcc")), ["a", "b", "c", "d"])
    written = _write(data, str(tmp_path))
    assert written is not None
    where, token = written
    assert json.loads((where / "meta.json").read_text())["token"] == token
    assert _open(where, "not-" + token) is None  # a folder of the same name elsewhere
    assert _open(tmp_path / "absent", token) is None  # another machine's folder
    back = _open(where, token)
    assert back is not None and mapped(back.x) and mapped(back.groups)
    np.testing.assert_array_equal(back.x, x)
    assert back.groups.tolist() == list("aabbcc") and back.feature_names == ["a", "b", "c", "d"]
    back.x[0, 0] = -1.0  # a copy-on-write map: the file keeps its bytes
    assert np.load(where / "x.npy")[0, 0] == 0.0


def test_what_cannot_be_written_is_not(tmp_path):
    objects = np.array([{"a": 1}] * 3, dtype=object)
    data = ArrayDataset("t", np.zeros((3, 2), np.float32), np.zeros(3, np.int64), 2, objects)
    assert _write(data, str(tmp_path)) is None
    assert list(tmp_path.iterdir()) == []
    plain = ArrayDataset("t", np.zeros((3, 2), np.float32), np.zeros(3, np.int64), 2)
    (tmp_path / "file.txt").write_text("a file")
    assert _write(plain, str(tmp_path / "file.txt" / "under")) is None  # a folder under a file
    assert [p.name for p in tmp_path.iterdir()] == ["file.txt"]


def test_mapped_sees_through_views(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(10.0))
    a = np.load(tmp_path / "a.npy", mmap_mode="r")
    assert mapped(a) and mapped(a[2:5]) and mapped(np.asarray(a).reshape(2, 5))
    assert not mapped(np.array(a))
    buf = mmap.mmap(-1, 80)
    assert mapped(np.frombuffer(buf, dtype=np.float64))


def test_a_killed_rank_0s_data_folder_is_reaped_by_the_next_run(tmp_path, monkeypatch):
    """Rank 0's folder names its owner like a ``store=disk`` folder: when rank 0 is killed
    before it removes it (between writing and every rank mapping), the next run that makes a
    scratch folder there removes it; a live owner's is kept."""
    import os
    import subprocess
    import sys

    from fedexp.engine.clients import states

    data = ArrayDataset("t", np.zeros((4, 2), np.float32), np.arange(4) % 2, 2)
    live, _ = _write(data, str(tmp_path))
    assert live.name.startswith(f"{states.SCRATCH_PREFIX}{os.getpid()}-")
    assert json.loads((live / states.OWNER_FILE).read_text())["pid"] == os.getpid()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    monkeypatch.setattr(os, "getpid", lambda: child.pid)  # a rank 0 that has died since
    dead, _ = _write(data, str(tmp_path))
    monkeypatch.undo()
    states._MADE.remove(dead)  # (its process would not be this one)
    assert states.reap_scratch(tmp_path) == [dead]
    assert live.is_dir() and not dead.exists()
    states.release_scratch(live)
    assert not live.exists() and live not in states._MADE
