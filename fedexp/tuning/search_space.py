"""The Optuna sweeper's search space checked before Hydra composes anything.

A search space that hydra-optuna-sweeper would refuse with a traceback (``lr='tag(log,
interval(0, 1))'``, ``interval(1, 0.1)``, ``hydra.sweeper.direction=sideways``, ...) or
silently ignore (``tag(logarithmic, ...)``) is caught by :func:`search_space_errors`, which
the CLI runs on its command line: one line per mistake, naming the key, the value and what was
expected (docs/tuning.md). The sweeps are parsed with Hydra's own override grammar; the checks
follow the plugin's conversion of a sweep to an Optuna distribution (tested against it).

Imports neither Optuna nor torch: the check costs milliseconds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: fedexp's config folder, whose ``hparams_search`` and ``experiment`` files are read.
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

#: Optuna's two directions. fedexp's objective is one number, so a sweep takes one.
DIRECTIONS = ("minimize", "maximize")

#: The one tag hydra-optuna-sweeper reads: ``tag(log, interval(low, high))``.
LOG_TAG = "log"

#: Optuna's samplers seed numpy's RandomState, which takes 0 ... 2**32 - 1.
SEED_MAX = 2**32 - 1

#: The sweeper settings checked (``hydra.sweeper.<key>``), besides ``params``.
_SETTINGS = ("direction", "n_trials", "n_jobs", "max_failure_rate", "sampler.seed")

#: Hydra's flags that print or inspect instead of running: nothing to check then.
_NO_RUN_FLAGS = frozenset(
    {"-c", "--cfg", "-i", "--info", "-sc", "--shell-completion", "--hydra-help", "--version"}
    | {"-h", "--help"}
)

#: Hydra's flags that take the next word as their value.
_VALUE_FLAGS = frozenset(
    {"-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "-p", "--package"}
    | {"--experimental-rerun"}
)

#: The config groups that choose the sweeper, its sampler or a file with sweeper settings.
_GROUPS = ("hparams_search", "experiment", "hydra/sweeper", "hydra/sweeper/sampler")


class _Given:
    """A sweeper setting as given: its value, its text and where (a file; "": command line)."""

    def __init__(self, value: Any, where: str = "", text: str | None = None) -> None:
        self.value = value
        self.where = where
        self.text = _text(value) if text is None else text

    def name(self, key: str) -> str:
        """``key=text``, and the file it comes from: how an error line names the setting."""
        return f"{key}={self.text}" + (f" (in {self.where})" if self.where else "")


def search_space_errors(args: Sequence[str], conf_dir: str | Path | None = None) -> list[str]:
    """Mistakes in an Optuna search space or sweeper settings: one line each, before Hydra.

    ``fedexp run`` calls this on its command line. It acts only where the Optuna sweeper would
    run: a multirun (``-m``, or ``hydra.mode=MULTIRUN``) whose sweeper is ``optuna``, chosen by
    ``hydra/sweeper=optuna`` on the command line or by the defaults of an ``hparams_search=NAME``
    or ``+experiment=NAME`` file (``override /hydra/sweeper: optuna``; the command line wins).
    It looks at what would reach the sweeper, as hydra-optuna-sweeper 1.3 merges it:

    * ``hydra.sweeper.params`` of the hparams_search file, then of the experiment file, then of
      the command line (``hydra.sweeper.params.lr='interval(0.01, 1)'``), later keys winning;
    * every other command-line override (the sweeper parses them all after ``params``:
      ``lr='tag(log, interval(0, 1))'``, ``rounds=range(1, 5)``, ``algorithm=fedavg``);
    * ``hydra.sweeper.direction``, ``n_trials``, ``n_jobs``, ``max_failure_rate`` and
      ``sampler.seed`` from the same files and the command line.

    A value is parsed by Hydra's own override parser, as the sweeper parses it, and refused
    where the sweeper's conversion to an Optuna distribution, ``optuna.create_study`` or the
    sampler would stop the sweep with a traceback (``interval(1, 0.1)``, a log scale from 0,
    ``range(5, 1)``, ``glob()``, ``direction=sideways``, ``n_jobs=0``, ``seed=-1``, ...), and
    where the sweeper would take it but do what was not asked: a bound that is nan or inf (each
    trial's draw fails), a tag other than ``log`` or ``log`` on ``choice``/``range`` (ignored),
    several directions (fedexp's objective is one number: every trial would fail).

    Cheap: Hydra's parser and the config files; no Optuna, torch or MLflow import.

    Args:
        args: the words after ``fedexp run``: Hydra's flags and overrides.
        conf_dir: the config folder (default: fedexp's ``conf/``).

    Returns:
        One line per mistake, ``key=value: what was expected`` (a file's setting names its
        file); empty where the Optuna sweeper would not run or nothing is wrong.
    """
    words = _override_words(args)
    if words is None:
        return []
    overrides, multirun = words
    keys = {w.lstrip("+~").partition("=")[0] for w in overrides}
    if not multirun and not keys & {"hydra.mode", *_GROUPS}:
        return []  # a single run: no sweeper runs (and nothing below is imported)

    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = [(word, *_parse(parser, word)) for word in overrides]
    chosen: dict[str, Any] = {}
    for _, override, _ in parsed:
        if override is not None and override.key_or_group in _GROUPS and not override.package:
            chosen[override.key_or_group] = None if override.is_delete() else override.value()

    files = _sweeper_files(Path(conf_dir) if conf_dir is not None else CONF_DIR, chosen)
    sweeper, sampler, mode = "basic", "tpe", None
    for _, doc in files:
        defaults = _defaults(doc)
        sweeper = defaults.get("hydra/sweeper", sweeper)
        sampler = defaults.get("hydra/sweeper/sampler", sampler)
        mode = _section(doc, "hydra").get("mode", mode)
    sweeper = chosen.get("hydra/sweeper", sweeper)
    sampler = chosen.get("hydra/sweeper/sampler", sampler)
    for _, override, _ in parsed:
        if override is not None and override.key_or_group == "hydra.mode":
            mode = override.value()
    if sweeper != "optuna" or not (multirun or str(mode).upper() == "MULTIRUN"):
        return []

    settings, params = _sweeper_settings(files, parsed)
    errors = []
    for name, given in params.items():  # the sweeper's params first, then the command line
        override, reason = _parse(parser, f"{name}={given.text}")
        if override is not None:
            reason = _sweep_error(override.value(), sampler) or ""
        if reason:
            reason = reason.removeprefix(_EVALUATING)
            errors.append(f"{given.name(f'hydra.sweeper.params.{name}')}: {reason}")
    for word, override, reason in parsed:
        if override is None:  # Hydra refuses it too; its evaluation errors are search spaces
            key = word.lstrip("+~").partition("=")[0]
            if not key.startswith("hydra") and reason.startswith(_EVALUATING):
                errors.append(f"{word}: {reason.removeprefix(_EVALUATING)}")
            continue
        if override.is_hydra_override() or override.is_delete():
            continue
        reason = _sweep_error(override.value(), sampler)
        if reason:
            errors.append(f"{word}: {reason}")
    return errors + _settings_errors(settings, sampler)


def _override_words(args: Sequence[str]) -> tuple[list[str], bool] | None:
    """The overrides among ``args`` and whether ``-m`` is there; None for ``--cfg`` & co."""
    overrides: list[str] = []
    multirun = skip = False
    for word in args:
        if skip:
            skip = False
            continue
        if not word.startswith("-"):  # overrides start with a key, + or ~ (lr=-1 is a value)
            overrides.append(word)
            continue
        flag = word.partition("=")[0]
        if flag in _NO_RUN_FLAGS:
            return None
        multirun = multirun or flag in ("-m", "--multirun")
        skip = flag in _VALUE_FLAGS and "=" not in word
    return overrides, multirun


#: How :func:`_parse` starts the reason of a sweep function's error (Hydra's evaluation).
_EVALUATING = "while evaluating: "


def _parse(parser: Any, word: str) -> tuple[Any, str]:
    """Hydra's parse of one override: ``(Override, "")`` or ``(None, why it does not parse)``."""
    try:
        return parser.parse_override(word), ""
    except Exception as exc:  # noqa: BLE001 - Hydra's HydraException, or its parser's own
        message = " ".join(str(exc).split())
        found = re.match(r"\w+ while evaluating '.*?': (.*)", message)
        if found is None:
            return None, message
        reason = found.group(1)
        mismatch = re.match(r"mismatch type argument (\w+): (\w+) is incompatible", reason)
        if mismatch:
            function = re.search(r"while evaluating '(\w+)\(", message)
            what = f"{function.group(1)}()'s " if function else ""
            got = {"str": "a string"}.get(mismatch.group(2), mismatch.group(2))
            reason = f"{what}{mismatch.group(1)} must be a number (int or float), got {got}"
        elif reason.startswith("empty choice"):
            reason = "choice() is empty (expected at least one option)"
        elif " Available: " in reason:  # an unknown function: Hydra lists the known ones
            reason = reason.replace(" Available: ", " (available: ").rstrip() + ")"
        return None, f"{_EVALUATING}{reason}"


def _sweeper_files(conf: Path, chosen: Mapping[str, Any]) -> list[tuple[str, dict]]:
    """The hparams_search and experiment files of the command line, in Hydra's merge order.

    An experiment file may choose the hparams_search (``override /hparams_search: NAME``);
    the command line's choice wins. A choice that is not one name (a sweep over options,
    ``null``) or a file that is missing or unreadable is left out (Hydra says so itself).
    """
    experiment = _load(conf, "experiment", chosen.get("experiment"))
    search = chosen.get("hparams_search")
    if "hparams_search" not in chosen and experiment is not None:
        search = _defaults(experiment[1]).get("hparams_search")
    files = [_load(conf, "hparams_search", search), experiment]
    return [f for f in files if f is not None]


def _load(conf: Path, group: str, name: Any) -> tuple[str, dict] | None:
    """``conf/<group>/<name>.yaml`` as plain containers (interpolations left as text)."""
    if not isinstance(name, str) or not name:
        return None
    path = conf / group / f"{name}.yaml"
    try:
        from omegaconf import OmegaConf

        doc = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # noqa: BLE001 - missing or broken: Hydra reports it when it composes
        return None
    if not isinstance(doc, dict):
        return None
    return f"{conf.name}/{group}/{name}.yaml", doc


def _defaults(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A file's defaults list as ``{group: option}`` (``override /hydra/sweeper: optuna``)."""
    found: dict[str, Any] = {}
    defaults = doc.get("defaults")
    for item in defaults if isinstance(defaults, list) else []:
        if isinstance(item, Mapping):
            for key, option in item.items():
                group = str(key).removeprefix("override").strip().lstrip("/")
                found[group] = option
    return found


def _section(doc: Any, key: str) -> Mapping[str, Any]:
    """``doc[key]`` where it is a mapping, else an empty one."""
    value = doc.get(key) if isinstance(doc, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def _sweeper_settings(
    files: list[tuple[str, dict]], parsed: list[tuple[str, Any, str]]
) -> tuple[dict[str, _Given], dict[str, _Given]]:
    """``hydra.sweeper``'s checked settings and its ``params``: the files, then the command line."""
    settings: dict[str, _Given] = {}
    params: dict[str, _Given] = {}
    for where, doc in files:
        sweeper = _section(_section(doc, "hydra"), "sweeper")
        for key in _SETTINGS:
            head, _, tail = key.partition(".")
            section = _section(sweeper, head) if tail else sweeper
            if (tail or head) in section:
                settings[key] = _Given(section[tail or head], where)
        if "params" in sweeper:
            if not isinstance(sweeper["params"], Mapping):
                params.clear()  # params: null
            for name, value in _section(sweeper, "params").items():
                params[str(name)] = _Given(value, where)
    for word, override, _ in parsed:
        if override is None or not override.key_or_group.startswith("hydra.sweeper."):
            continue
        key = override.key_or_group.removeprefix("hydra.sweeper.")
        if override.is_delete():
            settings.pop(key, None)
            if key == "params":
                params.clear()
            else:
                params.pop(key.removeprefix("params."), None)
        elif override.is_sweep_override():
            continue  # Hydra refuses to sweep its own settings, in one line
        elif key in _SETTINGS:
            settings[key] = _Given(override.value(), text=word.partition("=")[2])
        elif key == "params":
            value = override.value()
            params = {str(k): _Given(v) for k, v in (value or {}).items()}
        elif key.startswith("params."):
            params[key.removeprefix("params.")] = _Given(override.value())
    return settings, params


def _text(value: Any) -> str:
    """A setting's value as one would write it in an override (``[maximize, sideways]``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def _finite(*values: Any) -> bool:
    return all(isinstance(v, int | float) and math.isfinite(v) for v in values)


def _sweep_error(value: Any, sampler: str) -> str | None:
    """Why the Optuna sweeper cannot search ``value`` (a parsed override's value), or None.

    Mirrors ``create_optuna_distribution_from_override`` of hydra-optuna-sweeper 1.3: a choice
    is a categorical distribution; ``range(start, stop, step)`` an int or discrete uniform one
    from start to stop *inclusive* (a shuffled range: the categorical of Hydra's range, which
    stops before stop); ``interval(low, high)`` a uniform one, int where both bounds are, on a
    log scale with ``tag(log, ...)``; anything else (``glob``) is refused.
    """
    from hydra.core.override_parser.types import ChoiceSweep
    from hydra.core.override_parser.types import Glob
    from hydra.core.override_parser.types import IntervalSweep
    from hydra.core.override_parser.types import RangeSweep

    if isinstance(value, Glob):
        return "the Optuna sweeper cannot search glob() (expected choice(), range() or interval())"
    if not isinstance(value, ChoiceSweep | RangeSweep | IntervalSweep):
        return None  # one value: a fixed parameter
    unknown = sorted(str(t) for t in value.tags if t != LOG_TAG)
    if unknown:
        return (
            f"unknown tag {', '.join(unknown)} (the Optuna sweeper reads one tag: log, as in "
            "tag(log, interval(low, high)))"
        )
    log_scale = LOG_TAG in value.tags
    if isinstance(value, IntervalSweep):
        return _interval_error(value.start, value.end, log_scale, sampler)
    if log_scale:
        kind = "range()" if isinstance(value, RangeSweep) else "choice()"
        return (
            f"the Optuna sweeper reads tag(log, ...) on interval() only, not on {kind} "
            "(expected tag(log, interval(low, high)))"
        )
    if isinstance(value, RangeSweep):
        return _range_error(value.start, value.stop, value.step, value.shuffle)
    if not value.list:
        return "choice() is empty (expected at least one option)"
    return None


def _interval_error(low: Any, high: Any, log_scale: bool, sampler: str) -> str | None:
    """Why ``[tag(log,)] interval(low, high)`` is no Optuna distribution, or None."""
    if not _finite(low, high):
        return f"interval() needs finite bounds (got low={low}, high={high})"
    if low > high:
        return f"interval() needs low ≤ high (got low={low} > high={high})"
    integers = isinstance(low, int) and isinstance(high, int)
    if log_scale and integers and low < 1:
        return f"a log-scale int interval needs a lower bound ≥ 1 (got {low})"
    if log_scale and not integers and low <= 0:
        return f"a log-scale interval needs a lower bound > 0 (got {low})"
    if sampler == "grid" and (log_scale or not integers):
        return (
            "the grid sampler (hydra/sweeper/sampler=grid) takes choice(), range() or an int "
            "interval, not a continuous or log-scale interval"
        )
    return None


def _range_error(start: Any, stop: Any, step: Any, shuffle: bool) -> str | None:
    """Why ``[shuffle(]range(start, stop, step)[)]`` is no Optuna distribution, or None."""
    if not _finite(start, stop, step):
        return f"range() needs finite numbers (got start={start}, stop={stop}, step={step})"
    if step <= 0:
        return f"the Optuna sweeper needs range() with a step > 0 (got step={step})"
    if shuffle and start >= stop:
        return (
            f"shuffle(range()) is empty: Hydra's range stops before stop, so it needs "
            f"start < stop (got start={start}, stop={stop})"
        )
    if start > stop:
        return f"range() needs start ≤ stop (got start={start} > stop={stop})"
    return None


def _integer(value: Any) -> int | None:
    """``value`` as an int where OmegaConf would take it as one (an int, or its digits)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    return None


def _number(value: Any) -> float | None:
    """``value`` as a finite float where OmegaConf would take it as one, else None."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _direction_error(value: Any) -> str | None:
    """Why ``hydra.sweeper.direction`` is not one Optuna direction, or None."""
    expected = "expected minimize or maximize"
    if isinstance(value, str):
        return None if value in DIRECTIONS else expected
    if not isinstance(value, list | tuple):
        return expected
    if not value:
        return f"an empty list ({expected})"
    bad = [_text(v) for v in value if not (isinstance(v, str) and v in DIRECTIONS)]
    if bad:
        return f"{', '.join(bad)} is not a direction ({expected})"
    if len(value) > 1:
        return (
            f"{len(value)} directions, but fedexp's objective is one number, so every trial "
            f"would fail ({expected}, one of them)"
        )
    return None


def _settings_errors(settings: Mapping[str, _Given], sampler: str) -> list[str]:
    """The sweeper settings Optuna or the sweeper would refuse (or loop forever on)."""
    errors = []
    for key, given in settings.items():
        name = given.name(f"hydra.sweeper.{key}")
        value = given.value
        if key == "direction":
            reason = _direction_error(value)
        elif key in ("n_trials", "n_jobs"):
            ok = (_integer(value) or 0) >= 1
            reason = None if ok else "expected an integer ≥ 1"
        elif key == "max_failure_rate":
            rate = _number(value)
            ok = rate is not None and 0 <= rate <= 1
            reason = None if ok else "expected a number in [0, 1] (the share of failed trials)"
        elif sampler == "grid":  # sampler.seed: the grid sampler has none (Hydra says so)
            reason = None
        else:
            seed = _integer(value)
            ok = value is None or (seed is not None and 0 <= seed <= SEED_MAX)
            reason = None if ok else f"expected an integer in [0, {SEED_MAX}], or null"
        if reason:
            errors.append(f"{name}: {reason}")
    return errors
