"""``fedaval train --config FILE.toml``: a run's settings in one reviewable
file, and ``--seeds``: the same settings over several seeds.

The file format (TOML, read with :mod:`tomllib`)::

    # every key is a `fedaval train` option, spelt as on the command line
    # without the dashes (rounds-per-task or rounds_per_task)
    plugins = ["gldp"]              # or "gldp" or "gldp,fedrep"
    scenario = "sthfl"
    dataset = "cifar10"
    model = "resnet18"
    rounds-per-task = 50
    seeds = [42, 1999, 2024]       # or "42,1999,2024"

    # plugin and scenario options: one table per owner, the keys of -o
    [options.gldp]
    lam = 0.5
    [options.sthfl]
    clients = 20
    imbalance = 50

    # optional: the paper's numbers for this setting (configs/repro-*.toml,
    # docs/reproduction.md); not a run option, ignored by `fedaval train`
    [paper]
    source = "GLDP, Table 2"

Values given on the command line win over the file: a whole option for
plain options (``--lr``), one key at a time for ``-o`` (``-o gldp.lam=0.3``
replaces ``lam`` and keeps the file's other ``gldp`` keys). An unknown key is
a one-line error naming the key and the allowed ones.

In the CLI the file's plain options become click's ``default_map`` (so
click applies its types and lets the command line win), and its
``[options.*]`` tables are kept in ``ctx.meta`` for :func:`merge_options`.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fedaval.errors import FedavalUsageError

#: Where the file's ``[options.*]`` tables wait for the train command.
META_KEY = "fedaval.config_file.options"


def _flag(name: str) -> str:
    return name.replace("_", "-")


def read_config_file(path: str | Path, allowed: Iterable[str]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Parse ``path``; return ``(values, options)``.

    ``values`` maps option names (underscores, as click's parameter names)
    to the file's values; ``plugins`` becomes a list and ``seeds`` a
    comma-separated string, as the command line gives them. ``options`` is
    ``{owner: {key: value}}`` from the ``[options.<owner>]`` tables.
    ``allowed`` are the accepted names (besides ``options``)."""
    path = Path(path)
    allowed = set(allowed) - {"options"}
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise FedavalUsageError(f"--config {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FedavalUsageError(f"--config {str(path)!r} cannot be read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise FedavalUsageError(f"--config {str(path)!r} is not valid TOML: {exc}") from None

    values: dict[str, Any] = {}
    options: dict[str, dict[str, Any]] = {}
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        if key == "options":
            options = _read_options(path, value)
            continue
        if key == "paper":  # the paper's numbers: read by read_paper_table, not a run option
            continue
        if key not in allowed:
            names = ", ".join(sorted(_flag(a) for a in allowed | {"options"}))
            raise FedavalUsageError(f"unknown key {raw_key!r} in {str(path)!r}; allowed: {names}")
        if key in values:
            raise FedavalUsageError(f"key {raw_key!r} is given twice in {str(path)!r} (as - and _ spellings)")
        if isinstance(value, dict):
            raise FedavalUsageError(f"key {raw_key!r} in {str(path)!r} must be a value, not a table")
        if key == "plugins":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise FedavalUsageError(f"key 'plugins' in {str(path)!r} must be a name or a list of names")
        elif key == "seeds":
            value = ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
        values[key] = value
    if "seed" in values and "seeds" in values:
        raise FedavalUsageError(f"{str(path)!r} sets both 'seed' and 'seeds'; keep one")
    return values, options


def read_paper_table(path: str | Path) -> dict[str, Any]:
    """The ``[paper]`` table of a config file (``{}`` when it has none): the
    paper's source, metric, numbers per row (``[paper.<metric>]``) and the
    arguments that turn the file's run into each row (``[paper.runs]``)."""
    with open(path, "rb") as fh:
        return dict(tomllib.load(fh).get("paper") or {})


def full_scale_runs(paper: dict[str, Any]) -> dict[str, str]:
    """Each ``[paper.runs]`` row's arguments at the paper's scale (what
    ``benchmarks/gpu_session.sh --full-scale`` runs): the row's
    ``[paper.full-scale.runs]`` entry where it has one, else its
    ``[paper.runs]`` entry, then ``[paper.full-scale]``'s ``args``."""
    scale = paper.get("full-scale") or {}
    changed, extra = scale.get("runs") or {}, scale.get("args", "")
    return {
        name: " ".join(f"{changed.get(name, args)} {extra}".split()) for name, args in (paper.get("runs") or {}).items()
    }


def _read_options(path: Path, value: Any) -> dict[str, dict[str, Any]]:
    """``[options.gldp] lam = 0.5`` -> ``{"gldp": {"lam": 0.5}}``."""
    hint = "write plugin/scenario options as tables, e.g. [options.gldp] then lam = 0.5"
    if not isinstance(value, dict):
        raise FedavalUsageError(f"'options' in {str(path)!r} must be tables; {hint}")
    out: dict[str, dict[str, Any]] = {}
    for owner, table in value.items():
        if not isinstance(table, dict):
            raise FedavalUsageError(f"'options.{owner}' in {str(path)!r} must be a table; {hint}")
        for key, item in table.items():
            if isinstance(item, dict):
                raise FedavalUsageError(f"'options.{owner}.{key}' in {str(path)!r} must be a value, not a table")
        out[owner] = dict(table)
    return out


def merge_options(
    file_options: dict[str, dict[str, Any]], cli_options: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The file's plugin/scenario options, with each key the command line
    sets replaced by the command line's value."""
    merged = {owner: dict(values) for owner, values in file_options.items()}
    for owner, values in cli_options.items():
        merged.setdefault(owner, {}).update(values)
    return merged


def tables_for_replaced(
    file_options: dict[str, dict[str, Any]], file_names: Iterable[str], cli_names: Iterable[str]
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Drop the file's option tables for owners the command line replaced.

    ``-p fedavg`` on a file with ``plugins = ["fedprok"]`` and an
    ``[options.fedprok]`` table runs FedAvg: the ``fedprok`` table belongs
    to a plugin the command line took out, so it is not used (a
    reproduction config's rows run this way, docs/reproduction.md).
    Likewise for the file's scenario when ``--scenario`` names another.
    Returns ``(kept tables, dropped owner names)``; the caller says which
    were dropped. A table for an owner that is in neither list is kept, so
    a misspelt owner still gets the usual one-line error."""
    replaced = set(file_names) - set(cli_names)
    kept = {owner: values for owner, values in file_options.items() if owner not in replaced}
    return kept, sorted(set(file_options) & replaced)


def load_into_context(ctx, param, value):
    """Click callback of the eager ``--config`` option: check the file's keys
    against the command's options and convert each value with the option's
    click type (a bad one is a one-line error), then hand the values to
    click as ``default_map`` so the command line wins."""
    if value is None:
        return None
    import click

    params = {p.name: p for p in ctx.command.params if p.name and p.name != param.name}
    values, options = read_config_file(value, params)
    for key, raw in values.items():
        wanted = _toml_type_problem(params[key], raw)
        if wanted:
            raise FedavalUsageError(f"bad value for {_flag(key)!r} in {str(value)!r}: {raw!r} is not {wanted}")
        try:
            params[key].type_cast_value(ctx, raw)
        except click.BadParameter as exc:
            raise FedavalUsageError(f"bad value for {_flag(key)!r} in {str(value)!r}: {exc.message}") from None
    ctx.default_map = {**(ctx.default_map or {}), **values}
    ctx.meta[META_KEY] = options
    return value


def _toml_type_problem(param, raw: Any) -> str | None:
    """What a TOML value of the wrong kind for ``param`` should have been
    (``None`` when it fits): click would truncate ``1.5`` to an integer option's
    1 and fail on an integer for a flag; text is left to click, as the command
    line gives it."""
    import click

    if isinstance(raw, str):
        return None
    if param.is_flag or isinstance(param.type, click.types.BoolParamType):
        return None if isinstance(raw, bool) else "true or false"
    if isinstance(param.type, click.types.IntParamType):
        return None if isinstance(raw, int) and not isinstance(raw, bool) else "an integer"
    if isinstance(param.type, click.types.FloatParamType):
        return None if isinstance(raw, (int, float)) and not isinstance(raw, bool) else "a number"
    return "text" if isinstance(raw, bool) else None


def file_options(ctx) -> dict[str, dict[str, Any]]:
    """The ``[options.*]`` tables of the ``--config`` file, if any."""
    return ctx.meta.get(META_KEY, {})


# ------------------------------------------------------------------ seeds


def parse_seeds(text: str) -> list[int]:
    """``"42,1999,2024"`` -> ``[42, 1999, 2024]``; duplicates are an error
    (two runs would want the same folder)."""
    seeds = []
    for item in str(text).split(","):
        item = item.strip()
        try:
            seeds.append(int(item))
        except ValueError:
            raise FedavalUsageError(
                f"bad value --seeds {text!r}; expected comma-separated integers, e.g. 42,1999,2024"
            ) from None
    for seed in seeds:
        if not 0 <= seed < 2**32:
            raise FedavalUsageError(f"bad value --seeds {text!r}: seed {seed} must be in [0, 2**32 - 1]")
    if len(set(seeds)) != len(seeds):
        raise FedavalUsageError(f"bad value --seeds {text!r}; a seed is repeated")
    return seeds


def settings_per_seed(
    settings: dict[str, Any], seeds: str | None, seed_from_cli: bool = False, seeds_from_cli: bool = False
) -> list[dict[str, Any]]:
    """The runs ``fedaval train`` makes: ``[settings]`` without ``seeds``,
    else one copy per seed. With an ``out`` folder OUT the copies go to
    sibling folders ``OUT-s<seed>``; without one each gets the default folder
    (which already names the seed). ``--seed`` on the command line overrides
    ``seeds`` from a file; both on the command line is an error."""
    if seeds is None:
        return [settings]
    if seed_from_cli and seeds_from_cli:
        raise FedavalUsageError("give --seed or --seeds, not both")
    if seed_from_cli:
        return [settings]
    out = settings.get("out")
    runs = []
    for seed in parse_seeds(seeds):
        copy = {**settings, "seed": seed}
        if out:
            copy["out"] = f"{str(out).rstrip('/')}-s{seed}"
        runs.append(copy)
    return runs
