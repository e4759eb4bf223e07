"""`fedaval train --config FILE.toml` and `--seeds`: file values applied, the
command line wins, unknown keys are one-line errors, seeds go to sibling
folders; every shipped preset parses and its core options validate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedaval.cli import cli, train
from fedaval.config_file import merge_options, parse_seeds, read_config_file, settings_per_seed
from fedaval.errors import FedavalUsageError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ALLOWED = {p.name for p in train.params if p.name != "config_path"}

FILE = """\
plugins = "fedavg"
rounds-per-task = 4
local_epochs = 2
lr = 0.05
download = true
device = "cpu"

[options.fcil-sync]
clients = 2
tasks = 2
alpha = 0.5
"""


@pytest.fixture
def captured(monkeypatch):
    """Replace training by a recorder of the settings it would get."""
    calls = []
    monkeypatch.setattr("fedaval.api.run_training", lambda settings, **kw: calls.append(settings))
    return calls


def invoke(*args):
    return CliRunner().invoke(cli, ["train", *map(str, args)])


def write(tmp_path, text, name="run.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_file_values_are_applied(tmp_path, captured):
    result = invoke("--config", write(tmp_path, FILE))
    assert result.exit_code == 0, result.output
    (settings,) = captured
    assert settings["plugins"] == ["fedavg"]
    assert (settings["rounds_per_task"], settings["local_epochs"], settings["lr"]) == (4, 2, 0.05)
    assert settings["download"] is True and settings["device"] == "cpu"
    assert settings["plugin_options"] == {"fcil-sync": {"clients": 2, "tasks": 2, "alpha": 0.5}}
    assert settings["batch_size"] == 32, "keys the file leaves out keep the CLI default"


def test_command_line_overrides_the_file(tmp_path, captured):
    result = invoke(
        "--config", write(tmp_path, FILE), "--lr", "0.2", "--rounds-per-task", "1", "-o", "fcil-sync.tasks=3"
    )
    assert result.exit_code == 0, result.output
    (settings,) = captured
    assert (settings["lr"], settings["rounds_per_task"], settings["local_epochs"]) == (0.2, 1, 2)
    assert settings["plugin_options"] == {"fcil-sync": {"clients": 2, "tasks": "3", "alpha": 0.5}}, (
        "-o replaces one key and keeps the file's others"
    )
    # also when the command-line value equals the default: it was given, it wins
    result = invoke("--config", write(tmp_path, FILE), "--lr", "0.01")
    assert captured[-1]["lr"] == 0.01


def test_unknown_key_is_a_one_line_error_naming_key_and_allowed(tmp_path, captured):
    result = invoke("--config", write(tmp_path, "roundz = 3\n" + FILE))
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1
    assert "unknown key 'roundz'" in lines[0] and "allowed:" in lines[0]
    assert "rounds-per-task" in lines[0] and "seeds" in lines[0] and "options" in lines[0]
    assert captured == []


@pytest.mark.parametrize(
    "text, message",
    [
        ('lr = "fast"\n', "bad value for 'lr'"),
        ("options = ['gldp.lam=0.5']\n", "must be tables"),
        ("[options]\ngldp = 1\n", "'options.gldp'"),
        ("lr = 0.1\nlr = 0.2\n", "not valid TOML"),
        ("seed = 1\nseeds = [1, 2]\n", "both 'seed' and 'seeds'"),
        ("rounds-per-task = 2\nrounds_per_task = 3\n", "given twice"),
        # TOML kinds click would truncate (1.5 -> 1) or fail on with a traceback (an integer for a flag)
        ("rounds-per-task = 1.5\n", "bad value for 'rounds-per-task' in"),
        ("seed = 1.7\n", "1.7 is not an integer"),
        ("deterministic = 1\n", "1 is not true or false"),
        ("lr = true\n", "True is not a number"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, captured, text, message):
    result = invoke("--config", write(tmp_path, text))
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and message in result.output, result.output


def test_seeds_make_one_settings_per_seed_in_sibling_folders():
    settings = {"out": "runs/x/", "seed": 0, "lr": 0.1}
    runs = settings_per_seed(settings, "42, 1999,2024")
    assert [(r["seed"], r["out"]) for r in runs] == [(42, "runs/x-s42"), (1999, "runs/x-s1999"), (2024, "runs/x-s2024")]
    assert all(r["lr"] == 0.1 for r in runs) and settings["seed"] == 0
    assert settings_per_seed({"out": None}, "1,2")[1] == {"out": None, "seed": 2}
    assert settings_per_seed(settings, None) == [settings]
    assert settings_per_seed(settings, "1,2", seed_from_cli=True) == [settings], "--seed beats a file's seeds"
    with pytest.raises(FedavalUsageError, match="not both"):
        settings_per_seed(settings, "1,2", seed_from_cli=True, seeds_from_cli=True)
    for bad in ["1,x", "1,1", ""]:
        with pytest.raises(FedavalUsageError, match="--seeds"):
            parse_seeds(bad)


def test_seeds_from_file_and_command_line(tmp_path, captured):
    path = write(tmp_path, "seeds = [5, 6]\n")
    assert invoke("--config", path, "--out", tmp_path / "o").exit_code == 0
    assert [(s["seed"], s["out"]) for s in captured] == [(5, str(tmp_path / "o-s5")), (6, str(tmp_path / "o-s6"))]
    captured.clear()
    assert invoke("--config", path, "--seed", "9").exit_code == 0
    assert [s["seed"] for s in captured] == [9]
    result = invoke("--seed", "9", "--seeds", "1,2")
    assert result.exit_code == 2 and "not both" in result.output


def test_train_seeds_runs_into_sibling_folders(tmp_path):
    """End to end: two tiny digits runs, each folder records its seed."""
    out = tmp_path / "run"
    result = invoke(
        "--seeds",
        "42,1999",
        "--out",
        out,
        "--quiet",
        "--device",
        "cpu",
        "--rounds-per-task",
        "1",
        "-o",
        "fcil-sync.clients=2",
        "-o",
        "fcil-sync.tasks=2",
    )
    assert result.exit_code == 0, result.output
    assert result.output.count("final global accuracy") == 2, "each run prints its summary"
    for seed in (42, 1999):
        folder = tmp_path / f"run-s{seed}"
        config = json.loads((folder / "config.json").read_text())
        assert (config["seed"], config["out"]) == (seed, str(folder))
        assert json.loads((folder / "results.json").read_text())["config"]["seed"] == seed
    assert not out.exists()


def test_merge_options_per_key():
    assert merge_options({"a": {"x": 1, "y": 2}}, {"a": {"y": "3"}, "b": {"z": "4"}}) == {
        "a": {"x": 1, "y": "3"},
        "b": {"z": "4"},
    }


@pytest.mark.parametrize("preset", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_every_preset_parses_and_its_core_options_validate(preset):
    """Not run (full-scale GPU settings): the keys are known, the core
    options and the scenario options validate, the plugins are installed
    entry points, and the dataset is one fedaval knows."""
    from fedaval.config import RunConfig
    from fedaval.datasets import DATASETS
    from fedaval.options import build_options
    from fedaval.plugin_manager import installed_plugins, split_plugin_specs
    from fedaval.scenarios import get_scenario

    values, options = read_config_file(preset, ALLOWED)
    for key, raw in values.items():  # each value fits its CLI option's type
        train_param = next(p for p in train.params if p.name == key)
        if key != "plugins":
            train_param.type_cast_value(None, raw)
    seeds = parse_seeds(values.pop("seeds")) if "seeds" in values else []
    assert all(isinstance(s, int) for s in seeds)
    values.pop("quiet", None)
    plugins = split_plugin_specs(values.pop("plugins"))
    config = RunConfig(plugins=plugins, plugin_options=options, **values)
    config.validate()
    assert config.dataset in DATASETS
    spec = get_scenario(config.scenario)
    build_options(spec.Options, options.get(spec.name, {}), owner=spec.name)
    assert set(options) <= {spec.name, *plugins}, "options only for this run's scenario and plugins"
    entry_points = installed_plugins()
    for name in plugins:  # the method's own options validate against its Options
        plugin = entry_points[name].load()
        if options.get(name):
            build_options(plugin.Options, options[name], owner=name)


def test_presets_cover_each_paper():
    names = {p.name for p in CONFIGS.glob("*.toml")}
    assert {
        "gldp-cifar10-sthfl.toml",
        "fedprok-cifar10-sync.toml",
        "pfcl-cifar100-random.toml",
        "hgp-cifar100.toml",
    } <= names
    assert (CONFIGS / "README.md").exists()


def test_command_line_plugins_drop_the_replaced_plugins_tables(tmp_path, captured):
    text = 'plugins = "fedprok"\n[options.fedprok]\nbeta = 0.3\n[options.fcil-sync]\nclients = 2\n'
    result = invoke("--config", write(tmp_path, text), "-p", "fedavg")
    assert result.exit_code == 0, result.output
    assert "its [options.fedprok] table is not used" in result.output
    (settings,) = captured
    assert settings["plugin_options"] == {"fcil-sync": {"clients": 2}}


def test_a_table_for_an_owner_never_named_is_kept_for_the_usual_error(tmp_path, captured):
    text = 'plugins = "fedprok"\n[options.fedprk]\nbeta = 0.3\n'
    result = invoke("--config", write(tmp_path, text), "-p", "fedavg")
    (settings,) = captured
    assert settings["plugin_options"] == {"fedprk": {"beta": 0.3}}  # build_run then names it
    assert "not used" not in result.output


def test_command_line_scenario_drops_the_files_scenario_table(tmp_path, captured):
    result = invoke("--config", write(tmp_path, 'scenario = "fcil-sync"\n' + FILE), "--scenario", "fcl-random")
    assert result.exit_code == 0, result.output
    (settings,) = captured
    assert "fcil-sync" not in settings["plugin_options"]


def test_a_rows_arguments_at_the_papers_scale():
    """``[paper.full-scale.runs]`` replaces a row's arguments, ``[paper.full-scale]``'s
    ``args`` follow every row's (what gpu_session.sh --full-scale runs)."""
    from fedaval.config_file import full_scale_runs

    paper = {
        "runs": {"FedAvg": "-p fedavg", "FedRep": "-p fedrep -o fedrep.head_epochs=2", "GLDP": ""},
        "full-scale": {"args": "--local-epochs 30", "runs": {"FedRep": "-p fedrep -o fedrep.head_epochs=20"}},
    }
    assert full_scale_runs(paper) == {
        "FedAvg": "-p fedavg --local-epochs 30",
        "FedRep": "-p fedrep -o fedrep.head_epochs=20 --local-epochs 30",
        "GLDP": "--local-epochs 30",
    }
    assert full_scale_runs({"runs": {"FedAvg": "-p fedavg"}}) == {"FedAvg": "-p fedavg"}
