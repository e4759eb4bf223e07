"""Scenarios, datasets and models are open registries: a plugin outside the
package adds one of each and a run uses them (fedaval/registries.py)."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from fedaval.cli import cli
from fedaval.errors import FedavalUsageError
from fedaval.plugin_manager import get_plugin_manager, load_plugins
from fedaval.registries import collect

PLUGIN = '''
import numpy as np
import torch
from torch import nn

from fedaval import hookimpl
from fedaval.datasets import ImageData, load_dataset
from fedaval.models import SplitModel
from fedaval.options import option
from fedaval.scenarios import ScenarioSpec
from fedaval.scenarios.partition import ClientTasks, Partition
from dataclasses import dataclass


@dataclass
class HalvesOptions:
    clients: int = option(2, "clients, each with every class")


def halves(options, labels, num_classes, rng):
    """Two tasks, the lower and the upper half of the classes; each client a random share."""
    classes = [list(range(num_classes // 2)), list(range(num_classes // 2, num_classes))]
    owner = rng.integers(0, options.clients, size=len(labels))
    clients = []
    for k in range(options.clients):
        indices = [np.flatnonzero((owner == k) & np.isin(labels, c)) for c in classes]
        clients.append(ClientTasks(classes=classes, indices=indices))
    return Partition(clients=clients)


def even_digits(root, download):
    """scikit-learn's digits, even classes only (relabelled 0..4)."""
    data = load_dataset("digits")
    keep_train = data.train_y % 2 == 0
    keep_test = data.test_y % 2 == 0
    return ImageData("even-digits", data.train_x[keep_train], data.train_y[keep_train] // 2,
                     data.test_x[keep_test], data.test_y[keep_test] // 2,
                     [str(c) for c in range(0, 10, 2)], data.mean, data.std)


def linear(input_shape, num_classes):
    size = int(np.prod(input_shape))
    return SplitModel(nn.Flatten(), nn.Linear(size, num_classes), size)


class Extras:
    name = "extras"

    @hookimpl
    def fedaval_register_scenarios(self, register):
        register("halves", ScenarioSpec("halves", "two halves of the classes", HalvesOptions, halves, "test"))

    @hookimpl
    def fedaval_register_datasets(self, register):
        register("even-digits", even_digits)

    @hookimpl
    def fedaval_register_models(self, register):
        register("linear", linear)
'''


@pytest.fixture
def extras_module(tmp_path, monkeypatch):
    (tmp_path / "thirdparty_extras.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "thirdparty_extras:Extras"
    sys.modules.pop("thirdparty_extras", None)


def test_a_third_party_scenario_dataset_and_model_run(extras_module, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(
        cli,
        [
            "train",
            "--plugins",
            extras_module,
            "--scenario",
            "halves",
            "-o",
            "halves.clients=3",
            "--dataset",
            "even-digits",
            "--model",
            "linear",
            "--rounds-per-task",
            "1",
            "--quiet",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["scenario"]["num_tasks"] == 2
    assert results["scenario"]["federation_task_classes"] == [[0, 1], [2, 3, 4]]  # 5 even digits
    assert len(results["scenario"]["client_task_classes"]) == 3
    assert results["final"]["accuracy"] > 0.3  # a linear model learns even digits


def test_an_unknown_name_lists_what_plugins_registered(extras_module, tmp_path):
    result = CliRunner().invoke(
        cli,
        [
            "train",
            "--plugins",
            extras_module,
            "--model",
            "lineer",
            "--quiet",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "run"),
        ],
    )
    assert result.exit_code == 2
    assert "unknown model 'lineer'" in result.output and "linear" in result.output


def test_the_builtins_are_registered_like_anyone_else():
    from fedaval.core import CorePlugin

    pm = get_plugin_manager()
    load_plugins(pm, [], {}, extra=[CorePlugin()])
    assert {"sthfl", "fcil-sync", "fcil-async", "fcl-random"} <= set(collect(pm, "scenarios"))
    assert {"digits", "cifar10", "tiny-imagenet", "imagefolder"} <= set(collect(pm, "datasets"))
    assert {"mlp", "cnn", "resnet18"} <= set(collect(pm, "models"))


class Clash:
    name = "clash"

    from fedaval import hookimpl

    @hookimpl
    def fedaval_register_models(self, register):
        register("cnn", lambda shape, n: None)


def test_a_name_registered_twice_names_both_plugins():
    from fedaval.core import CorePlugin

    pm = get_plugin_manager()
    load_plugins(pm, [], {}, extra=[CorePlugin(), Clash()])
    with pytest.raises(FedavalUsageError, match="model 'cnn' is registered by both plugin 'core' and plugin 'clash'"):
        collect(pm, "models")
