"""The checks the config dataclasses and public entry points share.

Each raises ValueError naming the parameter, what it must be and what was given,
with the setting's meaning when the bounds alone do not say how to fix it
(``hbm_rows for user must be an int >= 0 (0 = no such tier), got -1``). A bool is
refused where an int is meant: ``True`` passes ``isinstance(x, int)`` but is never
a row count."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Mapping
from typing import Any, TypeVar

import numpy as np

from tierstore.errors import SettingError

C = TypeVar("C")


def _said(meaning: str) -> str:
    return f" ({meaning})" if meaning else ""


def is_int(value: Any) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(value: Any, name: str, at_least: int = 0, at_most: int | None = None, meaning: str = "",
              none: bool = False) -> int | None:
    """``value`` as an int within ``[at_least, at_most]`` (None passes when ``none``)."""
    if value is None and none:
        return None
    if not is_int(value) or value < at_least or (at_most is not None and value > at_most):
        bounds = f">= {at_least}" if at_most is None else f"in [{at_least}, {at_most}]"
        raise SettingError(f"{name} must be an int {bounds}{' or None' if none else ''}{_said(meaning)}, got {value!r}")
    return int(value)


def check_number(value: Any, name: str, at_least: float = 0.0, above: bool = False, meaning: str = "",
                 none: bool = False, finite: bool = True, at_most: float | None = None) -> float | None:
    """``value`` as a float ``>= at_least`` (``> at_least`` when ``above``) and ``<= at_most``
    where given; infinity passes only where ``finite=False`` (a threshold that is never
    reached), NaN never."""
    if value is None and none:
        return None
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if (not ok or math.isnan(value) or (finite and math.isinf(value)) or value < at_least or (above and value == at_least)
            or (at_most is not None and value > at_most)):
        raise SettingError(f"{name} must be a {'finite ' if finite else ''}number {'>' if above else '>='} {at_least:g}"
                         f"{f' and <= {at_most:g}' if at_most is not None else ''}"
                         f"{' or None' if none else ''}{_said(meaning)}, got {value!r}")
    return float(value)


def check_choice(value: Any, name: str, choices: Collection[Any], meaning: str = "") -> Any:
    if value not in choices:
        raise SettingError(f"{name} must be one of {', '.join(map(repr, choices))}{_said(meaning)}, got {value!r}")
    return value


def check_rows(value: Any, name: str, meaning: str = "0 = no such tier") -> None:
    """A tier size: an int for every table or a {table: int} mapping, each >= 0 (None passes:
    left out)."""
    if value is None:
        return
    items = value.items() if isinstance(value, Mapping) else [("every table", value)]
    for table, rows in items:
        check_int(rows, f"{name} for {table}", meaning=meaning)


def with_keywords(config: C, keywords: C, passed: Iterable[str], owner: str) -> C:
    """``config`` once each setting in ``passed`` (given as a keyword too, the same setting
    in ``keywords``, a config built from the keywords) agrees with it: a call takes its
    settings whole as ``config=`` or one by one, and a setting given both ways must not differ."""
    for name in passed:
        mine, theirs = getattr(keywords, name), getattr(config, name)
        if mine != theirs:
            raise SettingError(f"{owner}: {name}={mine!r} contradicts config.{name}={theirs!r}; give each setting once: "
                             f"in the config (dataclasses.replace(config, {name}=...)) or as a keyword without config=")
    return config


def set_fields(config: Any, values: Mapping[str, Any]) -> list[str]:
    """The config fields among ``values`` that differ from the config class's defaults:
    the keywords a caller set."""
    defaults = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}
    defaults.update({f.name: f.default_factory() for f in dataclasses.fields(config)
                     if f.default_factory is not dataclasses.MISSING})
    return [name for name, value in values.items() if name in defaults and value != defaults[name]]
