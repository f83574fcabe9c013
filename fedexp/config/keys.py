"""Misspelt and foreign keys on the command line, named in one line before Hydra composes.

``fedexp run algorithm.lamda=0.1`` (or ``algorithm.mu=0.1`` with FedAvg, or ``roundz=3``)
would get Hydra's multi-line struct error and a ``HYDRA_FULL_ERROR`` hint. The keys of the
run are known from the files: the run settings are :class:`fedexp.config.schema.RunConfig`'s
fields, and a group key ``algorithm.x.y`` must exist in the option of the group that the
command line (or ``conf/config.yaml``'s defaults) chooses. :func:`unknown_key_errors` checks
every plain ``key=value`` override against them and names the closest valid keys, and the
options of the group that have the key.

Top-level ``+key=value`` (adds a key) and ``~key`` (removes one) are checked by
:func:`added_or_removed_errors`: a run setting or a chosen group cannot be removed (the run
failed later with a traceback), a key the run does not have cannot be added (it was ignored:
``+rouns=3`` ran 50 rounds). Left to Hydra: the nested ``+group.key`` and ``~group.key``,
``key@package``, ``hydra.*``, and the group keys of any command line with an experiment file
(``+experiment=NAME`` may choose other options or add keys).

:func:`dataset_path_errors` refuses a ``dataset.path`` that does not exist (given on the
command line or the chosen option's default), with the data set's own message, before Hydra
makes a run folder (the run failed after loading torch, leaving a stub folder behind).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Sequence
from dataclasses import fields
from dataclasses import is_dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from fedexp.config.schema import REMOVED
from fedexp.config.schema import RunConfig


@cache
def _load(path: Path) -> Any:
    with open(path, encoding="utf-8") as fh:
        return yaml.safe_load(fh) or {}


def _listed(conf: Path) -> dict[str, str | None]:
    """The groups of ``conf/config.yaml``'s defaults list and their options (None: null)."""
    listed: dict[str, str | None] = {}
    for item in _load(conf / "config.yaml").get("defaults", []):
        if isinstance(item, dict):
            for group, option in item.items():
                if (conf / str(group)).is_dir():
                    listed[str(group)] = option if isinstance(option, str) else None
    return listed


def _defaults(conf: Path) -> dict[str, str]:
    """The group options ``conf/config.yaml`` chooses (``{"algorithm": "fedavg", ...}``)."""
    return {group: option for group, option in _listed(conf).items() if option is not None}


def _nested_keys(name: str) -> list[str] | None:
    """The keys of a run setting that is itself a dataclass (``distributed``), else None."""
    for f in fields(RunConfig):
        if f.name == name and is_dataclass(f.default_factory):  # type: ignore[arg-type]
            return [g.name for g in fields(f.default_factory)]  # type: ignore[arg-type]
    return None


def _keys(node: Any) -> list[str]:
    return [str(k) for k in node] if isinstance(node, dict) else []


def _walk(node: Any, parts: Sequence[str]) -> tuple[bool, str, list[str]]:
    """Follow ``parts`` into a YAML node: (found, the prefix that exists, keys at the miss)."""
    done: list[str] = []
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False, ".".join(done), _keys(node)
        done.append(part)
    return True, ".".join(done), []


def _group_key_error(conf: Path, group: str, options: list[str], parts: list[str]) -> str | None:
    """The message for ``group.<parts>`` missing from one of the chosen ``options``, or None."""
    for option in options:
        path = conf / group / f"{option}.yaml"
        if not path.is_file():
            return None  # an unknown option: the group check names it
        doc = _load(path)
        if "defaults" in doc:
            return None  # composed from other files: left to Hydra
        found, prefix, keys = _walk(doc, parts)
        if found:
            continue
        key = ".".join([group, *parts])
        where = f"{group}.{prefix}" if prefix else group
        close = difflib.get_close_matches(parts[len(prefix.split(".")) if prefix else 0], keys, 3)
        said = f"{key}: {option} ({group}={option}) has no such key"
        if close:
            said += f"; did you mean {', '.join(f'{where}.{c}' for c in close)}?"
        shown = [k for k in keys if not k.startswith("_")]
        if shown:
            said += f" (keys of {where}: {', '.join(shown)})"
        if not prefix:
            others = [
                p.stem
                for p in sorted((conf / group).glob("*.yaml"))
                if p.stem != option and _walk(_load(p), parts)[0]
            ]
            if others:
                verb = "has" if len(others) == 1 else "have"
                said += f"; {group}={'|'.join(others[:6])} {verb} it"
        return said
    return None


