"""The text of ``fedexp --help`` and ``fedexp run --help``, generated from the config itself.

Every run setting comes from :class:`fedexp.config.schema.RunConfig` (its fields, and one
line of meaning from its ``Attributes`` docstring), with its default as ``conf/config.yaml``
sets it; the config groups and their options are the folders and YAML files of ``conf/``.
Nothing heavy is imported (no torch, Hydra, OmegaConf or MLflow: tests/test_startup.py): the
schema module imports only the standard library, and ``conf/config.yaml`` is read with PyYAML.
"""

from __future__ import annotations

import inspect
import re
import shutil
import textwrap
from dataclasses import MISSING
from dataclasses import fields
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

from fedexp.config.schema import RunConfig

CONF = Path(__file__).resolve().parents[2] / "conf"

_INTRO = (
    "fedexp: federated-learning experiments (personalised FL, communication compression) "
    "from Hydra configs, tracked in MLflow."
)

#: ``fedexp`` commands: (command line, what it does).
_USAGE = [
    (
        "fedexp run [KEY=VALUE ...] [GROUP=OPTION ...]",
        "one run; results and tables on the terminal, everything in MLflow (tracker=mlflow)",
    ),
    (
        "fedexp run -m KEY=A,B [KEY=C,D ...]",
        "a sweep: one job per combination (a parent MLflow run, a child run per job), a "
        "summary at the end; exit code 1 if any job failed",
    ),
    (
        "fedexp report --experiment NAME [...]",
        "mean ± std tables over seeds from MLflow (fedexp report --help)",
    ),
    (
        "fedexp ui [--uri URI] [--port N] [--experiment NAME]",
        "MLflow's web UI on the runs' store (default: sqlite:///mlflow.db here) on 127.0.0.1, "
        "and the link that opens it; Ctrl-C stops it",
    ),
    ("fedexp --help, fedexp run --help", "this help"),
    ("fedexp run --hydra-help", "Hydra's own options (--cfg job, --info, ...)"),
]

_NOTE = (
    "hydra/launcher applies to sweeps (-m): parallel = joblib processes on this machine "
    "(hydra.launcher.n_jobs=2), slurm = one SLURM job per run (on the cluster's login node). "
    "MLflow: tracker.uri=URI (default sqlite:///mlflow.db in the working directory), "
    "tracker.experiment=NAME (default: fedexp; a sweep gets one of its own)."
)

#: Example command lines: (command line, what it does).
_EXAMPLES = [
    ("fedexp run", "FedAvg, logistic regression, breast cancer"),
    ("fedexp run algorithm=ditto algorithm.lam=0.1 rounds=20 seed=1", ""),
    ("fedexp run dataset=csv dataset.path=data/chd.csv dataset.label=TenYearCHD", ""),
    ("fedexp run --cfg job algorithm=fedprox", "print the composed config, run nothing"),
    ("fedexp run -m algorithm=fedavg,ditto seed=0,1,2 hydra/launcher=parallel", ""),
    ("fedexp run -m +experiment=pfednet_tables hydra/launcher=parallel", ""),
    ("fedexp report -e fedexp/pfednet_tables --rows choice.algorithm --cols partition.delta", ""),
    ("fedexp ui", "look at the runs in MLflow's web UI"),
]


def setting_docs(cls: type = RunConfig) -> dict[str, str]:
    """``{field: one line of meaning}`` from the ``Attributes`` section of ``cls``'s docstring.

    An entry is ``name: text`` indented one level under ``Attributes:``; deeper-indented lines
    continue it and are joined with single spaces.
    """
    doc = inspect.cleandoc(cls.__doc__ or "")
    section = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
    out: dict[str, str] = {}
    name = None
    for line in section.splitlines():
        entry = re.match(r"^ {4}(\w+): (.*)$", line)
        if entry:
            name = entry.group(1)
            out[name] = entry.group(2).strip()
        elif line.startswith("        ") and name is not None:
            out[name] += " " + line.strip()
        elif line.strip():
            name = None  # a new section
    return {k: v.replace("``", "") for k, v in out.items()}


def _yaml(value: Any) -> str:
    """A value as one writes it on the command line (null, true, 0.1, 10000)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _config_yaml() -> tuple[dict[str, Any], dict[str, str | None]]:
    """conf/config.yaml's top-level values, and its defaults list as ``{group: option}``."""
    import yaml

    data = yaml.safe_load((CONF / "config.yaml").read_text()) or {}
    groups: dict[str, str | None] = {}
    for item in data.get("defaults", []):
        if isinstance(item, dict):
            for key, option in item.items():
                key = str(key).removeprefix("optional ").strip()
                if not key.startswith("override "):
                    groups[key] = option
    values = {k: v for k, v in data.items() if k not in ("defaults", "hydra")}
    return values, groups


