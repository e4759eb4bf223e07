"""`fedaval report`: numbers against the runs' results.json, grouping over
seeds, figures, errors."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import one_line_error, tiny_run_config
from PIL import Image

from fedaval.cli import cli
from fedaval.report import group_runs, load_runs, mean_std, setting_of, write_report


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two digits runs that differ only in seed, and one with another lr."""
    from fedaval.api import run_training

    root = tmp_path_factory.mktemp("report-runs")
    paths = {}
    for name, overrides in [("a-s1", dict(seed=1)), ("a-s2", dict(seed=2)), ("b-s1", dict(seed=1, lr=0.05))]:
        run_training(tiny_run_config(root / name, **overrides))
        paths[name] = root / name
    return paths


def results(path: Path) -> dict:
    return json.loads((path / "results.json").read_text())


def test_report_numbers_are_mean_and_sample_std_of_the_runs(runs, tmp_path):
    report = write_report([runs["a-s1"], runs["a-s2"], runs["b-s1"]], tmp_path)
    rows = list(csv.DictReader((tmp_path / "report.csv").open()))
    assert len(rows) == 2, "the two seeds of one setting make one row, the other lr another"
    a, b = rows
    assert (a["runs"], a["seeds"], b["runs"], b["seeds"]) == ("2", "1 2", "1", "1")
    assert a["setting"] == "lr=0.01" and b["setting"] == "lr=0.05"

    r1, r2 = results(runs["a-s1"]), results(runs["a-s2"])
    assert r1["final"]["accuracy"] != r2["final"]["accuracy"], "seeds should give different runs"
    for key, read in [
        ("final_accuracy", lambda r: r["final"]["accuracy"]),
        ("average_accuracy", lambda r: r["final"]["average_accuracy"]),
        ("forgetting", lambda r: r["final"]["forgetting"]),
        ("bytes_up_per_round", lambda r: sum(x["bytes_up"] for x in r["rounds"]) / len(r["rounds"])),
        ("bytes_down_per_round", lambda r: r["final"]["bytes_down"] / r["final"]["rounds"]),
        ("seconds_per_round", lambda r: sum(x["seconds"] for x in r["rounds"]) / len(r["rounds"])),
    ]:
        values = [read(r1), read(r2)]
        assert float(a[f"{key}_mean"]) == pytest.approx(statistics.fmean(values)), key
        assert float(a[f"{key}_std"]) == pytest.approx(statistics.stdev(values)), key
        assert a[f"{key}_n"] == "2"
        assert float(b[f"{key}_mean"]) == pytest.approx(read(results(runs["b-s1"])))
        assert b[f"{key}_std"] == "", "one run has no standard deviation"

    # the core's A_glo / A_loc / utility, where the runs carry them
    for key in ("a_glo", "a_loc", "utility"):
        values = [r["final"].get(key) for r in (r1, r2)]
        if any(v is not None for v in values):
            assert float(a[f"{key}_mean"]) == pytest.approx(statistics.fmean(v for v in values if v is not None))
        else:
            assert f"{key}_mean" not in a, "a metric no run has gets no column"

    # the Markdown table shows the same numbers, in %, as mean ± std
    acc = [r1["final"]["accuracy"], r2["final"]["accuracy"]]
    cell = f"{100 * statistics.fmean(acc):.2f} ± {100 * statistics.stdev(acc):.2f}"
    assert cell in report.table
    md = (tmp_path / "report.md").read_text()
    assert cell in md and "![accuracy](accuracy.png)" in md


def test_report_writes_valid_png_figures(runs, tmp_path):
    write_report([runs["a-s1"], runs["a-s2"]], tmp_path)
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["accuracy.png", "matrix-a-s1.png", "matrix-a-s2.png"]
    for name in pngs:
        with Image.open(tmp_path / name) as image:
            image.verify()
        with Image.open(tmp_path / name) as image:
            assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def test_report_command_prints_the_table_and_writes_into_out_dir(runs, tmp_path):
    result = CliRunner().invoke(
        cli, ["report", str(runs["a-s1"]), str(runs["a-s2"]), "--out-dir", str(tmp_path / "rep")]
    )
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].startswith("| method")
    assert {p.name for p in (tmp_path / "rep").iterdir()} >= {"report.md", "report.csv", "accuracy.png"}


