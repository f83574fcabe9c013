"""Each experiment file gives its paper's settings, algorithm by algorithm.

``fedexp run +experiment=X algorithm=Y`` must compose into the settings the paper used for
method Y in experiment X, without the commands in the file's header. :data:`PAPERS` holds, for
every experiment file (conf/experiment/*.yaml) and every algorithm its sweep or header runs,
the values the paper states and where it states them; a value the paper does not give is not
in the table (the experiment files say so in their comments). The papers:

* TDPFed: Wang et al., "Tensor Decomposition based Personalized Federated Learning";
* pFedSOP: Sen & Mohan, "pFedSOP: Accelerating Training Of Personalized Federated Learning
  Using Second-Order Optimization" (arXiv:2506.07159);
* pFedNet: Zhao, Liu, Liu & He, "Medical Federated Model with Mixture of Personalized and
  Sharing Components" (the Luna16 / BraTS2017 / tabular experiments, CER).

An experiment's settings for one algorithm (or one partition) live in
conf/experiment_algorithm/<experiment>/<algorithm>.yaml (conf/experiment_partition/...),
which conf/config.yaml's defaults list pulls in by the run's choices; the command line still
wins over them. Composition only: nothing is trained here.
"""

from __future__ import annotations

import math
import shlex
from typing import Any

import pytest
from omegaconf import OmegaConf

from helpers import CONF
from helpers import compose_config

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))

#: (value, where the paper states it)
Value = tuple[Any, str]

# --- TDPFed, §VII-A (both data sets); §VII-D: the baselines use "the same settings" -------

TDPFED_MNIST: dict[str, Value] = {
    "dataset._target_": ("fedexp.data.images.mnist", "TDPFed §VII-A (MNIST)"),
    "model._target_": ("fedexp.models.vision.dnn", "TDPFed §VII-A (DNN 784x100, 100x10)"),
    "model.hidden": (100, "TDPFed §VII-A (784x100, 100x10)"),
    "num_clients": (20, "TDPFed §VII-A (20 clients)"),
    "participation": (1.0, "TDPFed §VII-A (all 20 selected every round)"),
    "partition._target_": ("fedexp.data.partitions.shards", "TDPFed §VII-A (non-IID)"),
    "partition.classes_per_client": (2, "TDPFed §VII-A (two types of samples a client)"),
    "batch_size": (20, "TDPFed §VII-A (|B| = 20)"),
    "rounds": (800, "TDPFed §VII-A (T = 800)"),
    "local_steps": (23, "TDPFed §VII-A (τ = 23)"),
}
TDPFED_CIFAR10: dict[str, Value] = {
    "dataset._target_": ("fedexp.data.images.cifar10", "TDPFed §VII-A (CIFAR-10)"),
    "model._target_": ("fedexp.models.vision.vgg8", "TDPFed §VII-A, Table I (VGG8)"),
    "model.channels": ([32, 64, 128, 256, 256], "TDPFed Table I (conv1-conv5)"),
    "model.hidden": (256, "TDPFed Table I (fc1, fc2 256x256)"),
    "num_clients": (10, "TDPFed §VII-A (10 clients)"),
    "participation": (1.0, "TDPFed §VII-A (all clients selected every round)"),
    "partition._target_": ("fedexp.data.partitions.shards", "TDPFed §VII-A (non-IID)"),
    "partition.classes_per_client": (2, "TDPFed §VII-A (two types of samples a client)"),
    "batch_size": (20, "TDPFed §VII-A (|B| = 20)"),
    "rounds": (800, "TDPFed §VII-A (T = 800)"),
    "local_steps": (25, "TDPFed §VII-A (τ = 25)"),
}

# --- pFedSOP, §V-A (data, partition), §V-B1 (models), §V-B4 (protocol), Table II (T) -------


