"""Run provenance tags (git commit, package versions, device, host) and the dataset record
(source, content hash, profile), without running anything."""

from __future__ import annotations

import hashlib
import platform
import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest
import torch

from fedexp.data.tabular import breast_cancer
from fedexp.data.tabular import csv_table
from fedexp.tracking import provenance
from fedexp.tracking.dataset_input import DIGEST_CHARS
from fedexp.tracking.dataset_input import content_hash
from fedexp.tracking.dataset_input import describe_dataset


def _git(cwd, *args):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
    )


@pytest.fixture
def package_in_repo(tmp_path):
    """A git checkout whose ``pkg/`` holds a committed ``__init__.py``."""
    pkg = tmp_path / "repo" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    _git(tmp_path / "repo", "init", "-q")
    _git(tmp_path / "repo", "add", ".")
    _git(tmp_path / "repo", "commit", "-q", "-m", "one")
    return pkg


def test_git_tags_name_the_commit_and_whether_tracked_files_changed(package_in_repo):
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=package_in_repo, capture_output=True, text=True
    ).stdout.strip()
    tags = provenance.git_tags(package_in_repo)
    assert tags == {"mlflow.source.git.commit": head, "fedexp.git.dirty": "false"}
    (package_in_repo.parent / "notes.txt").write_text("untracked files do not count\n")
    assert provenance.git_tags(package_in_repo)["fedexp.git.dirty"] == "false"
    (package_in_repo / "__init__.py").write_text("x = 2\n")
    assert provenance.git_tags(package_in_repo)["fedexp.git.dirty"] == "true"


def test_git_tags_are_skipped_outside_a_checkout_or_for_an_untracked_package(tmp_path):
    plain = tmp_path / "plain" / "pkg"
    plain.mkdir(parents=True)
    (plain / "__init__.py").write_text("")
    assert provenance.git_tags(plain) == {}
    # a wheel installed into the virtual environment of some other git repository
    repo = tmp_path / "project"
    site = repo / ".venv" / "site-packages" / "pkg"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (repo / "README").write_text("a project\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "README")
    _git(repo, "commit", "-q", "-m", "one")
    assert provenance.git_tags(site) == {}


def test_version_tags_hold_every_package():
    import hydra
    import mlflow

    import fedexp

    tags = provenance.version_tags()
    v = sys.version_info
    assert tags == {
        "fedexp.version.python": f"{v.major}.{v.minor}.{v.micro}",
        "fedexp.version.torch": torch.__version__,
        "fedexp.version.fedexp": fedexp.__version__,
        "fedexp.version.mlflow": mlflow.__version__,
        "fedexp.version.hydra-core": hydra.__version__,
        "fedexp.version.monai": metadata.version("monai"),
        "fedexp.version.numpy": np.__version__,
    }


def test_device_tags_name_the_resolved_device(monkeypatch):
    cpu = provenance.device_tags(torch.device("cpu"))
    assert cpu["fedexp.device"] == "cpu" and cpu["fedexp.device.name"].strip()
    # "cuda" without an index (device=auto) is named by the index torch uses, with its GPU
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"GPU number {i}")
    assert provenance.device_tags(torch.device("cuda")) == {
        "fedexp.device": "cuda:1",
        "fedexp.device.name": "GPU number 1",
    }
    assert provenance.device_tags(torch.device("cuda:3"))["fedexp.device.name"] == "GPU number 3"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tags_on_a_real_gpu():
    tags = provenance.device_tags(torch.device("cuda"))
    index = torch.cuda.current_device()
    assert tags == {
        "fedexp.device": f"cuda:{index}",
        "fedexp.device.name": torch.cuda.get_device_name(index),
    }


def test_run_tags_hold_the_host():
    assert provenance.run_tags(torch.device("cpu"))["fedexp.host"] == platform.node()


def test_content_hash_is_sha256_of_the_arrays_bytes_and_sees_any_change():
    data = breast_cancer()
    expected = hashlib.sha256(data.x.tobytes() + data.y.tobytes()).hexdigest()
    assert content_hash(data.x, data.y) == expected
    # a non-contiguous view hashes as its C-ordered copy
    wide = np.asfortranarray(data.x)
    assert not wide.flags.c_contiguous and content_hash(wide, data.y) == expected
    changed = data.x.copy()
    changed[100, 7] += 1e-6
    assert content_hash(changed, data.y) != expected
    assert content_hash(data.x, 1 - data.y) != expected


def test_dataset_record_of_a_builtin_and_of_a_file(tmp_path, monkeypatch):
    data = breast_cancer()
    rec = describe_dataset(data, {"_target_": "fedexp.data.tabular.breast_cancer"})
    sha = hashlib.sha256(data.x.tobytes() + data.y.tobytes()).hexdigest()
    assert (rec.name, rec.source, rec.source_type) == (
        "breast_cancer",
        "sklearn.datasets.load_breast_cancer",
        "code",
    )
    assert rec.sha256 == sha and rec.digest == sha[:DIGEST_CHARS] and len(rec.digest) <= 36
    assert rec.profile["features_shape"] == [569, 30] and rec.profile["num_classes"] == 2
    assert rec.profile["targets_shape"] == [569] and rec.profile["sha256"] == sha

    (tmp_path / "d.csv").write_text("a,b,y\n1,2,x\n3,4,z\n5,6,x\n7,1,w\n")
    monkeypatch.chdir(tmp_path)  # a relative path is recorded as the absolute one it names
    node = {"_target_": "fedexp.data.tabular.csv_table", "path": "d.csv", "label": "y"}
    rec = describe_dataset(csv_table("d.csv", "y"), node)
    assert (rec.source, rec.source_type) == (str(tmp_path / "d.csv"), "local")
    assert rec.profile["num_classes"] == 3 and rec.profile["features_shape"] == [4, 2]
    gen = describe_dataset(
        data, {"_target_": "fedexp.data.tabular.synthetic_tabular", "seed": 3, "num_sites": 2}
    )
    assert gen.source == "fedexp.data.tabular.synthetic_tabular(seed=3, num_sites=2)"


def test_a_process_reads_its_codes_commit_and_versions_once(monkeypatch):
    """A sweep's runs in one process tag the code it imported: ``git`` runs once, not a run."""
    calls: list[list[str]] = []
    real = provenance._git

    def counted(args, cwd):
        calls.append(args)
        return real(args, cwd)

    monkeypatch.setattr(provenance, "_git", counted)
    provenance._code_tags.cache_clear()
    try:
        first = provenance.run_tags(torch.device("cpu"))
        again = provenance.run_tags(torch.device("cpu"))
        assert first == again
        assert {k: first[k] for k in provenance.version_tags()} == provenance.version_tags()
        git = provenance.git_tags()
        assert {k: first[k] for k in git} == git
        per_read = 3 if git else 1  # ls-files, rev-parse, status; or ls-files alone
        assert len(calls) == 2 * per_read  # run_tags twice: one read; git_tags above: one
    finally:
        provenance._code_tags.cache_clear()
