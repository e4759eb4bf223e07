"""A plugin written outside the package, loaded by import path, proves the public API is enough."""

from __future__ import annotations

import json
import sys
import textwrap

import torch
from click.testing import CliRunner

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