def test_a_folder_that_is_not_a_run_is_a_one_line_error(runs, tmp_path):
    (tmp_path / "empty").mkdir()
    for bad in [tmp_path / "empty", tmp_path / "missing"]:
        result = CliRunner().invoke(cli, ["report", str(runs["a-s1"]), str(bad)])
        assert result.exit_code == 2
        assert result.output.strip().count("\n") == 0
        assert "is not a fedaval run folder" in result.output and str(bad) in result.output
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "results.json").write_text('{"not": "a run"}')
    result = CliRunner().invoke(cli, ["report", str(tmp_path / "junk")])
    assert result.exit_code == 2 and "not a fedaval results file" in result.output
    (tmp_path / "paper.toml").write_text("[paper\n")  # broken TOML: one line, not a traceback
    result = CliRunner().invoke(cli, ["report", str(runs["a-s1"]), "--paper", str(tmp_path / "paper.toml")])
    assert result.exit_code == 2 and "is not valid TOML" in result.output and result.output.strip().count("\n") == 0


def test_mean_std_by_hand():
    mean, std, n = mean_std([0.5, 0.7, None])
    assert (mean, n) == (pytest.approx(0.6), 2)
    assert std == pytest.approx(0.1414213562)  # sqrt(((0.1)^2 + (0.1)^2) / (2 - 1))
    assert mean_std([0.3]) == (0.3, None, 1)
    assert mean_std([None, None]) == (None, None, 0)


def test_settings_compare_by_value_whichever_way_given():
    """A file's typed ``clients = 2`` equals ``-o fcil-sync.clients=2``; seed,
    out and device do not make a different experiment; a key a run does not
    record counts as its default."""
    from fedaval.config import RunConfig

    a = RunConfig(scenario_options={"clients": 2}, seed=1, out="x", device="cpu").to_dict()
    b = RunConfig(plugin_options={"fcil-sync": {"clients": "2"}}, seed=2, out="y", device="auto").to_dict()
    assert setting_of(a) == setting_of(b)
    c = dict(b, lr=0.1)
    assert setting_of(a) != setting_of(c)
    old = {k: v for k, v in a.items() if k != "eval_every"}  # a key added later
    assert setting_of(old) == setting_of(a)


def test_an_option_compares_by_its_typed_value_and_its_default_by_absence():
    """``mu=1e-2``, ``mu=0.01`` (fedprox's default) and no ``mu`` are one
    setting (they were three rows of identical numbers); ``mu=0.5`` is
    another. A run that records its options as read (results.json
    ``options``) compares by them: a default given or not is the same."""
    from fedaval.config import RunConfig

    def prox(**options):
        return RunConfig(plugins=["fedprox"], plugin_options={"fedprox": options} if options else {}).to_dict()

    assert setting_of(prox(mu="1e-2")) == setting_of(prox(mu="0.01")) == setting_of(prox())
    assert setting_of(prox(mu="0.5")) != setting_of(prox())
    assert setting_of(prox(), {"fedprox": {"mu": 0.01}, "fcil-sync": {"clients": 3}}) == setting_of(prox())
    assert setting_of(prox(), {"fedprox": {"mu": 0.5}}) == setting_of(prox(mu="0.5"))


def test_results_record_every_option_as_the_run_read_it_and_the_version(runs):
    recorded = results(runs["a-s1"])
    assert recorded["options"]["fcil-sync"] == {"clients": 2, "tasks": 2, "alpha": 1.0}
    assert recorded["fedaval_version"].startswith("0.")


