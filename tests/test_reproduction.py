"""The reproduction configs (configs/repro-*.toml) and docs/reproduction.md:
each config is a valid `fedaval train --config` file whose ``[paper]`` table
carries the paper's numbers and, for every row, the arguments of its run;
each row's command and paper number appear in the docs, and no measured cell
is filled without a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedaval.config_file import read_config_file, read_paper_table

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("repro-*.toml"))


def train_option_names():
    from fedaval.cli import train

    return [p.name for p in train.params]


def test_there_is_one_config_per_seed_paper_table():
    assert {p.name for p in CONFIGS} == {
        "repro-fedprok-table1.toml",
        "repro-gldp-table2.toml",
        "repro-pfcl-tiny-imagenet.toml",
        "repro-hgp-rebalancing.toml",
    }


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_a_train_file_with_a_paper_table(path):
    values, options = read_config_file(path, train_option_names())
    assert values["seeds"] == "42,1999,2024"
    assert options
    paper = read_paper_table(path)
    assert paper["source"] and paper["metric"] in paper
    for label, number in paper[paper["metric"]].items():
        assert label in paper["runs"], label  # every row with a paper number has a run
        assert isinstance(number, float)


def measured_cells(markdown):
    """Every cell of a column headed "measured ..." in the tables of ``markdown``."""
    cells, header = [], None
    for line in markdown.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = row
        elif not set(line) <= set("|-: "):
            cells += [c for h, c in zip(header, row) if h.startswith("measured")]
    return cells


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_docs_list_every_row_with_its_command_and_paper_number(path):
    docs = (ROOT / "docs" / "reproduction.md").read_text()
    paper = read_paper_table(path)
    assert f"configs/{path.name}" in docs
    for label, args in paper["runs"].items():
        assert f"| {label} |" in docs, label
        assert f"--config configs/{path.name} {args}".rstrip() in docs, args
    for number in paper[paper["metric"]].values():
        assert f"| {number:.2f} |" in docs or f"| {number:.1f} |" in docs, number


REPORTS = ROOT / "benchmarks" / "results" / "reproduction"


def section_tables(markdown):
    """``{config file name: [(header, row cells), ...]}`` for every table
    under a section that names its config (``Config: `configs/NAME` ``)."""
    import re

    out, config, header = {}, None, None
    for line in markdown.splitlines():
        if line.startswith("## "):
            config, header = None, None
        found = re.search(r"Config: `configs/([^`]+)`", line)
        if found:
            config = found.group(1)
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif set(line) <= set("|-: ") or config is None:
            continue
        else:
            out.setdefault(config, []).append((header, cells))
    return out


def test_every_measured_cell_comes_from_the_committed_report():
    """A measured cell is "not run yet" or exactly what the committed
    ``fedaval report --paper`` CSVs of its table give for its paper row
    (benchmarks/results/reproduction/<config>/**/report.csv, written by
    benchmarks/reproduce.py): no number is typed in by hand."""
    from fedaval.report import REPRODUCTION_COLUMNS, committed_reports, reproduction_cell

    tables = section_tables((ROOT / "docs" / "reproduction.md").read_text())
    assert set(tables) == {p.name for p in CONFIGS}
    filled = 0
    for config, rows in tables.items():
        report = committed_reports(REPORTS / config.removesuffix(".toml"))
        metric = read_paper_table(ROOT / "configs" / config)["metric"]
        for header, cells in rows:
            for title, cell in zip(header, cells):
                if not title.startswith("measured") or cell == "not run yet":
                    continue
                key = REPRODUCTION_COLUMNS.get(title, metric)
                row = report[cells[0]]
                mean, std = (float(row[f"{key}_{s}"]) if row[f"{key}_{s}"] else None for s in ("mean", "std"))
                assert cell == reproduction_cell(mean, std, int(row["runs"])), (config, cells[0], title)
                filled += 1
    assert filled == sum(
        1 for c in measured_cells((ROOT / "docs" / "reproduction.md").read_text()) if c != "not run yet"
    )


def test_reproduction_cell_format():
    from fedaval.report import reproduction_cell

    assert reproduction_cell(0.147512, 0.0135, 3) == "14.75 ± 1.35 (3 seeds)"
    assert reproduction_cell(0.6945, None, 1) == "69.45 (1 seed)"
    assert reproduction_cell(None, None, 2) == "n/a"


def test_train_ignores_the_paper_table(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('plugins = ["fedavg"]\n[paper]\nsource = "x"\n[paper.final_accuracy]\nFedAvg = 1.0\n')
    values, options = read_config_file(path, train_option_names())
    assert values == {"plugins": ["fedavg"]} and options == {}


class ReachedData(Exception):
    """Raised in place of loading the data: every check before it passed."""


ROWS = [(path, name, arguments) for path in CONFIGS for name, arguments in read_paper_table(path)["runs"].items()]


@pytest.mark.parametrize("path,name,arguments", ROWS, ids=[f"{p.stem.removeprefix('repro-')}:{n}" for p, n, _ in ROWS])
def test_every_row_command_gets_past_the_option_checks(path, name, arguments, tmp_path, monkeypatch):
    """Each row's documented command, `fedaval train --config CONFIG <row's
    arguments>`, loads its plugins and options up to the data: `-p fedavg`
    on a config whose options are for another method once failed with
    "options given for fedprok, which is neither a loaded plugin ..."."""
    import shlex

    from click.testing import CliRunner

    from fedaval.cli import cli

    def reached(*args, **kwargs):
        raise ReachedData

    monkeypatch.setattr("fedaval.build.load_dataset", reached)
    argv = ["train", "--config", str(path), *shlex.split(arguments), "--seed", "42", "--quiet"]
    result = CliRunner().invoke(cli, [*argv, "--out", str(tmp_path / "run")])
    assert isinstance(result.exception, ReachedData), (result.exit_code, result.output)


def test_committed_reports_reads_every_batch_and_pools_a_row_over_batches(tmp_path):
    """Rows come from report.csv files in the config's folder and its batch
    subfolders; a paper row in two batches (more seeds run later) is pooled
    into the mean and sample std of all its runs; the same seed twice or a
    different method is an error, a different setting label (report-relative) is not."""
    import statistics

    from fedaval.report import committed_reports

    header = "paper_row,method,setting,runs,seeds,run_dirs,final_accuracy_mean,final_accuracy_std,final_accuracy_n\n"
    first = [0.10, 0.16, 0.19]
    row = f"{statistics.mean(first)},{statistics.stdev(first)},3"
    (tmp_path / "report.csv").write_text(header + f"FedAvg,fedavg,,3,1 2 3,r1 r2 r3,{row}\n,gldp,,1,42,x,0.2,,1\n")
    (tmp_path / "session5").mkdir()
    (tmp_path / "session5" / "report.csv").write_text(header + "CReFF,creff,,2,1 2,a b,0.3,0.01,2\n")
    rows = committed_reports(tmp_path)
    assert sorted(rows) == ["CReFF", "FedAvg"]  # the unmatched group (no paper row) is left out
    assert rows["CReFF"]["final_accuracy_mean"] == "0.3"
    (tmp_path / "session5" / "report.csv").write_text(
        header + "FedAvg,fedavg,,2,4 5,r4 r5,0.25,0.07071067811865477,2\n"
    )
    pooled = committed_reports(tmp_path)["FedAvg"]
    every = first + [0.2, 0.3]  # mean 0.25, std 0.0707 of the second batch
    assert float(pooled["final_accuracy_mean"]) == pytest.approx(statistics.mean(every))
    assert float(pooled["final_accuracy_std"]) == pytest.approx(statistics.stdev(every))
    assert (pooled["final_accuracy_n"], pooled["runs"], pooled["seeds"]) == ("5", "5", "1 2 3 4 5")
    assert pooled["run_dirs"] == "r1 r2 r3 r4 r5"
    (tmp_path / "session5" / "report.csv").write_text(header + "FedAvg,fedavg,,1,3,r3,0.2,,1\n")
    with pytest.raises(ValueError, match="'FedAvg'.*seeds must differ"):
        committed_reports(tmp_path)
    # a seed marked incomplete in one batch is still that seed (it was pooled as another run)
    (tmp_path / "session5" / "report.csv").write_text(header + "FedAvg,fedavg,,1,3(21/50rounds),r3,0.2,,1\n")
    with pytest.raises(ValueError, match="'FedAvg'.*seeds must differ"):
        committed_reports(tmp_path)
    (tmp_path / "session5" / "report.csv").write_text(header + "FedAvg,fedprox,,1,9,r9,0.2,,1\n")
    with pytest.raises(ValueError, match="different method"):
        committed_reports(tmp_path)
    # The setting label names only what tells a report's groups apart, so the same paper row's
    # label differs between a batch of that row alone and a batch beside other rows: it pools.
    (tmp_path / "session5" / "report.csv").write_text(header + "FedAvg,fedavg,fedavg.mu=1,1,9,r9,0.2,,1\n")
    assert committed_reports(tmp_path)["FedAvg"]["seeds"] == "1 2 3 9"


def test_reproduce_keeps_a_runs_config_and_results_only(tmp_path):
    """``reproduce.py --keep`` copies what ``fedaval report`` reads (config.json,
    results.json) and leaves checkpoints and TensorBoard events behind."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reproduce", ROOT / "benchmarks" / "reproduce.py")
    reproduce = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reproduce)
    run = tmp_path / "runs" / "fedavg-s42"
    (run / "checkpoints").mkdir(parents=True)
    (run / "tb").mkdir()
    (run / "config.json").write_text('{"seed": 42}')
    (run / "results.json").write_text('{"status": {"state": "complete"}}')
    (run / "checkpoints" / "round-000001.ckpt").write_bytes(b"x")
    kept = reproduce.keep(run, tmp_path / "kept")
    assert kept == tmp_path / "kept" / "fedavg-s42"
    assert sorted(p.name for p in kept.iterdir()) == ["config.json", "results.json"]
    assert (kept / "config.json").read_text() == '{"seed": 42}'
