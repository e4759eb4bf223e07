"""Comparing runs the way papers do: a table over methods and settings,
mean and standard deviation over seeds, and figures.

``fedaval report RUN_DIR...`` calls :func:`write_report`. Everything is read
from each run folder's ``results.json`` (written by
:func:`fedaval.coordinator.train`; its ``final`` block is
:func:`fedaval.evaluation.summarise`).

Runs are grouped when their configurations differ only in ``seed`` (and in
where they ran: ``out``, ``device``, ``data_root``, ``download``); the report
lists the run folders of every row. A run that is not complete (results.json's
``status``, or for files written before it existed, fewer rounds than its
tasks times ``rounds_per_task``) is refused, or with ``include_incomplete``
reported with its rounds marked (``seeds`` shows ``3 (21/50 rounds)``); two
runs of one row with the same seed are refused. For each
group and metric the table shows the mean and the sample standard deviation
(``n - 1`` in the denominator, as ``statistics.stdev``; blank for one run).
A metric no run of a group recorded is blank; a column no group has is left
out (``A_glo``, ``A_loc`` and ``utility`` appear only for runs whose rounds
carry ``a_glo``, ``a_loc`` or ``utility``). Global-model columns (final
and average accuracy, forgetting, BWT, A_glo, utility) are blank for a
method whose federation model is its clients' models (PFCL); its figures are
``client acc`` (last evaluation) and ``avg client acc`` (mean over the
stages' ends). What each column is, with its source: docs/report.md.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedaval.errors import FedavalUsageError

#: Configuration keys that do not make a different experiment: where the
#: run went and how it was executed. The backends, offloading, data paths
#: and checkpoint schedules give identical results (tests/test_ray_backend.py,
#: test_offload.py, test_device_data.py, test_checkpoint.py); the device and
#: the GPU execution paths (CUDA graphs, streams, stacked clients,
#: torch.compile, channels-last, deterministic kernels) compute the same
#: maths, equal up to the last bits of float rounding (test_cuda_graphs.py,
#: test_client_streams.py, test_stacked.py, test_compile.py,
#: test_precision.py), as two GPUs are; the failure policy changes nothing
#: in a run no client failed in (``failed_clients`` says which did).
#: ``precision`` is a setting: bf16
#: rounds every activation to 8 bits of mantissa. Until session 36 the GPU
#: paths counted as settings, so ``--paper`` put no paper number beside the
#: full-scale runs (benchmarks/gpu_session.sh passes ``--cuda-graphs``).
NOT_A_SETTING = (
    "seed",
    "out",
    "device",
    "data_root",
    "download",
    "checkpoint_every",
    "keep_checkpoints",
    "checkpoint_writer",
    "backend",
    "ray_address",
    "client_gpus",
    "offload_clients",
    "data_path",
    "host_memory",
    "deterministic",
    "cuda_graphs",
    "cuda_graph_scope",
    "client_streams",
    "stack_clients",
    "compile",
    "channels_last",
    "on_client_failure",
)


@dataclass(frozen=True)
class Metric:
    """One column of the report: ``key`` (CSV name), ``title`` (Markdown
    header), how to read it from results.json, and how to show it."""

    key: str
    title: str
    read: Callable[[dict[str, Any]], float | None]
    kind: str  # "percent", "bytes" or "seconds"


def _final(name: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda results: _number((results.get("final") or {}).get(name))


def _last_round_value(name: str) -> Callable[[dict[str, Any]], float | None]:
    """``final[name]`` if the core summarises it, else the value in the last
    round that recorded it (evaluation rounds only carry evaluation keys)."""

    def read(results: dict[str, Any]) -> float | None:
        value = _number((results.get("final") or {}).get(name))
        if value is not None:
            return value
        for record in reversed(results.get("rounds") or []):
            value = _number(record.get(name))
            if value is not None:
                return value
        return None

    return read


def _per_round(name: str) -> Callable[[dict[str, Any]], float | None]:
    """Total of round key ``name`` divided by the number of rounds run."""

    def read(results: dict[str, Any]) -> float | None:
        rounds = results.get("rounds") or []
        values = [_number(r.get(name)) for r in rounds]
        numbers = [v for v in values if v is not None]
        if not rounds or len(numbers) < len(values):
            return None
        return sum(numbers) / len(rounds)

    return read


METRICS: tuple[Metric, ...] = (
    Metric("final_accuracy", "final acc", _final("accuracy"), "percent"),
    Metric("average_accuracy", "avg acc", _final("average_accuracy"), "percent"),
    Metric("forgetting", "forgetting", _final("forgetting"), "percent"),
    Metric("bwt", "BWT", _final("bwt"), "percent"),
    Metric("client_accuracy", "client acc", _final("mean_client_accuracy"), "percent"),
    Metric("average_client_accuracy", "avg client acc", _final("average_client_accuracy"), "percent"),
    Metric("a_glo", "A_glo", _final("a_glo"), "percent"),
    Metric("a_loc", "A_loc", _final("a_loc"), "percent"),
    Metric("a_sel", "A_sel", _last_round_value("a_sel"), "percent"),  # the final block has no a_sel
    Metric("utility", "utility", _final("utility"), "percent"),  # until session 35 the last round's U where missing
    Metric("efficiency", "E s/round", _final("efficiency"), "seconds"),
    Metric("bytes_up_per_round", "up/round", _per_round("bytes_up"), "bytes"),
    Metric("bytes_down_per_round", "down/round", _per_round("bytes_down"), "bytes"),
    Metric("seconds_per_round", "s/round", _per_round("seconds"), "seconds"),
)


def _number(value: Any) -> float | None:
    """A JSON number as a float; ``None`` for anything else (``null``: the
    metric does not apply; a damaged value is refused when the run is loaded,
    :func:`check_final`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if math.isnan(value) else float(value)


#: the ``final`` entries the report reads
FINAL_KEYS = (
    "accuracy",
    "average_accuracy",
    "forgetting",
    "bwt",
    "mean_client_accuracy",
    "average_client_accuracy",
    "a_glo",
    "a_loc",
    "a_sel",
    "utility",
    "efficiency",
)


def check_final(results_file: Path, results: dict[str, Any]) -> None:
    """A one-line error for a ``final`` entry the report reads that is
    neither a number nor ``null`` (a string, a boolean, NaN): until session
    35 such a run was silently left out of that column, or a numeric string
    taken as a number."""
    final = results.get("final")
    if final is None:
        return
    if not isinstance(final, dict):
        raise FedavalUsageError(f"{str(results_file)!r}: 'final' is a {type(final).__name__}, not an object")
    for key in FINAL_KEYS:
        value = final.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise FedavalUsageError(
                f"{str(results_file)!r}: final.{key} is {value!r}, not a number or null; "
                "the file is damaged: restore it, or rewrite it with fedaval train --resume RUN_DIR"
            )


# ---------------------------------------------------------------- loading runs


@dataclass
class RunResult:
    """One run folder: its path, a short unique ``name``, and results.json."""

    path: Path
    name: str
    results: dict[str, Any]

    @property
    def config(self) -> dict[str, Any]:
        return self.results.get("config") or {}

    @property
    def seed(self) -> Any:
        return self.config.get("seed")

    @property
    def status(self) -> dict[str, Any]:
        return run_status(self.results)

    @property
    def complete(self) -> bool:
        return self.status["state"] == "complete"

    @property
    def seed_label(self) -> str:
        """The seed, with the rounds done when the run is not complete."""
        status = self.status
        if self.complete:
            return str(self.seed)
        return f"{self.seed} ({status['rounds_done']}/{status['rounds_total']} rounds)"


def run_status(results: dict[str, Any]) -> dict[str, Any]:
    """results.json's ``status`` (``state``, ``rounds_done``, ``rounds_total``);
    for a file written before the status existed, worked out from its rounds:
    ``complete`` when it holds every round, else ``incomplete``."""
    status = results.get("status")
    if isinstance(status, dict) and "state" in status:
        return status
    done = len(results.get("rounds") or [])
    config = results.get("config") or {}
    tasks = (results.get("scenario") or {}).get("num_tasks")
    per_task = config.get("rounds_per_task")
    total = tasks * per_task if isinstance(tasks, int) and isinstance(per_task, int) else None
    state = "complete" if total is not None and done >= total else "incomplete"
    return {"state": state, "rounds_done": done, "rounds_total": total}


def load_run(path: str | Path) -> dict[str, Any]:
    """results.json of run folder ``path``; anything else is a one-line error."""
    path = Path(path)
    results_file = path / "results.json"
    if not path.is_dir():
        raise FedavalUsageError(f"{str(path)!r} is not a fedaval run folder (not a folder)")
    if not results_file.is_file():
        raise FedavalUsageError(f"{str(path)!r} is not a fedaval run folder (no results.json)")
    try:
        results = json.loads(results_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FedavalUsageError(f"{str(results_file)!r} is not readable JSON ({exc})") from None
    if not isinstance(results, dict) or not isinstance(results.get("config"), dict) or "rounds" not in results:
        raise FedavalUsageError(f"{str(results_file)!r} is not a fedaval results file (no config/rounds)")
    check_final(results_file, results)
    return results


def load_runs(paths: list[str | Path]) -> list[RunResult]:
    """Load every run; names are folder names, made unique by the parent's
    name where two folders share one."""
    if not paths:
        raise FedavalUsageError("no run folders given; usage: fedaval report RUN_DIR...")
    runs = [RunResult(Path(p), Path(p).resolve().name, load_run(p)) for p in paths]
    names = [r.name for r in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = f"{run.path.resolve().parent.name}-{run.name}"
    seen: dict[str, int] = {}
    for run in runs:  # still clashing (same path twice, say): number them
        seen[run.name] = seen.get(run.name, 0) + 1
        if seen[run.name] > 1:
            run.name = f"{run.name}-{seen[run.name]}"
    return runs


# ---------------------------------------------------------------- grouping


def setting_of(config: dict[str, Any], resolved: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The configuration that makes an experiment, in one canonical form:
    scenario options given either way (``scenario_options`` or
    ``-o <scenario>.key=``) are merged, and each option value is read as its
    option's type reads it, options at their default left out
    (:func:`_canonical_options`), so ``clients = 2`` in a config file equals
    ``-o fcil-sync.clients=2`` and ``-o fedprox.mu=1e-2`` equals no ``mu``
    at all; keys a run does not record take
    :class:`~fedaval.config.RunConfig`'s defaults. ``resolved``: the options
    as the run read them (results.json ``options``, since session 35), used
    where present: a run written before has only what was given, read with
    this version's defaults."""
    out = {**_defaults(), **config}
    out = {k: v for k, v in out.items() if k not in NOT_A_SETTING}
    options = {owner: dict(values) for owner, values in (config.get("plugin_options") or {}).items()}
    scenario = config.get("scenario")
    if config.get("scenario_options"):
        options.setdefault(scenario, {}).update(config["scenario_options"])
    for owner, values in (resolved or {}).items():
        options[owner] = {**options.get(owner, {}), **values}
    canonical = {owner: _canonical_options(owner, values) for owner, values in sorted(options.items())}
    out["plugin_options"] = {owner: values for owner, values in canonical.items() if values}
    out.pop("scenario_options", None)
    return out


def _canonical_options(owner: str, values: dict[str, Any]) -> dict[str, str]:
    """``owner``'s options as text, each value as its option type reads it
    and options at their default left out, so ``-o fedprox.mu=1e-2``,
    ``-o fedprox.mu=0.01`` and no ``mu`` at all are one setting; an owner
    this installation does not know (a third party's plugin not installed
    here), or values its options refuse, compare as given."""
    text = {k: _as_text(v) for k, v in sorted(values.items())}
    options_cls = _options_class(owner)
    if options_cls is None:
        return text
    try:
        from fedaval.options import build_options

        given, default = build_options(options_cls, dict(values), owner=owner), options_cls()
    except Exception:  # noqa: BLE001 - a value this version refuses: compare the text
        return text
    return {k: _as_text(getattr(given, k)) for k in text if getattr(given, k, None) != getattr(default, k, None)}


@functools.cache
def _options_class(owner: str) -> type | None:
    """The options dataclass of the installed plugin or built-in scenario
    ``owner`` (looked up once: every run and every paper row asks)."""
    from fedaval.plugin_manager import installed_plugins
    from fedaval.scenarios.registry import SCENARIOS

    if owner in SCENARIOS:
        return SCENARIOS[owner].Options
    entry = installed_plugins().get(owner)
    if entry is None:
        return None
    try:
        return getattr(entry.load(), "Options", None)
    except Exception:  # noqa: BLE001 - a plugin that does not import here: compare the text
        return None


def _defaults() -> dict[str, Any]:
    """RunConfig's defaults, so a run written before a configuration key
    existed compares equal to one that records the key's default."""
    from fedaval.config import RunConfig

    return RunConfig().to_dict()


def _filled(values: dict[str, Any]) -> dict[str, Any]:
    """A config file's values with what a run records besides: the
    per-dataset defaults of ``--lr``, ``--momentum`` and ``--local-epochs``."""
    from fedaval.config import RunConfig

    config = RunConfig.from_dict(values)
    config.fill_defaults()
    return {**values, **{k: getattr(config, k) for k in ("lr", "momentum", "local_epochs")}}


def _texts(setting: dict[str, Any]) -> dict[str, Any]:
    """A setting with every value as text (a config file's ``lr = 0.01`` and a
    run's recorded ``0.01`` compare equal)."""
    return {k: _texts(v) if isinstance(v, dict) else _as_text(v) for k, v in setting.items()}


def _as_text(value: Any) -> str:
    """``value`` as a command line writes it: ``false``, ``0.5``, ``1,2``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(_as_text(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@dataclass
class Group:
    """Runs whose settings are equal (they differ only in seed)."""

    setting: dict[str, Any]
    runs: list[RunResult] = field(default_factory=list)
    label: str = ""

    @property
    def method(self) -> str:
        return "+".join(self.setting.get("plugins") or []) or "fedavg"

    @property
    def seeds(self) -> list[Any]:
        return [r.seed for r in self.runs]


def group_runs(runs: list[RunResult]) -> list[Group]:
    """Group runs by :func:`setting_of`, in first-seen order, and label each
    group with the settings that tell it apart from the others."""
    groups: list[Group] = []
    for run in runs:
        setting = setting_of(run.config, run.results.get("options"))
        for group in groups:
            if group.setting == setting:
                group.runs.append(run)
                break
        else:
            groups.append(Group(setting, [run]))
    flat = [_flatten(g.setting) for g in groups]
    shown = {"plugins", "scenario", "dataset"}  # have their own columns
    varying = sorted({k for f in flat for k in f if k not in shown and len({json.dumps(x.get(k)) for x in flat}) > 1})
    for group, f in zip(groups, flat):
        group.label = ", ".join(f"{k if '.' in k else k.replace('_', '-')}={f[k]}" for k in varying if k in f)
    return groups


def _flatten(setting: dict[str, Any]) -> dict[str, Any]:
    """``{"lr": 0.1, "plugin_options": {"gldp": {"lam": "0.5"}}}`` ->
    ``{"lr": 0.1, "gldp.lam": "0.5"}``."""
    out = {k: v for k, v in setting.items() if k != "plugin_options"}
    for owner, values in setting.get("plugin_options", {}).items():
        for key, value in values.items():
            out[f"{owner}.{key}"] = value
    return out


# ---------------------------------------------------------------- statistics


def mean_std(values: list[float | None]) -> tuple[float | None, float | None, int]:
    """Mean and sample standard deviation (n - 1) of the values present, and
    how many were present. The deviation is ``None`` for fewer than two."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None, 0
    mean = statistics.fmean(present)
    std = statistics.stdev(present) if len(present) > 1 else None
    return mean, std, len(present)


@dataclass
class Row:
    """One line of the report: a group and, per metric key, (mean, std, n)."""

    group: Group
    stats: dict[str, tuple[float | None, float | None, int]]


def summarise_groups(groups: list[Group]) -> list[Row]:
    return [Row(group, {m.key: mean_std([m.read(r.results) for r in group.runs]) for m in METRICS}) for group in groups]


def present_metrics(rows: list[Row]) -> list[Metric]:
    """The metrics at least one group has a value for."""
    return [m for m in METRICS if any(row.stats[m.key][2] for row in rows)]


# ---------------------------------------------------------------- tables


def _byte_unit(value: float) -> tuple[str, float]:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= size:
            return unit, size
    return "B", 1.0


def _format_cell(stat: tuple[float | None, float | None, int], kind: str, runs: int) -> str:
    """``mean ± std`` in the column's unit (the deviation in the mean's unit);
    ``(n=k)`` when only k of the row's runs recorded the metric."""
    mean, std, n = stat
    if mean is None:
        return ""
    if kind == "percent":
        scale, unit, digits = 100.0, "", 2
    elif kind == "bytes":
        unit, scale = _byte_unit(mean)
        scale, unit, digits = 1 / scale, " " + unit, (0 if unit == "B" else 2)
    else:
        scale, unit, digits = 1.0, "", 2
    text = f"{mean * scale:.{digits}f}"
    if std is not None:
        text += f" ± {std * scale:.{digits}f}"
    text += unit
    if n < runs:
        text += f" (n={n})"
    return text


def _header(rows: list[Row], paper: PaperRows | None = None) -> tuple[list[str], list[Metric]]:
    metrics = present_metrics(rows)
    columns = ["method", "scenario", "dataset"]
    if paper is not None:
        columns.append("paper row")
    if any(row.group.label for row in rows):
        columns.append("setting")
    columns += ["runs", "seeds"]
    titles = []
    for m in metrics:
        titles.append(m.title)
        if paper is not None and m.key in paper.values:
            titles.append(f"paper {m.title}")
    return columns + titles, metrics


def markdown_table(rows: list[Row], paper: PaperRows | None = None) -> str:
    """A pipe table, padded so it also reads well in a terminal. Accuracies,
    forgetting and utility are percentages, shown as mean ± std. With
    ``paper`` (:func:`match_paper`), the paper's row name and its number
    beside each measured metric it reports."""
    columns, metrics = _header(rows, paper)
    body = []
    for index, row in enumerate(rows):
        g = row.group
        cells = [g.method, g.setting.get("scenario", ""), g.setting.get("dataset", "")]
        if paper is not None:
            cells.append(paper.names.get(index, ""))
        if "setting" in columns:
            cells.append(g.label)
        cells += [str(len(g.runs)), ",".join(r.seed_label for r in g.runs)]
        for m in metrics:
            cells.append(_format_cell(row.stats[m.key], m.kind, len(g.runs)))
            if paper is not None and m.key in paper.values:
                value = paper.values[m.key].get(index)
                cells.append("" if value is None else f"{value:.2f}")
        body.append(cells)
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(columns)]
    numeric = set(range(columns.index("seeds") + 1, len(columns)))

    def line(cells: list[str]) -> str:
        return (
            "| "
            + " | ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
            + " |"
        )

    rule = "|" + "|".join(("-" * (w + 1) + ":") if i in numeric else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(columns), rule, *(line(r) for r in body)])


def csv_table(rows: list[Row], paper: PaperRows | None = None) -> str:
    """One line per group; raw numbers (accuracies as fractions, bytes,
    seconds): ``<metric>_mean``, ``<metric>_std``, ``<metric>_n``. With
    ``paper`` (:func:`match_paper`), the first column is the paper's row name
    (``paper_row``)."""
    metrics = present_metrics(rows)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    header = ["method", "scenario", "dataset", "setting", "runs", "seeds", "run_dirs"]
    if paper is not None:
        header.insert(0, "paper_row")
    for m in metrics:
        header += [f"{m.key}_mean", f"{m.key}_std", f"{m.key}_n"]
    writer.writerow(header)
    for index, row in enumerate(rows):
        g = row.group
        line = [
            g.method,
            g.setting.get("scenario", ""),
            g.setting.get("dataset", ""),
            g.label,
            len(g.runs),
            " ".join(r.seed_label.replace(" ", "") for r in g.runs),
            " ".join(str(r.path) for r in g.runs),
        ]
        if paper is not None:
            line.insert(0, paper.names.get(index, ""))
        for m in metrics:
            mean, std, n = row.stats[m.key]
            line += ["" if mean is None else repr(mean), "" if std is None else repr(std), n]
        writer.writerow(line)
    return buffer.getvalue()


# ---------------------------------------------------------------- the paper's numbers


#: docs/reproduction.md's measured columns -> report metric (a column
#: headed just "measured" shows the config's ``[paper] metric``)
REPRODUCTION_COLUMNS = {
    "measured A_glo": "a_glo",
    "measured A_loc": "a_loc",
    "measured A_sel": "a_sel",
    "measured avg": "average_client_accuracy",
    "measured final": "client_accuracy",
}


def reproduction_cell(mean: float | None, std: float | None, runs: int) -> str:
    """A measured cell of docs/reproduction.md from a report.csv's fraction
    mean and std over ``runs`` seeds: ``"14.75 ± 1.35 (3 seeds)"``,
    ``"69.45 (1 seed)"``, ``"n/a"`` when no run recorded the metric."""
    if mean is None:
        return "n/a"
    spread = "" if std is None or runs < 2 else f" ± {100 * std:.2f}"
    return f"{100 * mean:.2f}{spread} ({runs} seed{'s' if runs != 1 else ''})"


def committed_reports(folder: Path) -> dict[str, dict[str, str]]:
    """The paper rows of every ``report.csv`` in ``folder`` and its subfolders
    (benchmarks/results/reproduction/<config>/, one report per batch of runs
    made by ``benchmarks/reproduce.py``), by paper row name.

    A paper row in several reports (more seeds run in a later batch) is
    pooled: the runs of every batch count once, each metric's mean and sample
    standard deviation are those of all runs together (:func:`pool`). The
    batches must hold different seeds of the same paper row; a seed in two
    batches (the same run counted twice) or a row whose method, scenario or
    dataset differs between batches is an error."""
    rows: dict[str, dict[str, str]] = {}
    where: dict[str, Path] = {}
    for path in sorted(folder.rglob("report.csv")):
        with path.open() as fh:
            for row in csv.DictReader(fh):
                name = row["paper_row"]
                if not name:
                    continue
                if name in rows:
                    try:
                        row = pool(rows[name], row)
                    except ValueError as exc:
                        raise ValueError(f"paper row {name!r} in {where[name]} and {path}: {exc}") from None
                rows[name], where[name] = row, path
    return rows


#: The columns of a report.csv row that name what was run: pooled rows must agree on them. The
#: ``setting`` column is not one of them: it lists only the options that tell a report's groups
#: apart, so it depends on which other rows share the report; what a paper row ran is fixed by
#: the config's ``[paper.runs]`` arguments its runs were matched by.
_SAME_SETTING = ("method", "scenario", "dataset")


def pool(a: dict[str, str], b: dict[str, str]) -> dict[str, str]:
    """Two report.csv rows of the same setting with disjoint seeds as one:
    for each metric ``<m>_mean``, ``<m>_std``, ``<m>_n`` the mean and sample
    standard deviation of the union of both groups of runs (exact: the
    within-group sums of squares plus each group's offset from the pooled
    mean), ``runs``, ``seeds`` and ``run_dirs`` joined."""
    different = [key for key in _SAME_SETTING if key in a and a.get(key) != b.get(key)]
    if different:
        raise ValueError(
            f"different {', '.join(different)}: {[a[k] for k in different]} vs {[b.get(k) for k in different]}"
        )
    seeds_a, seeds_b = a.get("seeds", "").split(), b.get("seeds", "").split()
    bare = lambda seeds: {s.split("(")[0] for s in seeds}  # noqa: E731 - "3(21/50rounds)" is seed 3
    if not seeds_a or not seeds_b or bare(seeds_a) & bare(seeds_b):
        raise ValueError(f"seeds must differ between batches, got {seeds_a} and {seeds_b}")
    out = dict(a)
    out["runs"] = str(int(a["runs"]) + int(b["runs"]))
    out["seeds"] = " ".join(sorted(seeds_a + seeds_b))
    out["run_dirs"] = " ".join(x for x in (a.get("run_dirs", ""), b.get("run_dirs", "")) if x)
    for key in a:
        if not key.endswith("_mean"):
            continue
        stem = key.removesuffix("_mean")
        n_a, n_b = int(a.get(f"{stem}_n") or 0), int(b.get(f"{stem}_n") or 0)
        if n_b == 0:
            continue
        if n_a == 0:
            for part in ("_mean", "_std", "_n"):
                out[stem + part] = b.get(stem + part, "")
            continue
        m_a, m_b = float(a[key]), float(b[key])
        n = n_a + n_b
        mean = (n_a * m_a + n_b * m_b) / n
        squares = sum(
            (k - 1) * float(s or 0) ** 2 + k * (m - mean) ** 2
            for k, m, s in ((n_a, m_a, a.get(f"{stem}_std")), (n_b, m_b, b.get(f"{stem}_std")))
        )
        out[key], out[f"{stem}_std"], out[f"{stem}_n"] = repr(mean), repr(math.sqrt(squares / (n - 1))), str(n)
    return out


@dataclass
class PaperRows:
    """A config's ``[paper]`` table matched to the report's rows:
    ``values[metric key][row index]`` the paper's number for that row (in %),
    ``names[row index]`` the paper's row name, ``unmatched`` paper rows that no
    group of runs matches."""

    source: str
    values: dict[str, dict[int, float]]
    names: dict[int, str]
    unmatched: list[str]


def _row_arguments(args: str) -> tuple[list[str] | None, dict[str, str], dict[str, Any]]:
    """A ``[paper.runs]`` row's arguments (``-p fedprox -o fedprox.mu=0.1
    --client-test train``) as ``(plugins or None, {owner.key: value},
    {run setting: value})``."""
    import shlex

    plugins, options, flags = None, {}, {}
    words = shlex.split(args)
    for i, word in enumerate(words):
        value = words[i + 1] if i + 1 < len(words) else None
        if word in ("-p", "--plugins") and value is not None:
            plugins = [p.strip() for p in value.split(",") if p.strip()]
        elif word in ("-o", "--option") and value is not None:
            key, _, raw = value.partition("=")
            options[key.strip()] = raw.strip()
        elif word.startswith("--") and word not in ("--plugins", "--option"):
            name = word[2:].replace("-", "_")
            flags[name] = True if value is None or value.startswith("-") else value
    return plugins, options, flags


#: what a paper row's runs may change at the CPU's scale or the paper's
#: (``[paper.full-scale]``, and benchmarks/gpu_session.sh's ``--model``):
#: the rest of the config file's setting must be the run's
SCALED = ("model", "rounds_per_task", "local_epochs", "eval_every")


def match_paper(path: str | Path, groups: list[Group]) -> PaperRows:
    """Match the rows of a config's ``[paper]`` table (``fedaval train --config``
    files in ``configs/`` carry one) to the groups of runs: a group is a
    paper row when its setting is the config file's run with the row's
    arguments (``[paper.runs]``; ``[paper.full-scale.runs]`` a row's other
    arguments at the paper's scale, which match it too): its plugins, its
    scenario, dataset and every other setting (:func:`setting_of`, each
    plugin's and the scenario's options included), apart from what the two
    scales change (:data:`SCALED`, and the settings ``[paper.full-scale]``
    ``args`` set). Until session 35 only the plugins and the plugin options
    some row names were compared, so digits runs were put beside a CIFAR-10
    table. Tables ``[paper.<metric>]`` whose name is a report metric become
    columns."""
    import tomllib

    from fedaval.config_file import full_scale_runs, read_paper_table

    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise FedavalUsageError(f"--paper {str(path)!r} cannot be read ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise FedavalUsageError(f"--paper {str(path)!r} is not valid TOML: {exc}") from None
    table = read_paper_table(path)
    if not table:
        raise FedavalUsageError(f"--paper {str(path)!r} has no [paper] table; see configs/repro-*.toml")
    base = {k.replace("-", "_"): v for k, v in data.items() if k not in ("options", "paper", "seeds", "seed")}
    base_plugins = list(base.pop("plugins", None) or ["fedavg"])
    file_options = {owner: dict(values) for owner, values in (data.get("options") or {}).items()}
    runs = table.get("runs") or {}
    scaled = set(SCALED) | set(_row_arguments(str((table.get("full-scale") or {}).get("args", "")))[2])
    # a row's runs at either scale are the row (its arguments at the paper's scale: full_scale_runs)
    expected = []
    for name, args in [*runs.items(), *full_scale_runs(table).items()]:
        plugins, options, flags = _row_arguments(args)
        plugins = plugins or base_plugins
        row_options = {  # a plugin the row replaced loses the file's options
            owner: dict(values)
            for owner, values in file_options.items()
            if owner in plugins or owner == {**_defaults(), **base, **flags}["scenario"]
        }
        for key, value in options.items():
            owner, _, option = key.partition(".")
            row_options.setdefault(owner, {})[option] = value
        setting = setting_of({**_filled({**base, **flags}), "plugins": plugins, "plugin_options": row_options})
        expected.append((name, {k: v for k, v in setting.items() if k not in scaled}))
    drop_default = lambda plugins: [p for p in plugins if p != "fedavg"] or ["fedavg"]  # noqa: E731
    names: dict[int, str] = {}
    for index, group in enumerate(groups):
        for name, setting in expected:
            # "auto" is recorded as what it chose for the dataset (fedaval.training.resolve_augment)
            mine = {
                k: v for k, v in group.setting.items() if k in setting and not (k == "augment" and setting[k] == "auto")
            }
            if drop_default(list(mine.get("plugins") or [])) != drop_default(list(setting.get("plugins") or [])):
                continue
            theirs = {k: v for k, v in setting.items() if k in mine}
            if _texts({**mine, "plugins": None}) == _texts({**theirs, "plugins": None}):
                names[index] = name
                break
    keys = {m.key for m in METRICS}
    values = {
        metric: {i: float(numbers[name]) for i, name in names.items() if name in numbers}
        for metric, numbers in table.items()
        if metric in keys and isinstance(numbers, dict)
    }
    return PaperRows(str(table.get("source", path)), values, names, sorted(set(runs) - set(names.values())))


# ---------------------------------------------------------------- figures


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def task_boundaries(results: dict[str, Any]) -> list[int]:
    """Rounds after which a task ended (the last task's end excluded)."""
    ends = [r["round"] for r in results.get("rounds") or [] if r.get("task_end")]
    total = len(results.get("rounds") or [])
    return [e for e in ends if e < total]


def plot_accuracy_over_rounds(groups: list[Group], path: Path) -> Path:
    """Global accuracy (all classes seen so far) at every evaluated round (the
    clients' mean accuracy for a method whose federation model is its
    clients' models), one curve per run, one colour per group and one line style per seed; dotted
    grey lines between tasks."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", "-.", ":"]  # the seeds of one group
    boundaries: set[int] = set()
    for i, group in enumerate(groups):
        for j, run in enumerate(group.runs):
            key = "mean_client_accuracy" if run.results.get("federation_model") == "clients" else "global_accuracy"
            points = [
                (r["round"], 100 * r[key]) for r in run.results.get("rounds") or [] if _number(r.get(key)) is not None
            ]
            boundaries.update(task_boundaries(run.results))
            if not points:
                continue
            label = f"{group.method} {group.label} s{run.seed}".replace("  ", " ")
            if key != "global_accuracy":
                label += " (clients' mean)"
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker=".", color=colours[i % len(colours)], linestyle=styles[j % len(styles)], label=label)
    for b in sorted(boundaries):
        ax.axvline(b + 0.5, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("federated round (dotted: new task)")
    ax.set_ylabel("accuracy on classes seen (%)")
    ax.set_ylim(0, 100)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_accuracy_matrix(run: RunResult, path: Path) -> Path:
    """Heatmap of ``final.accuracy_matrix``: row i = after learning task i,
    column j = global accuracy on task j's classes (blank above the
    diagonal: not yet seen)."""
    plt = _pyplot()
    import numpy as np

    matrix = (run.results.get("final") or {}).get("accuracy_matrix") or []
    size = max([len(matrix), *(len(r) for r in matrix)]) if matrix else 1
    grid = np.full((max(len(matrix), 1), size), np.nan)
    for i, row in enumerate(matrix):
        for j, value in enumerate(row):
            if _number(value) is not None:
                grid[i, j] = 100 * value
    fig, ax = plt.subplots(figsize=(1.8 + 0.7 * size, 1.4 + 0.6 * grid.shape[0]), dpi=100)
    image = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis")
    for (i, j), value in np.ndenumerate(grid):
        if not np.isnan(value):
            ax.text(
                j, i, f"{value:.0f}", ha="center", va="center", fontsize=8, color="white" if value < 60 else "black"
            )
    ax.set_xticks(range(size), [str(j + 1) for j in range(size)])
    ax.set_yticks(range(grid.shape[0]), [str(i + 1) for i in range(grid.shape[0])])
    ax.set_xlabel("task evaluated")
    ax.set_ylabel("after task")
    ax.set_title(run.name, fontsize=8)
    fig.colorbar(image, ax=ax, label="accuracy (%)", fraction=0.046, pad=0.04)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", name)


# ---------------------------------------------------------------- the report


@dataclass
class Report:
    table: str
    files: list[Path]
    grouping: str = ""


def check_runs(groups: list[Group], include_incomplete: bool) -> None:
    """One-line errors for runs that would make a row silently wrong: a run
    that is not complete (unless ``include_incomplete``), and two runs of one
    row with the same seed (one experiment counted twice)."""
    for group in groups:
        for run in group.runs:
            if not run.complete and not include_incomplete:
                status = run.status
                raise FedavalUsageError(
                    f"run {str(run.path)!r} is not complete ({status['state']}, {status['rounds_done']} of "
                    f"{status['rounds_total']} rounds); finish it with fedaval train --resume {run.path}, leave it "
                    "out, or pass --include-incomplete to report it marked"
                )
        by_seed: dict[str, RunResult] = {}
        for run in group.runs:
            other = by_seed.setdefault(json.dumps(run.seed), run)
            if other is not run:
                raise FedavalUsageError(
                    f"runs {str(other.path)!r} and {str(run.path)!r} have the same settings and the same seed "
                    f"{run.seed}, so their mean would count one experiment twice; report one of them"
                )


def grouping_text(groups: list[Group]) -> str:
    """Which run folders make each row: ``method scenario dataset [setting]: dir, dir``."""
    lines = []
    for g in groups:
        head = " ".join(
            x for x in (g.method, str(g.setting.get("scenario", "")), str(g.setting.get("dataset", "")), g.label) if x
        )
        lines.append(f"{head}: " + ", ".join(str(r.path) for r in g.runs))
        versions = sorted({str(r.results.get("fedaval_version", "before session 35")) for r in g.runs})
        sources = {r.results.get("fedaval_source") for r in g.runs}  # since session 36: the code itself
        if len(versions) > 1 and (None in sources or len(sources) > 1):  # a metric may have changed between them
            lines.append(f"{head}: runs of fedaval versions {', '.join(versions)}")
        threads = sorted({n for r in g.runs for n in r.results.get("torch_threads") or []})  # since session 36
        if len(threads) > 1:  # on the CPU another thread count is another sample, as another seed
            lines.append(f"{head}: runs with torch threads {', '.join(map(str, threads))}")
    return "\n".join(lines)


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise FedavalUsageError(f"--out-dir {str(out)!r} is a file, not a folder; give a folder for the report")


def _make_out_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FedavalUsageError(f"--out-dir {str(out)!r} cannot be created ({exc.strerror})") from None


def write_report(
    paths: list[str | Path],
    out_dir: str | Path = ".",
    figures: bool = True,
    include_incomplete: bool = False,
    paper: str | Path | None = None,
) -> Report:
    """Read the runs, write ``report.md``, ``report.csv`` and (``figures``)
    ``accuracy.png`` and ``matrix-<run>.png`` per run into ``out_dir``;
    return the Markdown table, the files written and which runs make each
    row. Incomplete runs and repeated seeds are refused (:func:`check_runs`)."""
    out = Path(out_dir)
    _check_out_dir(out)  # before reading the runs: a usage error comes first
    runs = load_runs(list(paths))
    groups = group_runs(runs)
    check_runs(groups, include_incomplete)
    rows = summarise_groups(groups)
    matched = match_paper(paper, groups) if paper is not None else None
    table = markdown_table(rows, matched)
    if matched is not None:
        table += f"\n\npaper: {matched.source}"
        if matched.unmatched:
            table += f"\npaper rows with no runs here: {', '.join(matched.unmatched)}"
    _make_out_dir(out)
    files: list[Path] = []
    images: list[Path] = []
    if figures:
        images.append(plot_accuracy_over_rounds(groups, out / "accuracy.png"))
        for run in runs:  # a run without a global model has no accuracy matrix (PFCL): no empty heatmap
            if (run.results.get("final") or {}).get("accuracy_matrix"):
                images.append(plot_accuracy_matrix(run, out / f"matrix-{_file_name(run.name)}.png"))
    legend = (
        "Accuracies, forgetting, BWT and utility in %, mean ± sample standard deviation over the runs "
        "of a row (runs that differ only in seed); E (computation + communication), bytes and seconds "
        "per federated round. Definitions: docs/report.md."
    )
    if any(not r.complete for r in runs):
        legend += " Seeds marked (k/n rounds) are runs that stopped before their last round."
    grouping = grouping_text(groups)
    md = ["# fedaval report", "", table, "", legend, "", "Runs of each row:", ""]
    md += [f"- {line}" for line in grouping.splitlines()] + [""]
    md += [f"![{p.stem}]({p.name})" for p in images]
    md_path = out / "report.md"
    md_path.write_text("\n".join(md) + "\n")
    csv_path = out / "report.csv"
    csv_path.write_text(csv_table(rows, matched))
    files += [md_path, csv_path, *images]
    return Report(table, files, grouping)