def _pfedsop(dataset: str, model: str, model_section: str) -> dict[str, Value]:
    return {
        "dataset._target_": (f"fedexp.data.images.{dataset}", "pFedSOP §V-A"),
        "model._target_": (f"fedexp.models.vision.{model}", f"pFedSOP §V-B1 ({model_section})"),
        "num_clients": (100, "pFedSOP §V-A (K = 100)"),
        "test_fraction": (0.2, "pFedSOP §V-A (80 % train, 20 % test per client)"),
        "partition._target_": ("fedexp.data.partitions.dirichlet", "pFedSOP §V-A, Table II"),
        "partition.alpha": (0.07, "pFedSOP §V-A, Table II (Dir(0.07))"),
        # FedDWA's partition, which §V-A follows, caps a client at n/N samples
        "partition.balance": (True, "pFedSOP §V-A (Dir(0.07) as FedDWA's partition)"),
        "participation": (0.2, "pFedSOP §V-B4 (20 % of K = 100)"),
        "batch_size": (50, "pFedSOP §V-B4 (local batch size 50)"),
        "local_epochs": (1, "pFedSOP §V-B4 (one local epoch)"),
        "seed": (0, "pFedSOP §V-B4 (seed = 0)"),
        "rounds": (100, "pFedSOP Table II (T = 100)"),
    }


PFEDSOP_METHOD: dict[str, Value] = {
    "algorithm.rho": (1.0, "pFedSOP §V-B4 (ρ = 1)"),
    "algorithm.lam": (1.0, "pFedSOP §V-B4 (λ = 1)"),
}
#: Table II's methods (§V-B2); each one's lr (and FedProx's μ, Ditto's λ) was tuned on a grid
#: whose winners the paper does not list (§V-B4): only pFedSOP's own values are stated.
PFEDSOP_TABLE_II = (
    "fedavg",
    "fedprox",
    "fedavg_ft",
    "fedprox_ft",
    "ditto",
    "fedrep",
    "fedala",
    "feddwa",
)


def _table_ii(common: dict[str, Value]) -> dict[str, dict[str, Value]]:
    out = {method: dict(common) for method in PFEDSOP_TABLE_II}
    out["pfedsop"] = {**common, **PFEDSOP_METHOD}
    return out


# --- pFedNet, §VI-A (federated setting), §VI-B1/B2/C1 (λ) ---------------------------------

PFEDNET_SETTING: dict[str, Value] = {
    "num_clients": (5, "pFedNet §VI-A (5 clients, 1 server)"),
    "test_fraction": (0.2, "pFedNet §VI-A (80 % train, 20 % test)"),
}
#: The 13 baselines of Tables II-VII (§VI-A, "Methods and metrics").
PFEDNET_BASELINES = (
    "ditto",
    "fedamp",
    "fedavg",
    "l2gd",
    "fedper",
    "fedprox",
    "fedrod",
    "apfl",
    "fpfc",
    "ifca",
    "pfedme",
    "superfed",
    "fedrep",
)


def _pfednet(lam: Value | None, extra: dict[str, Value], baselines) -> dict[str, dict[str, Value]]:
    common = {**PFEDNET_SETTING, **extra}
    own = {**common, "algorithm.k": (3, "pFedNet §VI-A (KNN with k = 3)")}
    if lam is not None:
        own["algorithm.lam"] = lam
    return {"pfednet": own, **{method: dict(common) for method in baselines}}


LUNA16 = {
    "model._target_": ("fedexp.models.imaging.densenet", "pFedNet §VI-A, Table I (D-Net)"),
    "model.personal": (["class_layers.*"], "pFedNet §VI-A (the fully connected layer personal)"),
}
BRATS = {
    "model._target_": ("fedexp.models.imaging.unet", "pFedNet §VI-A, Table I (U-Net)"),
    "partition._target_": (
        "fedexp.data.partitions.missing_channel",
        "pFedNet §VI-A (channel unbalance, 'lack #c')",
    ),
}
TABULAR = {
    "model._target_": ("fedexp.models.tabular.logistic_regression", "pFedNet §VI-A (LR)"),
    "model.personal": (["linear.*"], "pFedNet §VI-A (all features personal)"),
    "partition._target_": (
        "fedexp.data.partitions.label_imbalance",
        "pFedNet §VI-A (label unbalance δ)",
    ),
}