def test_how_a_run_was_executed_is_not_a_setting():
    """A run checkpointed every round and one on ``auto`` (or on Ray, or
    offloaded) give the same results: one row, not two (a reproduction
    table once split HGP's seeds over two rows by ``checkpoint-every``)."""
    from fedaval.config import RunConfig

    a = RunConfig(checkpoint_every=1).to_dict()
    b = RunConfig(
        checkpoint_every="auto", keep_checkpoints=5, checkpoint_writer="thread", backend="ray", offload_clients="cpu"
    ).to_dict()
    assert setting_of(a) == setting_of(b)


def test_same_folder_names_are_told_apart(runs, tmp_path):
    import shutil

    for parent in ("x", "y"):
        shutil.copytree(runs["a-s1"], tmp_path / parent / "run", ignore=shutil.ignore_patterns("tb"))
    loaded = load_runs([tmp_path / "x" / "run", tmp_path / "y" / "run"])
    assert [r.name for r in loaded] == ["x-run", "y-run"]
    assert len(group_runs(loaded)) == 1


#: the setting of tiny_run_config as a config file's lines: what a paper row's runs must be
TINY_SETTING = (
    'dataset = "digits"\nscenario = "fcil-sync"\nlr = 0.01\nmomentum = 0.0\nbatch-size = 32\n'
    "[options.fcil-sync]\nclients = 2\ntasks = 2\n"
)


