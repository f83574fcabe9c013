"""How a sweep and its runs are named: the varying keys, short value-first names, colours.

See :mod:`fedexp.sweep` for the whole sweep.
"""

from __future__ import annotations

import colorsys
import math
import shlex
import shutil
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: fedexp's config groups: a folder of ``conf/`` (their options name a run by value alone).
_CONF = Path(__file__).resolve().parents[2] / "conf"
#: How keys are written in run names (``partition.delta=2`` is ``δ=2``; a seed is ``s2``).
SHORT_KEYS = {
    "seed": "s",
    "partition.delta": "δ",
    "partition.alpha": "α",
    "algorithm.mu": "μ",
    "algorithm.lam": "λ",
    "num_clients": "N",
}
#: Settings that do not change what a run computes: left out of a single run's name.
_UNNAMED = (
    "tracker",
    "progress",
    "device",
    "threads",
    "checkpoint_every",
    "divergence_factor",
    "resume",
    "resume_unsealed",
    "output_dir",
    "figures",
)
#: The longest value shown in a run name (longer ones end in ``…``; paths show their name).
_VALUE_CHARS = 14
#: The longest single run name.
RUN_NAME_CHARS = 40


def slurm_missing(launcher: str) -> bool:
    """Whether ``launcher`` (a launcher option or ``_target_``) is SLURM and sbatch is absent."""
    return "slurm" in launcher.lower() and shutil.which("sbatch") is None


def _key(item: str) -> str:
    """The key of a ``key=value`` override, without Hydra's ``+``/``++``/``~`` prefixes."""
    return item.split("=", 1)[0].lstrip("+~").split("@", 1)[0]


def varying_keys(task: Iterable[str], sweeper_params: Mapping[str, Any] | None = None) -> list[str]:
    """The keys that take more than one value across a sweep, in the order they are given.

    Args:
        task: the sweep's command-line overrides in sweep form (``hydra.overrides.task`` as
            ``on_multirun_start`` sees it: ``algorithm=fedavg,ditto``, ``seed=range(3)``).
        sweeper_params: ``hydra.sweeper.params`` (``{key: "a,b"}``; the Optuna sweeper's
            ``interval(...)``, ``choice(...)``, ``range(...)`` vary too). A key also given on
            the command line takes the command line's value (as Hydra's sweepers do).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    given = [f"{k}={v}" for k, v in (sweeper_params or {}).items()]
    varies: dict[str, bool] = {}
    for override in parser.parse_overrides([*given, *task]):
        if override.is_hydra_override():
            continue
        key = override.key_or_group
        if override.is_discrete_sweep():
            many = len(set(override.sweep_string_iterator())) > 1
        else:
            many = override.is_sweep_override()  # an interval: Optuna draws from it
        varies.pop(key, None)  # the later (command-line) value wins, and sets the order
        varies[key] = many
    return [k for k, many in varies.items() if many]


def sweep_values(
    task: Iterable[str], sweeper_params: Mapping[str, Any] | None = None
) -> dict[str, list[str] | None]:
    """Each key's values across a sweep (None where they cannot be listed: an interval).

    Same arguments as :func:`varying_keys`; values as Hydra writes them in the jobs'
    overrides (``1e38`` is ``1e+38``). A key given once has a list of one value.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    given = [f"{k}={v}" for k, v in (sweeper_params or {}).items()]
    values: dict[str, list[str] | None] = {}
    for override in parser.parse_overrides([*given, *task]):
        if override.is_hydra_override():
            continue
        key = override.key_or_group
        values.pop(key, None)
        if override.is_discrete_sweep():
            try:
                values[key] = list(dict.fromkeys(override.sweep_string_iterator()))
            except Exception:  # noqa: BLE001 - glob() needs Hydra's config loader
                values[key] = None
        elif override.is_sweep_override():
            values[key] = None
        else:
            values[key] = [str(override.get_value_element_as_str())]
    return values