#: experiment -> algorithm -> setting -> (the paper's value, where it says so)
PAPERS: dict[str, dict[str, dict[str, Value]]] = {
    "tdpfed_mnist": {
        "tdpfed": {
            **TDPFED_MNIST,
            # Table III is the headline; Table II's η = 0.0008 (§VII-A) is the header's command
            "lr": (3e-4, "TDPFed §VII-D, Table III (η = 3e-4; Table II: 0.0008, §VII-A)"),
            "algorithm.lam": (12.0, "TDPFed §VII-A (λ = 12)"),
            "algorithm.beta": (1.0, "TDPFed §VII-A (β = 1.0)"),
            "algorithm.personal_steps": (5, "TDPFed §VII-A (s = 5)"),
            "algorithm.factor_steps": (17, "TDPFed §VII-A (s' = 17)"),
            "algorithm.personal_lr": (0.08, "TDPFed §VII-A (η_p = 0.08)"),
            "algorithm.aggregation": ("afm", "TDPFed §VII-C (AFM in the following experiments)"),
        },
        "pfedme": {
            **TDPFED_MNIST,
            "lr": (0.05, "TDPFed §VII-D (pFedMe's local-model lr 0.05 on MNIST)"),
            "algorithm.lam": (12.0, "TDPFed §VII-D -> §VII-A (λ = 12)"),
            "algorithm.beta": (1.0, "TDPFed §VII-D -> §VII-A (β = 1.0)"),
            "algorithm.personal_steps": (5, "TDPFed §VII-D -> §VII-A (s = 5 personal steps)"),
            "algorithm.personal_lr": (0.08, "TDPFed §VII-D -> §VII-A (η_p = 0.08)"),
        },
        "fedavg": {**TDPFED_MNIST, "lr": (0.05, "TDPFed §VII-D (FedAvg lr 0.05 on MNIST)")},
    },
    "tdpfed_cifar10": {
        "tdpfed": {
            **TDPFED_CIFAR10,
            "lr": (4e-5, "TDPFed §VII-A and §VII-D, Tables II-III (η = 4e-5)"),
            "algorithm.lam": (14.0, "TDPFed §VII-A (λ = 14)"),
            "algorithm.beta": (1.0, "TDPFed §VII-A (β = 1.0)"),
            "algorithm.personal_steps": (4, "TDPFed §VII-A (s = 4)"),
            "algorithm.factor_steps": (15, "TDPFed §VII-A (s' = 15)"),
            "algorithm.personal_lr": (0.03, "TDPFed §VII-A (η_p = 0.03)"),
            "algorithm.aggregation": ("afm", "TDPFed §VII-C (AFM in the following experiments)"),
        },
        "pfedme": {
            **TDPFED_CIFAR10,
            "lr": (0.01, "TDPFed §VII-D (pFedMe's local-model lr 0.01 on CIFAR-10)"),
            "algorithm.lam": (14.0, "TDPFed §VII-D -> §VII-A (λ = 14)"),
            "algorithm.beta": (1.0, "TDPFed §VII-D -> §VII-A (β = 1.0)"),
            "algorithm.personal_steps": (4, "TDPFed §VII-D -> §VII-A (s = 4 personal steps)"),
            "algorithm.personal_lr": (0.03, "TDPFed §VII-D -> §VII-A (η_p = 0.03)"),
        },
        "fedavg": {**TDPFED_CIFAR10, "lr": (0.01, "TDPFed §VII-D (FedAvg lr 0.01 on CIFAR-10)")},
    },
    "pfedsop_cifar10": _table_ii(_pfedsop("cifar10", "resnet18", "ResNet-18 for CIFAR-10")),
    "pfedsop_cifar100": _table_ii(_pfedsop("cifar100", "resnet9", "ResNet-9 for CIFAR-100")),
    "pfedsop_tiny_imagenet": _table_ii(
        _pfedsop("tiny_imagenet", "resnet9", "ResNet-9 for Tiny ImageNet")
    ),
    "pfedsop_ablation": {
        "pfedsop": {
            **_pfedsop("cifar100", "resnet9", "ResNet-9 for CIFAR-100"),
            "lr": (0.01, "pFedSOP §V-C3 (η = 0.01 for Tables III-IV)"),
            "algorithm.rho": (1.0, "pFedSOP §V-C3 (ρ = 1 while λ varies)"),
            "algorithm.lam": (1.0, "pFedSOP §V-C3 (λ = 1 while ρ varies)"),
            "algorithm.personal_correction": (True, "pFedSOP §V-C2, Table III (with PC)"),
        },
    },
    "pfednet_luna16": _pfednet(
        (0.01, "pFedNet §VI-B1 (λ = 0.01 is a good choice)"), LUNA16, PFEDNET_BASELINES
    ),
    "pfednet_brats": _pfednet(
        (1.0, "pFedNet §VI-B2 (λ = 1.0 seems to be a good choice)"), BRATS, PFEDNET_BASELINES
    ),
    "pfednet_tables": _pfednet(
        (0.1, "pFedNet §VI-C1 (λ = 0.1 is recommended)"),
        TABULAR,
        (*PFEDNET_BASELINES, "fedbn", "local"),  # fedexp's extra rows: the setting, no more
    ),
    "pfednet_lambda": _pfednet(
        (0.1, "pFedNet §VI-C1 (λ = 0.1 is recommended; Figure 12 varies it)"), TABULAR, ()
    ),
    # Figure 8 (§VI-B1): the paper does not give the λ of its CER runs
    "cer_stc": _pfednet(None, {}, ("fedavg",)),
    # the baselines users compare against, each at its own paper's hyper-parameters (the
    # experiment's data and schedule are fedexp's: no paper ran this comparison)
    "baselines": {
        "fedavg": {},
        "fedprox": {"algorithm.mu": (0.01, "FedProx §5 (μ from {0.001, 0.01, 0.1, 1})")},
        "scaffold": {"algorithm.server_lr": (1.0, "SCAFFOLD §7 (η_g = 1)")},
        "feddyn": {"algorithm.alpha": (0.01, "FedDyn §5 (α from {0.1, 0.01, 0.001})")},
        "fednova": {},
        "moon": {
            "algorithm.mu": (1.0, "MOON §4.1 (μ = 1; CIFAR-10: 5)"),
            "algorithm.tau": (0.5, "MOON §4.1 (τ = 0.5)"),
        },
        "perfedavg": {"algorithm.variant": ("fo", "Per-FedAvg §5 (FO)")},
        "perfedavg_hf": {"algorithm.variant": ("hf", "Per-FedAvg §5 (HF)")},
        "fedbabu": {"algorithm.finetune_epochs": (5.0, "FedBABU §4 (τ_f = 5 fine-tuning epochs)")},
        "ditto": {},
        "local": {},
    },
}

