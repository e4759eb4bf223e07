"""A plugin written outside the package, loaded by import path, proves the public API is enough."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner
from helpers import one_line_error

from fedaval import hookimpl
from fedaval.cli import cli

PLUGIN = '''
from dataclasses import dataclass

import torch

from fedaval import hookimpl
from fedaval.options import option
from fedaval.plugin import Plugin


class Shrink(Plugin):
    """Adds an L2 term to every local loss and fuses by keeping only client 0."""

    name = "shrink"

    @dataclass
    class Options:
        weight: float = option(0.5, "L2 weight")

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        l2 = sum((p ** 2).sum() for p in client.model.classifier.parameters())
        return {"shrink_l2": self.options.weight * l2}

    @hookimpl
    def fedaval_server_fuse_weights(self, run, uploads, global_weights):
        self.fused_from = uploads[0].client_id
        torch.save(uploads[0].get("weights"), run.out_dir / "client0_weights.pt")
        return uploads[0].get("weights")

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        torch.save(run.server.model.state_dict(), run.out_dir / "global_weights.pt")
'''


def test_third_party_plugin_adds_a_loss_term_and_replaces_fusion(tmp_path, monkeypatch):
    package = tmp_path / "thirdparty"
    package.mkdir()
    (package / "mymethod.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(package))
    out = tmp_path / "run"
    result = CliRunner().invoke(
        cli,
        [
            "train",
            "--plugins",
            "mymethod:Shrink",
            "-o",
            "shrink.weight=2.0",
            "-o",
            "fcil-sync.clients=2",
            "-o",
            "fcil-sync.tasks=2",
            "--rounds-per-task",
            "1",
            "--device",
            "cpu",
            "--quiet",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["plugins"][:2] == ["fedavg", "shrink"]
    losses = results["rounds"][0]["losses"]
    # the term is logged by name and is part of the total
    assert losses["loss/shrink_l2"] > 0
    assert abs(losses["loss/total"] - losses["loss/classification"] - losses["loss/shrink_l2"]) < 1e-4
    # fusion replaced: the final global weights are client 0's upload, not an average
    client0 = torch.load(out / "client0_weights.pt")
    global_state = torch.load(out / "global_weights.pt")
    sys.modules.pop("mymethod", None)
    assert client0 and all(torch.equal(global_state[k], v) for k, v in client0.items())
    assert json.loads((out / "config.json").read_text())["plugin_options"]["shrink"] == {"weight": "2.0"}


# --- a third party's mistakes: named, one line, never silent (session-35 audit) -------------------


class BroadcastFuse:
    """Fuses every weight into a one-element tensor: copied in, it would be
    broadcast over the whole weight and the run would end at chance."""

    name = "broadcast"

    @hookimpl
    def fedaval_server_fuse_weights(self, run, uploads, global_weights):
        return {key: torch.zeros(1) for key in global_weights}


class NarrowScores:
    """Evaluation scores over 5 of digits' 10 classes."""

    name = "narrow"

    @hookimpl
    def fedaval_classify(self, run, client, model, features, training):
        logits = model.classifier(features)
        return logits if training else logits[:, :5]


class Metrics:
    name = "metrics"

    def __init__(self, value):
        self.value = value

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        return {"m": self.value}


class NumpyUpload:
    name = "numpyup"

    @hookimpl
    def fedaval_client_upload(self, run, client):
        import numpy as np

        return {"counts": np.zeros(3)}


class HoldsALock:
    name = "holdslock"

    def __init__(self):
        import threading

        self.lock = threading.Lock()


@pytest.mark.parametrize(
    "plugin, message",
    [
        (BroadcastFuse(), r"fedaval_server_fuse_weights returned '[^']+' as Tensor \(1,\); the global model's is "),
        (NarrowScores(), r"fedaval_classify returned scores of shape \(\d+, 5\) in evaluation; expected \(\d+, 10\)"),
        (Metrics("abc"), r"plugin 'metrics': fedaval_round_metrics returned 'm' = 'abc'; expected a number"),
        (NumpyUpload(), r"a payload holds a ndarray; payloads are tensors"),
        (HoldsALock(), r"cannot save the run's state: .*plugin 'holdslock' holds it in attribute 'lock'"),
    ],
)
def test_a_plugin_returning_what_the_core_cannot_use_stops_the_run_naming_it(tiny_config, tmp_path, plugin, message):
    from fedaval.api import run_training
    from fedaval.errors import PluginError

    with pytest.raises(PluginError, match=message):
        run_training(tiny_config(on_client_failure="fail", checkpoint_every=1), extra_plugins=[plugin])


