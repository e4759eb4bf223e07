"""Typed, validated options for plugins and scenarios.

A plugin declares ``Options`` as a dataclass; users set fields with
``-o name.key=value``. Unknown keys and values that do not parse are errors
that name the value and what is allowed (llm's ``Options`` with
``extra="forbid"``, without the pydantic dependency).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal, get_args, get_origin

from fedaval.errors import FedavalUsageError

UNIONS = (typing.Union, types.UnionType)  # Optional[X] and X | None

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + "|".join(str(a) for a in get_args(tp))
    if get_origin(tp) in (list, tuple):
        return f"comma-separated {_type_name(get_args(tp)[0])}s"
    if get_origin(tp) in UNIONS and {a for a in get_args(tp) if a is not type(None)} == {int, float}:
        return "a finite number" + (" or none" if type(None) in get_args(tp) else "")
    if get_origin(tp) in UNIONS:
        return " or ".join(_type_name(a) for a in get_args(tp) if a is not type(None))
    if tp is float:
        return "a finite number"
    return getattr(tp, "__name__", str(tp))


def coerce(tp: Any, raw: Any) -> Any:
    """Convert ``raw`` (a string from the command line, or an already typed
    value) to type ``tp``. Raises ``ValueError`` when it does not fit."""
    origin = get_origin(tp)
    if origin in UNIONS:
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) < len(get_args(tp)) and (raw is None or (isinstance(raw, str) and raw.lower() in ("none", ""))):
            return None  # an Optional; `none` is no value of int | float
        for arg in args:
            try:
                return coerce(arg, raw)
            except ValueError:
                continue
        raise ValueError(raw)
    if origin is Literal:
        for choice in get_args(tp):
            if str(choice) == str(raw):
                return choice
        raise ValueError(raw)
    if origin in (list, tuple):
        (inner,) = get_args(tp)[:1]
        items = raw.split(",") if isinstance(raw, str) else list(raw)
        return [coerce(inner, item.strip() if isinstance(item, str) else item) for item in items]
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in _TRUE:
            return True
        if str(raw).lower() in _FALSE:
            return False
        raise ValueError(raw)
    if tp is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError(raw)
        return int(raw) if not isinstance(raw, str) else int(raw.strip())
    if tp is float:
        value = float(raw)
        if not math.isfinite(value):  # NaN and infinities: no option means anything by them
            raise ValueError(raw)
        return value
    if tp is str:
        return str(raw)
    raise ValueError(raw)


def build_options(options_cls: type, values: dict[str, Any], owner: str) -> Any:
    """Instantiate dataclass ``options_cls`` from ``values`` (strings allowed).

    ``owner`` names the plugin or scenario in error messages. Each field may
    carry ``metadata={"check": fn, "help": text}``; ``fn(value)`` returns an
    error text (what is allowed) or ``None``.
    """
    fields = {f.name: f for f in dataclasses.fields(options_cls)}
    hints = typing.get_type_hints(options_cls)
    kwargs = {}
    for key, raw in values.items():
        if key not in fields:
            allowed = ", ".join(sorted(fields)) or "(this one takes no options)"
            raise FedavalUsageError(f"unknown option {owner}.{key}; allowed: {allowed}")
        try:
            kwargs[key] = coerce(hints[key], raw)
        except (ValueError, TypeError):
            raise FedavalUsageError(f"bad value {owner}.{key}={raw!r}; expected {_type_name(hints[key])}") from None
    instance = options_cls(**kwargs)
    for name, field in fields.items():
        check = field.metadata.get("check")
        if check is None:
            continue
        problem = check(getattr(instance, name))
        if problem:
            raise FedavalUsageError(f"bad value {owner}.{name}={getattr(instance, name)!r}; {problem}")
    return instance


def describe_options(options_cls: type | None) -> list[tuple[str, str, str, str]]:
    """(name, type, default, help) for each field, for ``fedaval plugins``."""
    if options_cls is None:
        return []
    hints = typing.get_type_hints(options_cls)
    rows = []
    for field in dataclasses.fields(options_cls):
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = field.default_factory()  # type: ignore[misc]
        else:
            default = "(required)"
        kind = _type_name(hints[field.name])
        allowed = CHECK_TEXT.get(field.metadata.get("check"))
        rows.append(
            (field.name, f"{kind}, {allowed}" if allowed else kind, repr(default), field.metadata.get("help", ""))
        )
    return rows


# Small, reusable checks for field metadata.
def positive(value: float) -> str | None:
    return None if value > 0 else "must be > 0"


def non_negative(value: float) -> str | None:
    return None if value >= 0 else "must be >= 0"


def at_least_one(value: int) -> str | None:
    return None if value >= 1 else "must be >= 1"


def unit_interval(value: float) -> str | None:
    return None if 0 <= value <= 1 else "must be in [0, 1]"


#: what each of the checks above allows, shown by ``fedaval plugins`` beside an option's type
CHECK_TEXT: dict[Any, str] = {positive: "> 0", non_negative: ">= 0", at_least_one: ">= 1", unit_interval: "in [0, 1]"}


def changed(options: Any, names: Sequence[str]) -> list[str]:
    """Those of ``names`` whose value in ``options`` (an options dataclass)
    differs from the dataclass's default: the options a user set, for a
    plugin that refuses ones its other settings leave without effect."""
    defaults = type(options)()
    return [name for name in names if getattr(options, name) != getattr(defaults, name)]


def refuse_unread(owner: str, options: Any, rules: Sequence[tuple[Sequence[str], bool, str]]) -> None:
    """A one-line error for an option set away from its default
    (:func:`changed`) where the plugin's other settings leave it unread:
    each rule is ``(names, unread, setting)``, ``setting`` the one that
    leaves ``names`` unread (``"rebalance=false"``)."""
    for names, unread, setting in rules:
        for name in changed(options, names) if unread else []:
            raise FedavalUsageError(
                f"{owner}.{name} is not read with {owner}.{setting}; drop it or change {owner}.{setting.split('=')[0]}"
            )


def option(default: Any, help: str, check=None) -> Any:
    """A dataclass field with help text and an optional check."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": help, "check": check})
    return dataclasses.field(default=default, metadata={"help": help, "check": check})