def test_the_papers_numbers_stand_beside_the_measured_ones(runs, tmp_path):
    """``fedaval report --paper CONFIG`` matches runs to the [paper] table's rows
    by the arguments of [paper.runs] and puts the paper's number beside each;
    runs of another setting (here another lr) are no row of the paper's, whatever
    their plugins (until session 35 digits runs stood beside CIFAR-10's table)."""
    from fedaval.api import run_training

    prox = tmp_path / "prox"
    run_training(tiny_run_config(prox, seed=1, plugins=["fedprox"]))
    config = tmp_path / "paper.toml"
    config.write_text(
        'plugins = ["fedprok"]\n' + TINY_SETTING + '[paper]\nsource = "a table"\n'
        "[paper.final_accuracy]\nFedAvg = 18.45\nFedProx = 17.49\nFedProK = 64.34\n"
        '[paper.runs]\nFedAvg = "-p fedavg"\nFedProx = "-p fedprox"\nFedProK = ""\n'
    )
    result = CliRunner().invoke(
        cli,
        [
            "report",
            str(runs["a-s1"]),
            str(runs["a-s2"]),
            str(runs["b-s1"]),
            str(prox),
            "--paper",
            str(config),
            "--no-figures",
            "--out-dir",
            str(tmp_path / "rep"),
        ],
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = next(line for line in lines if line.startswith("| method"))
    assert "paper row" in header and "paper final acc" in header
    fedavg = next(line for line in lines if line.startswith("| fedavg "))
    fedprox = next(line for line in lines if line.startswith("| fedprox "))
    assert "FedAvg" in fedavg and "18.45" in fedavg
    assert "FedProx" in fedprox and "17.49" in fedprox
    assert "paper rows with no runs here: FedProK" in result.output
    import csv

    table = list(csv.DictReader((tmp_path / "rep" / "report.csv").open()))
    assert sorted((r["paper_row"], r["method"], r["setting"]) for r in table) == [
        ("", "fedavg", "lr=0.05"),
        ("FedAvg", "fedavg", "lr=0.01"),
        ("FedProx", "fedprox", "lr=0.01"),
    ]


def test_a_setting_shows_booleans_as_a_command_line_writes_them():
    """``fedprok.translation=false``, not Python's ``False`` (until session 36
    a report's setting column and an unknown plugin's compared text differed
    from what ``-o`` takes)."""
    from fedaval.report import _as_text

    assert (_as_text(False), _as_text(True), _as_text(0.5), _as_text([1, 2])) == ("false", "true", "0.5", "1,2")


def fedprox_paper_report(tmp_path: Path, runs: list[str], rows: str) -> list[dict]:
    """``fedaval report`` of the runs ``tmp_path/<run>`` with ``--paper`` a
    config of TINY_SETTING, FedProx's paper number 17.49 and the tables
    ``rows`` (``[paper.runs]``...): report.csv's rows."""
    paper = tmp_path / "paper.toml"
    paper.write_text(TINY_SETTING + '[paper]\nsource = "a table"\n[paper.final_accuracy]\nFedProx = 17.49\n' + rows)
    out = tmp_path / "rep"
    result = CliRunner().invoke(
        cli,
        ["report", *(str(tmp_path / n) for n in runs), "--paper", str(paper), "--no-figures", "--out-dir", str(out)],
    )
    assert result.exit_code == 0, result.output
    return list(csv.DictReader((out / "report.csv").open()))


def test_a_rows_runs_at_the_papers_scale_are_that_row(tmp_path):
    """``[paper.full-scale.runs]`` gives a row's arguments at the paper's scale
    (GLDP's FedRep: 20 + 10 epochs instead of 2 + 1): runs made with them are
    the row too; a run with other values is not."""
    from fedaval.api import run_training

    for name, mu in [("cpu", 0.01), ("full", 0.5), ("other", 0.2)]:
        run_training(
            tiny_run_config(tmp_path / name, seed=1, plugins=["fedprox"], plugin_options={"fedprox": {"mu": mu}})
        )
    table = fedprox_paper_report(
        tmp_path,
        ["cpu", "full", "other"],
        '[paper.runs]\nFedProx = "-p fedprox -o fedprox.mu=0.01"\n'
        '[paper.full-scale]\nargs = "--local-epochs 30"\n'
        '[paper.full-scale.runs]\nFedProx = "-p fedprox -o fedprox.mu=0.5"\n',
    )
    assert sorted((r["setting"], r["paper_row"]) for r in table) == [
        ("", "FedProx"),  # mu=0.01 is fedprox's default: the same setting as no mu at all
        ("fedprox.mu=0.2", ""),
        ("fedprox.mu=0.5", "FedProx"),
    ]


def test_the_gpu_execution_paths_are_the_same_setting_and_bf16_is_not(tmp_path):
    """The GPU paths (CUDA graphs, streams, stacked clients, compile,
    channels-last, deterministic kernels) compute the same maths: a run made
    with them is its paper row and pools with the plain run. Until session 36
    ``--cuda-graphs``, which benchmarks/gpu_session.sh always passes, kept
    every full-scale run from its paper row. bf16 is another setting."""
    import shutil

    from fedaval.api import run_training

    run_training(tiny_run_config(tmp_path / "plain", seed=1, plugins=["fedprox"]))
    flags = {
        "cuda_graphs": True,
        "cuda_graph_scope": "step",
        "client_streams": 4,
        "stack_clients": True,
        "compile": "inductor",
        "channels_last": True,
        "deterministic": True,
        "on_client_failure": "fail",
    }
    for name, changes in [("gpu", {**flags, "device": "cuda", "seed": 2}), ("bf16", {"precision": "bf16", "seed": 3})]:
        shutil.copytree(tmp_path / "plain", tmp_path / name)
        data = results(tmp_path / name)
        data["config"] = {**data["config"], **changes}
        (tmp_path / name / "results.json").write_text(json.dumps(data))
    table = fedprox_paper_report(tmp_path, ["plain", "gpu", "bf16"], '[paper.runs]\nFedProx = "-p fedprox"\n')
    assert sorted((r["setting"], r["paper_row"], r["final_accuracy_n"]) for r in table) == [
        ("precision=bf16", "", "1"),
        ("precision=fp32", "FedProx", "2"),
    ]


@pytest.mark.parametrize("damage", ["0.5", True, float("nan"), [1]])
def test_a_damaged_final_entry_is_a_one_line_error_not_a_silent_gap(runs, tmp_path, damage):
    """A string was read as a number (E 0.20 instead of 0.04 in the audit);
    a boolean or NaN left the run out of its column, a column no run had
    vanished from the report; all with exit status 0."""
    import shutil

    copy = tmp_path / "damaged"
    shutil.copytree(runs["a-s1"], copy)
    data = results(copy)
    data["final"]["efficiency"] = damage
    (copy / "results.json").write_text(json.dumps(data))
    line = one_line_error(["report", str(copy), "--no-figures", "--out-dir", str(tmp_path / "rep")])
    assert f"final.efficiency is {damage!r}, not a number or null; the file is damaged" in line


def test_utility_is_the_final_blocks_and_missing_stays_missing(runs, tmp_path):
    """Until session 35 a missing ``final.utility`` was replaced, unmarked, by the
    last round's U (another quantity: 40.89 against 34.98 in the audit)."""

    from fedaval.report import METRICS

    utility = next(m for m in METRICS if m.key == "utility")
    data = results(runs["a-s1"])
    assert utility.read(data) == data["final"]["utility"]
    data["final"].pop("utility")
    assert any(r.get("utility") is not None for r in data["rounds"])  # what was shown instead
    assert utility.read(data) is None


def test_a_run_without_a_global_model_gets_no_empty_accuracy_matrix(tmp_path):
    from fedaval.api import run_training
    from fedaval.report import write_report

    run_training(tiny_run_config(tmp_path / "pfcl", plugins=["pfcl"]))
    report = write_report([tmp_path / "pfcl"], tmp_path / "rep")
    assert not list((tmp_path / "rep").glob("matrix-*.png"))  # it was a blank 1x1 heatmap
    assert (tmp_path / "rep" / "accuracy.png") in report.files


def test_a_row_of_runs_from_different_fedaval_versions_says_so(runs):
    from fedaval.report import grouping_text

    loaded = load_runs([runs["a-s1"], runs["a-s2"]])
    assert "versions" not in grouping_text(group_runs(loaded))
    loaded[1].results = {  # a run written before session 35
        k: v for k, v in loaded[1].results.items() if k not in ("fedaval_version", "fedaval_source")
    }
    text = grouping_text(group_runs(loaded))
    assert f"runs of fedaval versions {loaded[0].results['fedaval_version']}, before session 35" in text


def test_runs_of_the_same_code_at_two_commits_are_not_called_mixed(runs):
    """A commit that changed only docs made every row of a batch spanning it
    'mixed' (session 36's HGP batch); the source digest says the code was
    the same."""
    from fedaval.report import grouping_text

    loaded = load_runs([runs["a-s1"], runs["a-s2"]])
    assert loaded[0].results["fedaval_source"] == loaded[1].results["fedaval_source"]
    loaded[1].results = {**loaded[1].results, "fedaval_version": "0.1.0+gother"}
    assert "versions" not in grouping_text(group_runs(loaded))
    loaded[1].results = {**loaded[1].results, "fedaval_source": "another"}
    assert "runs of fedaval versions" in grouping_text(group_runs(loaded))


def test_results_record_the_torch_threads_and_a_row_mixing_them_says_so(runs):
    """On the CPU another thread count gives other numbers (session 36's
    re-runs: 13.33 against 12.03 final accuracy at 1 and 2 threads);
    results.json did not say which a run had."""
    import torch

    from fedaval.report import grouping_text

    loaded = load_runs([runs["a-s1"], runs["a-s2"]])
    assert loaded[0].results["torch_threads"] == [torch.get_num_threads()]
    assert "torch threads" not in grouping_text(group_runs(loaded))
    loaded[1].results = {**loaded[1].results, "torch_threads": [torch.get_num_threads() + 1]}
    assert "runs with torch threads" in grouping_text(group_runs(loaded))


def test_a_resumed_run_adds_its_process_thread_count():
    from fedaval.coordinator import note_threads

    class OnWorkers:
        client_threads = 1

    results = {"torch_threads": [2]}
    note_threads(results, OnWorkers())
    note_threads(results, OnWorkers())
    assert results["torch_threads"] == [2, 1]