def unknown_key_errors(args: Sequence[str], conf_dir: str | Path) -> list[str]:
    """One line per ``key=value`` override whose key the run's config does not have.

    Args:
        args: the command line after ``run``.
        conf_dir: fedexp's ``conf/`` folder.

    Returns:
        Messages such as ``"algorithm.lamda: ditto (algorithm=ditto) has no such key; did you
        mean algorithm.lam? (keys of algorithm: lam, ...)"``; empty when every key exists or
        the command line is left to Hydra (an experiment file).
    """
    conf = Path(conf_dir)
    words = [a for a in args if not a.startswith("-")]
    if any(w.lstrip("+~").split("=", 1)[0] == "experiment" for w in words):
        return []
    chosen = {g: [o] for g, o in _defaults(conf).items()}
    settings = {f.name for f in fields(RunConfig)}
    for word in words:
        key, sep, value = word.partition("=")
        if sep and key in chosen and value.strip():
            chosen[key] = [v.strip() for v in value.split(",") if v.strip() not in ("", "null")]
    errors = []
    for word in words:
        key, sep, _ = word.partition("=")
        if not sep or key.startswith(("+", "~", "hydra")) or "@" in key or "/" in key:
            continue
        group, _, rest = key.partition(".")
        if not rest:
            if key not in settings and key not in REMOVED and not (conf / key).is_dir():
                close = difflib.get_close_matches(key, sorted(settings | set(chosen)), 3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                errors.append(f"{key}: no such setting{hint} (fedexp run --help lists them)")
            continue
        if group not in chosen:
            nested = _nested_keys(group)
            if nested is not None and rest not in nested:
                close = difflib.get_close_matches(rest, nested, 3)
                hint = (
                    f"; did you mean {', '.join(f'{group}.{c}' for c in close)}?" if close else ""
                )
                errors.append(
                    f"{key}: no such setting{hint} (keys of {group}: {', '.join(nested)})"
                )
            elif nested is None and group in settings:
                errors.append(f"{key}: {group} is a plain setting, it has no keys")
            continue
        message = _group_key_error(conf, group, chosen[group], rest.split("."))
        if message:
            errors.append(message)
    return errors


def added_or_removed_errors(args: Sequence[str], conf_dir: str | Path) -> list[str]:
    """One line per top-level ``+key``, ``++key`` or ``~key`` override the run cannot take.

    - ``~rounds``, ``~algorithm``: every run needs its settings and the groups
      ``conf/config.yaml`` chooses (removed, the run failed with a traceback);
    - ``+rounds=3``, ``+algorithm=ditto``, ``+hparams_search=lr``: the setting or group is
      there already, ``key=value`` sets it (Hydra's errors were several lines);
      ``++algorithm=ditto``: Hydra cannot force-add a group;
    - ``+rouns=3``, ``++rouns=3``: no such setting (the run ignored it). An experiment file
      sets only existing settings, so this holds with ``+experiment=NAME`` too.

    ``+experiment=NAME`` (a group the defaults list does not name) is Hydra's to take.
    """
    conf = Path(conf_dir)
    listed = _listed(conf)  # (a group chosen as null too: hparams_search)
    chosen = _defaults(conf)
    settings = {f.name for f in fields(RunConfig)}
    errors = []
    for word in (a for a in args if a.startswith(("+", "~"))):
        key, _, value = word.lstrip("+~").partition("=")
        if not key or "." in key or "@" in key or "/" in key or key.startswith("hydra"):
            continue  # (nested keys, packages and Hydra's own: Hydra's to check)
        if key in REMOVED:
            continue  # (named with what to do instead: schema.override_errors)
        shown = f"{key}={value or '<value>'}"
        if word.startswith("~"):
            if key in chosen:
                options = sorted(p.stem for p in (conf / key).glob("*.yaml"))
                more = "|..." if len(options) > 8 else ""
                errors.append(
                    f"{word}: a run cannot do without its {key}; choose one instead "
                    f"({key}=<{'|'.join(options[:8])}{more}>)"
                )
            elif key in settings:
                errors.append(
                    f"{word}: a run setting cannot be removed; set it instead ({key}=<value>; "
                    "fedexp run --help lists the defaults)"
                )
        elif (conf / key).is_dir():
            if word.startswith("++"):
                added = "" if key in listed else "+"
                errors.append(f"{word}: ++ cannot add a config group; write {added}{shown}")
            elif key in listed:
                errors.append(f"{word}: {key} is chosen in the defaults already; write {shown}")
        elif key in settings:
            if not word.startswith("++"):
                errors.append(
                    f"{word}: {key} is already a setting; write {shown} (+ adds a key the "
                    "config does not have)"
                )
        else:
            close = difflib.get_close_matches(key, sorted(settings | set(chosen)), 3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            errors.append(f"{word}: no such setting{hint} (fedexp run --help lists them)")
    return errors


#: Launchers whose jobs run on this machine (``slurm``'s run on others, which see their own
#: paths): a data set's path is checked for these only.
_LOCAL_LAUNCHERS = ("basic", "joblib", "parallel", "stacked")


def _unquoted(value: str) -> str:
    value = value.strip()
    if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _missing_data(target: str, path: str) -> str:
    """The data set's own line for a ``path`` that does not exist (which command makes it).

    A loader's first step is to find its files (``fedexp/data/``): called with a path that
    does not exist it raises its :class:`~fedexp.errors.DataError` before reading anything.
    A loader that needs more than its path, or says nothing, gets the plain line.
    """
    from fedexp.errors import DataError

    plain = f"dataset.path={path!r}: {Path(path).expanduser()} not found (no such file or folder)"
    module, _, name = target.rpartition(".")
    if not module.startswith("fedexp.data."):
        return plain
    try:
        loader = getattr(importlib.import_module(module), name)
        required = [
            p.name
            for p in inspect.signature(loader).parameters.values()
            if p.default is inspect.Parameter.empty and p.name != "path"
        ]
        if not required:
            loader(path=path)
    except DataError as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - no message of its own: the plain line
        return plain
    return plain


def dataset_path_errors(args: Sequence[str], conf_dir: str | Path) -> list[str]:
    """``dataset.path=/nope``: the data set's one line, before Hydra makes a run folder.

    The path is the command line's ``dataset.path``, else the chosen dataset option's default
    (``prepared/brats`` for ``dataset=brats``); it is refused when it does not exist, unless
    the data set fetches it (``dataset.download=true``). Its contents are the loader's to
    check. Left alone: an experiment file (it may set the path), a sweep over datasets or
    paths, an interpolation, and a run on other machines (``hydra/launcher=slurm``,
    ``distributed.nodes``: the path is theirs to see).

    Args:
        args: the command line after ``run``.
        conf_dir: fedexp's ``conf/`` folder.

    Returns:
        One message (the loader's, e.g. ``dataset.path='/nope': /nope does not exist; the
        prepared BraTS arrays are made by ...``), or none.
    """
    conf = Path(conf_dir)
    option = _defaults(conf).get("dataset")
    given: dict[str, str] = {}
    for word in args:
        key, sep, value = word.partition("=")
        if not sep or word.startswith("-"):
            continue
        if key.lstrip("+~") in ("experiment", "distributed.nodes"):
            return []
        if key == "hydra/launcher" and value.strip() not in _LOCAL_LAUNCHERS:
            return []
        if key == "dataset":
            option = value.strip()
        elif key in ("dataset.path", "dataset.download"):
            given[key] = _unquoted(value)
    file = conf / "dataset" / f"{option}.yaml"
    if not option or not file.is_file():
        return []  # (a sweep over options, or no such option: the group check names it)
    doc = _load(file)
    path = given.get("dataset.path", doc.get("path"))
    download = given.get("dataset.download", doc.get("download", False))
    if "defaults" in doc or "path" not in doc or not isinstance(doc.get("_target_"), str):
        return []  # (composed from other files; no path: the unknown-key check names it)
    if not isinstance(path, str):
        return []
    if not path or path in ("???", "null") or any(c in path for c in ",$(") or path[0] == "[":
        return []  # (unset: the mandatory-value check; a sweep or an interpolation: Hydra's)
    if str(download).strip().lower() not in ("false", "0", "no", "none", "null"):
        return []  # (the data set fetches what is missing)
    if Path(path).expanduser().exists():
        return []
    return [_missing_data(doc["_target_"], path)]