#: The pathological partition of pFedSOP's Table II (§V-A): shards of z samples, b classes a client.
PATHOLOGICAL: dict[str, Value] = {
    "pfedsop_cifar10": (2, "pFedSOP §V-A (z = 200, b = 2 for CIFAR-10)"),
    "pfedsop_cifar100": (6, "pFedSOP §V-A (z = 600, b = 6 for CIFAR-100)"),
    "pfedsop_tiny_imagenet": (10, "pFedSOP §V-A (z = 1000, b = 10 for Tiny ImageNet)"),
}


def _same(actual: Any, expected: Any) -> bool:
    if isinstance(expected, bool) or isinstance(actual, bool):
        return actual is expected
    if isinstance(expected, float) and isinstance(actual, int | float):
        return math.isclose(actual, expected, rel_tol=1e-9)
    return actual == expected


def _differences(cfg, table: dict[str, Value]) -> list[str]:
    """``key: composed X, the paper Y (where)`` for each table entry the config does not give."""
    out = []
    for key, (expected, source) in table.items():
        actual = OmegaConf.select(cfg, key, default="<absent>")
        if OmegaConf.is_config(actual):
            actual = OmegaConf.to_container(actual)
        if not _same(actual, expected):
            out.append(f"{key}: composed {actual!r}, the paper {expected!r} ({source})")
    return out


def _experiment_yaml(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF / "experiment" / f"{name}.yaml"))


def used_algorithms(name: str) -> set[str]:
    """The algorithms experiment ``name`` runs: its sweep's, its header commands', and the one
    it composes to without ``algorithm=`` (its own override, else conf/config.yaml's)."""
    data = _experiment_yaml(name)
    used = set()
    sweep = (((data.get("hydra") or {}).get("sweeper") or {}).get("params") or {}).get("algorithm")
    if sweep:
        used |= {a.strip() for a in str(sweep).split(",")}
    for line in (CONF / "experiment" / f"{name}.yaml").read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("# ")
        if text.startswith("fedexp run "):
            for word in shlex.split(text):
                if word.startswith("algorithm="):
                    used |= set(word.removeprefix("algorithm=").split(","))
    own = {k: v for d in data.get("defaults", []) if isinstance(d, dict) for k, v in d.items()}
    if "override /algorithm" in own:
        used.add(own["override /algorithm"])
    else:
        primary = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))
        used |= {
            d["algorithm"] for d in primary["defaults"] if isinstance(d, dict) and "algorithm" in d
        }
    return used