def run_settings() -> list[tuple[str, str, str]]:
    """``(name, default, meaning)`` of every RunConfig field, in the dataclass's order.

    The default is conf/config.yaml's value where it sets one, else the dataclass's; a config
    group's default is its option in the defaults list.
    """
    values, groups = _config_yaml()
    docs = setting_docs()
    rows = []
    for f in fields(RunConfig):
        nested = f.default_factory if is_dataclass(f.default_factory) else None
        if nested is not None:  # distributed.nproc, ...: a row per key of the nested settings
            sub, subdocs = values.get(f.name) or {}, setting_docs(nested)  # type: ignore[arg-type]
            for g in fields(nested):  # type: ignore[arg-type]
                default = sub.get(g.name, g.default)
                rows.append((f"{f.name}.{g.name}", _yaml(default), subdocs.get(g.name, "")))
        elif f.name in groups or f.default is MISSING:
            option = groups.get(f.name)
            meaning = f"config group: conf/{f.name}/*.yaml (options below)"
            rows.append((f.name, _yaml(option), meaning))
        else:
            default = values.get(f.name, f.default)
            rows.append((f.name, _yaml(default), docs.get(f.name, "")))
    return rows


def config_groups() -> list[tuple[str, list[str], str | None]]:
    """``(group as written on the command line, options, default)`` of every folder of conf/.

    Groups outside the defaults list are added with ``+`` (``+experiment=NAME``); Hydra's
    launchers are ``hydra/launcher``.
    """
    _, defaults = _config_yaml()
    out = []
    for folder in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name != "hydra"):
        options = sorted(p.stem for p in folder.glob("*.yaml"))
        if not options:
            continue
        shown = folder.name if folder.name in defaults else f"+{folder.name}"
        out.append((shown, options, defaults.get(folder.name)))
    launchers = sorted(p.stem for p in (CONF / "hydra" / "launcher").glob("*.yaml"))
    out.append(("hydra/launcher", launchers, None))
    return out


def _wrap(text: str, width: int, **kwargs: str) -> list[str]:
    """``textwrap.wrap`` that keeps hyphenated words and long tokens (paths, keys) whole."""
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False, **kwargs)


def _fill(text: str, width: int, **kwargs: str) -> str:
    return "\n".join(_wrap(text, width, **kwargs))


def _block(rows: list[tuple[str, str]], width: int = 100, left: int = 30) -> str:
    """Two columns: the left padded to ``left``, the right wrapped with a hanging indent."""
    lines = []
    for head, text in rows:
        if not text or len(head) + 2 >= left - 1:  # the head on its own line(s)
            lines += _wrap(head, width, initial_indent="  ", subsequent_indent="      ")
            lines += [" " * left + more for more in _wrap(text, width - left)]
            continue
        wrapped = _wrap(text, width - left) or [""]
        lines.append(f"  {head}".ljust(left) + wrapped[0])
        lines += [" " * left + more for more in wrapped[1:]]
    return "\n".join(lines)


def help_text(width: int | None = None) -> str:
    """The whole ``fedexp --help``, at most ``width`` columns (default: the terminal's, 60-100)."""
    if width is None:
        width = min(100, max(60, shutil.get_terminal_size((100, 24)).columns))
    settings = _block(
        [(f"{name}={default}", meaning) for name, default, meaning in run_settings()], width
    )
    groups = []
    for group, options, default in config_groups():
        marked = [f"{o}*" if o == default else o for o in options]
        groups.append((group, " ".join(marked)))
    return "\n".join(
        [
            _fill(_INTRO, width),
            "",
            "usage:",
            _block(_USAGE, width, left=50 if width >= 100 else 40),
            "",
            "run settings (KEY=VALUE; shown with the default):",
            settings,
            "",
            _fill(
                "config groups (GROUP=OPTION; * marks the default; an option's keys are set "
                "with GROUP.KEY=VALUE, e.g. algorithm.lam=0.1: see conf/GROUP/OPTION.yaml):",
                width,
            ),
            _block(groups, width, left=20),
            "",
            _fill(_NOTE, width, initial_indent="  ", subsequent_indent="  "),
            "",
            "examples:",
            _block(_EXAMPLES, width, left=50 if width >= 100 else 40),
            "",
        ]
    )