def sweep_size(values: Mapping[str, list[str] | None]) -> int | None:
    """The number of jobs of a grid sweep with these values (None: not a grid)."""
    if any(v is None for v in values.values()):
        return None
    return math.prod(len(v) for v in values.values() if v)


def _is_group(key: str) -> bool:
    """Whether ``key`` is a config group of fedexp (``algorithm``, ``partition``, ...)."""
    return "." not in key and "/" not in key and (_CONF / key).is_dir()


def _short_value(value: str) -> str:
    """A value as a run name shows it: unquoted, a path by its last part, at most 14 chars."""
    value = value.strip().strip("'\"").replace("\\", "")
    if "/" in value.rstrip("/"):
        value = value.rstrip("/").rsplit("/", 1)[-1]
    return value if len(value) <= _VALUE_CHARS else value[: _VALUE_CHARS - 1] + "…"


def short_name(items: Iterable[tuple[str, str]]) -> str:
    """A short run name of ``(key, value)`` pairs: value first, the algorithm first.

    A config group is its option alone (``local``, ``dirichlet``), a seed ``s1``, the keys of
    :data:`SHORT_KEYS` their symbol (``δ=2``, ``N=20``), another key the last part of its
    name (``lr=0.1``, ``gamma=2``; the whole name where two keys would read alike). The
    algorithm comes first, the seed last, the others in the order given:
    ``[("seed", "1"), ("algorithm", "local"), ("partition.delta", "2")]`` is ``local δ=2 s1``.
    """
    items = [(k.lstrip("+~"), v) for k, v in items]
    tails = [k.rsplit(".", 1)[-1] for k, _ in items]

    def token(key: str, value: str) -> str:
        value = _short_value(value)
        if _is_group(key):
            return value
        if key == "seed":
            return f"s{value}"
        tail = key.rsplit(".", 1)[-1]
        label = SHORT_KEYS.get(key) or (tail if tails.count(tail) == 1 else key)
        return f"{label}={value}"

    ordered = sorted(items, key=lambda kv: (kv[0] != "algorithm", kv[0] == "seed"))
    return " ".join(token(k, v) for k, v in ordered)


def _items(overrides: Iterable[str]) -> dict[str, str]:
    """``{key: value}`` of ``key=value`` overrides (deletions ``~key`` left out)."""
    return {_key(o): o.split("=", 1)[1] for o in overrides if "=" in o and not o.startswith("~")}


def child_name(job_overrides: Iterable[str], varying: Iterable[str]) -> str:
    """A job's run name: its values of the varying keys, short and value first.

    ``["seed=2", "algorithm=local", "partition.delta=2", "rounds=5"]`` with ``varying =
    ["algorithm", "partition.delta", "seed"]`` gives ``"local δ=2 s2"`` (:func:`short_name`);
    ``""`` when nothing varies.
    """
    given = _items(job_overrides)
    return short_name((k, given[k]) for k in varying if k in given)


def run_name(overrides: Iterable[str], algorithm: str) -> str | None:
    """A single run's name: its algorithm, then what its command line changes.

    ``["partition=dirichlet", "num_clients=20"]`` with the default algorithm gives
    ``fedavg dirichlet N=20`` (:func:`short_name`; at most :data:`RUN_NAME_CHARS`
    characters). Settings that change no result (``tracker.*``, ``progress``, ``device``, the
    checkpoint interval, ``hydra.*``, ...) are left out; None when nothing else is left (the
    default run keeps its long name).
    """
    items = [
        (k, v)
        for k, v in _items(overrides).items()
        if k != "algorithm" and not k.startswith("hydra") and k.split(".")[0] not in _UNNAMED
    ]
    if not items:
        return None
    name = short_name([("algorithm", algorithm), *items])
    return name if len(name) <= RUN_NAME_CHARS else name[: RUN_NAME_CHARS - 1] + "…"