def test_the_table_covers_every_experiment_and_the_algorithms_it_runs():
    assert sorted(PAPERS) == EXPERIMENTS
    for name in EXPERIMENTS:
        missing = used_algorithms(name) - set(PAPERS[name])
        assert not missing, f"{name} runs {sorted(missing)}: add them to PAPERS"
        options = {p.stem for p in (CONF / "algorithm").glob("*.yaml")}
        assert set(PAPERS[name]) <= options, name


@pytest.mark.parametrize(
    ("experiment", "algorithm"),
    [(name, algorithm) for name, methods in PAPERS.items() for algorithm in methods],
)
def test_experiment_gives_the_papers_settings(experiment, algorithm):
    cfg = compose_config(f"+experiment={experiment}", f"algorithm={algorithm}")
    wrong = _differences(cfg, PAPERS[experiment][algorithm])
    assert not wrong, f"+experiment={experiment} algorithm={algorithm}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("experiment", sorted(PATHOLOGICAL))
def test_pfedsop_pathological_partition(experiment):
    cfg = compose_config(f"+experiment={experiment}", "partition=shards")
    table = {
        "partition._target_": ("fedexp.data.partitions.shards", "pFedSOP §V-A (pathological)"),
        "partition.classes_per_client": PATHOLOGICAL[experiment],
    }
    assert not _differences(cfg, table), _differences(cfg, table)


def test_the_command_line_wins_over_the_experiments_values():
    cfg = compose_config(
        "+experiment=tdpfed_mnist", "algorithm=tdpfed", "lr=0.0008", "algorithm.lam=10"
    )
    assert cfg.lr == 0.0008 and cfg.algorithm.lam == 10  # Table II's η; any λ
    cfg = compose_config("+experiment=pfedsop_cifar10", "partition.alpha=0.5")
    assert cfg.partition.alpha == 0.5 and cfg.partition.balance is True


def test_without_an_experiment_nothing_is_specialised():
    cfg = compose_config("algorithm=tdpfed")
    default = OmegaConf.load(CONF / "config.yaml")
    assert cfg.lr == default.lr and cfg.algorithm.lam == OmegaConf.load(
        CONF / "algorithm" / "tdpfed.yaml"
    ).get("lam")


@pytest.mark.parametrize("group", ["algorithm", "partition"])
def test_every_specialisation_file_names_an_experiment_and_an_option(group):
    """conf/experiment_<group>/<experiment>/<option>.yaml: a misspelt folder or file would be
    skipped without a word (the defaults entry is ``optional``)."""
    root = CONF / f"experiment_{group}"
    options = {p.stem for p in (CONF / group).glob("*.yaml")}
    for path in sorted(root.rglob("*.yaml")):
        relative = path.relative_to(root)
        assert len(relative.parts) == 2, f"{relative}: expected <experiment>/<option>.yaml"
        assert relative.parts[0] in EXPERIMENTS, f"{relative}: no conf/experiment/ of that name"
        assert path.stem in options, f"{relative}: no conf/{group}/{path.name}"
        assert path.read_text().startswith("# @package _global_"), relative


def _keys(node: Any, prefix: str = "") -> set[str]:
    if not isinstance(node, dict):
        return {prefix}
    return {k for key, value in node.items() for k in _keys(value, f"{prefix}{key}.")}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_an_experiment_and_its_specialisations_set_different_keys(experiment):
    """The experiment file is merged after its per-algorithm and per-partition files (it is
    appended to the defaults list by ``+experiment``), so a key set in both would silently
    take the experiment file's value: each key belongs to one of them."""
    body = _experiment_yaml(experiment)
    own = _keys({k: v for k, v in body.items() if k not in ("defaults", "hydra")})
    for group in ("algorithm", "partition"):
        for path in sorted((CONF / f"experiment_{group}" / experiment).glob("*.yaml")):
            both = own & _keys(OmegaConf.to_container(OmegaConf.load(path)))
            assert not both, f"{experiment}.yaml and {path.relative_to(CONF)} both set {both}"