class FusesProtos:
    """A server-fusion plugin returning the download entry ``protos``."""

    def __init__(self, name):
        self.name = name

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        return {"protos": torch.zeros(2)}


class FusesWeights:
    name = "fusesweights"

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        return {"weights": {}}


class ReplacesWeights:
    name = "replacesweights"

    @hookimpl
    def fedaval_server_download(self, run, client, download):
        return {"weights": {}}


@pytest.mark.parametrize(
    "plugins, message",
    [
        (
            [FusesProtos("one"), FusesProtos("two")],
            r"two plugins return the download entry 'protos' \(fedaval_server_fuse is implemented by 'one', 'two'\)",
        ),
        ([FusesWeights()], r"may not return 'weights'; .*\(fedaval_server_fuse is implemented by 'fusesweights'\)"),
        ([ReplacesWeights()], r"may not replace broadcast entries: weights \(implemented by 'replacesweights'\)"),
    ],
)
def test_clashing_entries_stop_the_run_naming_the_plugins_that_could_have_returned_them(tiny_config, plugins, message):
    """pluggy's results do not say which plugin returned which: the error
    names the hook's implementers (before: no plugin named, or a traceback)."""
    from fedaval.api import run_training
    from fedaval.errors import PluginError

    with pytest.raises(PluginError, match=message):
        run_training(tiny_config(), extra_plugins=plugins)


def test_a_one_element_tensor_metric_is_written_as_a_number(tiny_config, tmp_path):
    import numpy as np

    from fedaval.api import run_training

    results = run_training(tiny_config(), extra_plugins=[Metrics(torch.tensor(1.5))])
    assert results["rounds"][0]["plugin_metrics"]["metrics"] == {"m": 1.5}
    results = run_training(tiny_config(out=tmp_path / "np"), extra_plugins=[Metrics(np.float32(2.5))])  # a NumPy scalar
    assert results["rounds"][0]["plugin_metrics"]["metrics"] == {"m": 2.5}


def test_a_hook_argument_the_spec_lacks_undecorated_options_and_a_taken_name_are_one_line_errors(tmp_path, monkeypatch):
    (tmp_path / "typos.py").write_text(
        textwrap.dedent(
            """
            from fedaval import hookimpl
            from fedaval.plugin import Plugin


            class Clinet(Plugin):
                name = "clinet"

                @hookimpl
                def fedaval_client_loss(self, run, clinet, batch):
                    return None


            class NameClash(Plugin):
                name = "fedprox"


            class Undecorated(Plugin):
                name = "undecorated"

                class Options:
                    weight: float = 1.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    line = one_line_error(["train", "--plugins", "typos:Clinet", "--out", str(tmp_path / "a")])
    assert "plugin 'clinet', hook 'fedaval_client_loss': Argument(s) {'clinet'} are declared in the hookimpl" in line
    line = one_line_error(["train", "--plugins", "typos:Undecorated", "--out", str(tmp_path / "b")])
    assert "plugin 'undecorated': its Options is not a dataclass; decorate it with @dataclass" in line
    line = one_line_error(["train", "--plugins", "typos:NameClash", "--out", str(tmp_path / "c")])
    assert "plugin 'typos:NameClash' calls itself 'fedprox', the name of the installed plugin" in line


def test_fedaval_traceback_shows_where_a_failing_client_hook_raised(tmp_path, monkeypatch):
    """A client's failure is one line (with where the plugin raised it);
    ``FEDAVAL_TRACEBACK=1`` prints the whole chain above it."""
    (tmp_path / "raising.py").write_text(
        textwrap.dedent(
            """
            from fedaval import hookimpl


            class Boom:
                name = "boom"

                @hookimpl
                def fedaval_client_loss(self, run, client, batch):
                    raise ValueError("boom in my loss")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["train", "--plugins", "raising:Boom", "--on-client-failure", "fail", "--quiet", "--rounds-per-task", "1"]
    plain = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "a")])
    assert plain.exit_code == 1 and "Traceback" not in plain.output
    monkeypatch.setenv("FEDAVAL_TRACEBACK", "1")
    shown = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "b")])
    assert shown.exit_code == 1 and "Traceback" in shown.output
    assert 'raising.py", line 10, in fedaval_client_loss' in shown.output
    assert shown.output.rstrip().splitlines()[-1].startswith("fedaval: run stopped: client ")