def run_color(
    job_overrides: Iterable[str],
    varying: Iterable[str],
    values: Mapping[str, list[str] | None],
) -> str:
    """A job's colour in MLflow's charts (``mlflow.runColor``): a hue per configuration.

    The configurations (the varying keys other than the seed) share the colour wheel evenly;
    the seeds of one configuration are shades of its hue. A value the sweep did not list
    (Optuna's draws) gets a hue from its hash.
    """
    given = _items(job_overrides)
    index, count = 0, 1
    for key in varying:
        if key == "seed":
            continue
        listed = values.get(key) or []
        value = given.get(key, "")
        if value in listed:
            i, n = listed.index(value), len(listed)
        else:
            i, n = zlib.crc32(value.encode()) % 12, 12
        index, count = index * n + i, count * n
    seeds = values.get("seed") or []
    seed = given.get("seed")
    shade = seeds.index(seed) / (len(seeds) - 1) if seed in seeds and len(seeds) > 1 else 0.5
    hue = index / count if count > 1 else 0.6
    red, green, blue = colorsys.hls_to_rgb(hue, 0.33 + 0.3 * shade, 0.75)
    return "#" + "".join(f"{round(255 * c):02x}" for c in (red, green, blue))


def group_keys(varying: Iterable[str], groups: Iterable[str]) -> list[dict[str, str]]:
    """MLflow's "Group by" of a sweep: every varying key but the seed.

    A config group by its ``choice.<group>`` tag (every fedexp run has it), any other key by
    its param (the resolved config): ``[{"mode": "tag", "groupByData": "choice.algorithm"},
    {"mode": "param", "groupByData": "partition.delta"}]``.
    """
    group_set = set(groups)
    return [
        {"mode": "tag", "groupByData": f"choice.{k}"}
        if k in group_set
        else {"mode": "param", "groupByData": k}
        for k in varying
        if k != "seed"
    ]


def experiment_name(varying: Iterable[str], when: str) -> str:
    """The MLflow experiment of an ad-hoc sweep: ``fedexp/<varying keys> <date time>``."""
    return f"fedexp/{','.join(varying) or 'sweep'} {when}"


def report_command(
    experiment: str,
    uri: str | None,
    varying: Iterable[str],
    groups: Iterable[str],
    metric: str | None = None,
    tuning: bool = False,
) -> str:
    """The ``fedexp report`` command that tabulates a sweep.

    A tuning sweep (Hydra's Optuna sweeper, ``hparams_search``) gets one row per method and
    ``--select-by val/<headline>/mean``: each method's best configuration on the validation
    split, reported on test (``docs/tuning.md``).

    Rows: ``choice.algorithm`` (the method) when the algorithm varies or nothing else does,
    else the first varying key; columns: the other varying keys; the seed is what cells
    average over. A config group's key is its ``choice.<group>`` tag, another key its param.

    Args:
        experiment: the sweep's MLflow experiment.
        uri: ``tracker.uri`` when given (None: MLflow's default store, which report uses too).
        varying: the sweep's varying keys (:func:`varying_keys`).
        groups: the config groups (``hydra.runtime.choices``' keys).
        metric: the headline metric when it is not report's default ``acc/mean``.
        tuning: the sweep is a hyper-parameter search (the tuned keys are not columns).
    """
    group_set = set(groups)
    if tuning:
        command = ["fedexp", "report"] + (["--uri", uri] if uri else [])
        command += ["--experiment", experiment, "--rows", "choice.algorithm"]
        if metric and metric != "acc/mean":
            command += ["--metric", metric]
        return shlex.join([*command, "--select-by", f"val/{metric or 'acc/mean'}"])
    keys = [f"choice.{k}" if k in group_set else k for k in varying if k != "seed"]
    if "choice.algorithm" in keys or not keys:
        rows = ["choice.algorithm"]
    else:
        rows = keys[:1]
    cols = [k for k in keys if k not in rows]
    command = ["fedexp", "report"]
    if uri:
        command += ["--uri", uri]
    command += ["--experiment", experiment, "--rows", *rows]
    if cols:
        command += ["--cols", *cols]
    if metric and metric != "acc/mean":
        command += ["--metric", metric]
    return shlex.join(command)
