"""The attack plugin during training, and ``fedaval attack`` on a finished
run: the attack measures without changing the run."""

from __future__ import annotations

import json
import re
import shutil

import pytest

pytest.importorskip("breaching")

from helpers import strip_timing  # noqa: E402

from fedaval.api import run_training  # noqa: E402

ATTACK = "fedaval.plugins.attack:Attack"
DP = "fedaval.plugins.dp:DP"
FAST = {"iterations": "20", "every": "2"}


def comparable(results):
    """results.json without what naming the attack plugin changes."""
    out = strip_timing(results)
    for key in ("privacy", "plugins", "config", "options"):
        out.pop(key, None)
    return out


def test_attacking_during_training_changes_no_training_result(tiny_config, tmp_path):
    plain = run_training(tiny_config(plugins=["fedprok"], out=tmp_path / "plain"))
    attacked = run_training(
        tiny_config(plugins=["fedprok", ATTACK], plugin_options={"attack": FAST}, out=tmp_path / "attacked")
    )
    assert comparable(attacked) == comparable(plain)
    assert "privacy" not in plain
    block = attacked["privacy"]["attack"]
    # rounds 2 and 4, one client each, a weights attack and a prototype attack per upload
    assert sorted({(a["round"], a["kind"]) for a in block["attacks"]}) == [
        (2, "prototypes"),
        (2, "weights"),
        (4, "prototypes"),
        (4, "weights"),
    ]
    for a in block["attacks"]:
        assert a["p"] == pytest.approx(1 - 1 / (1 + a["mse"]))
        assert 0 < a["p_guess"] < 1 and a["psnr_guess"] > 0  # the data-free guess, scored alike
        assert (tmp_path / "attacked" / "privacy" / a["grid"].split("/")[-1]).is_file()
    assert set(block["mean"]) == {"weights", "prototypes"}
    assert all("p_guess" in m for m in block["mean"].values())
    events = list((tmp_path / "attacked" / "tb").glob("events.*"))
    assert events and max(e.stat().st_size for e in events) > 0


def test_prototypes_are_inverted_through_the_weights_the_client_uploaded(tiny_config, tmp_path, monkeypatch):
    """FedProK's first task takes prototypes under the trained weights it
    uploads: the attacker, who has them, inverts through those."""
    import torch

    from fedaval import attack_math, hookimpl

    class Uploads:
        weights: dict = {}

        @hookimpl(tryfirst=True)
        def fedaval_server_fuse(self, run, uploads, round):
            self.weights[round] = {u.client_id: u.get("weights") for u in uploads}

    used = []

    def recorded(features, prototype, shape, *args, **kwargs):
        used.append({k: v.clone() for k, v in features.state_dict().items()})
        return torch.zeros((1, *shape))

    monkeypatch.setattr(attack_math, "invert_prototype", recorded)
    uploads = Uploads()
    results = run_training(
        tiny_config(plugins=["fedprok", ATTACK], plugin_options={"attack": FAST}, out=tmp_path / "run"),
        extra_plugins=[uploads],
    )
    attack = next(a for a in results["privacy"]["attack"]["attacks"] if a["kind"] == "prototypes")
    assert attack["round"] == 2 and used  # round 2 is in the first task
    sent = uploads.weights[2][attack["client"]]
    features = {k.removeprefix("features."): v for k, v in sent.items() if k.startswith("features.")}
    assert features and all(torch.equal(used[0][k], v) for k, v in features.items())


def test_dp_and_attack_compose_and_dp_noise_is_seen_by_the_attacker(tiny_config, tmp_path):
    results = run_training(
        tiny_config(
            plugins=["fedavg", DP, ATTACK],
            plugin_options={"attack": FAST, "dp": {"clip": "0.1", "noise": "1.0"}},
            out=tmp_path / "dp",
        )
    )
    assert results["privacy"]["dp"]["epsilon"] > 0
    assert [a["kind"] for a in results["privacy"]["attack"]["attacks"]] == ["weights", "weights"]


def test_fedaval_attack_replays_a_round_of_a_finished_run(tiny_config, tmp_path):
    from click.testing import CliRunner

    from fedaval.cli import cli

    out = tmp_path / "live"
    live = run_training(
        tiny_config(
            plugins=["fedprok", ATTACK], plugin_options={"attack": {**FAST, "ids": "1"}}, out=out, keep_checkpoints=10
        )
    )
    before = (out / "results.json").read_text()
    res = CliRunner().invoke(cli, ["attack", str(out), "--round", "2", "--clients", "1", "--iterations", "20"])
    assert res.exit_code == 0, res.output
    block = json.loads(res.stdout)
    # the replay sees exactly the uploads of the run: same numbers as attacking live
    live_round2 = [a for a in live["privacy"]["attack"]["attacks"] if a["round"] == 2]
    assert [(a["kind"], a["client"]) for a in block["attack"]["attacks"]] == [("weights", 1), ("prototypes", 1)]
    for a, b in zip(block["attack"]["attacks"], live_round2):
        assert a["mse"] == pytest.approx(b["mse"], rel=1e-5)
    assert (out / "results.json").read_text() == before  # the run folder's results are untouched
    bad = CliRunner().invoke(cli, ["attack", str(out), "--round", "9"])
    assert bad.exit_code == 2 and "round" in bad.output
    # a privacy/ that is a file and a truncated checkpoint: one-line errors, not tracebacks
    shutil.move(out / "privacy", tmp_path / "grids")
    (out / "privacy").write_text("x")
    bad = CliRunner().invoke(cli, ["attack", str(out), "--round", "2", "--iterations", "2"])
    assert bad.exit_code == 2 and "cannot be made" in bad.output and "Traceback" not in bad.output
    (out / "privacy").unlink()
    with open(out / "checkpoints" / "round-000001.ckpt", "r+b") as fh:
        fh.truncate(100)
    bad = CliRunner().invoke(cli, ["attack", str(out), "--round", "2", "--iterations", "2"])
    assert bad.exit_code == 2 and "cannot be read" in bad.output and "Traceback" not in bad.output


def test_the_data_free_guess_is_each_labels_mean_test_image():
    import types

    import torch

    from fedaval.plugins.attack import label_mean_images

    x = torch.tensor([[[[0]]], [[[255]]], [[[51]]]], dtype=torch.uint8)  # three 1x1 grey images
    data = types.SimpleNamespace(test_x=x, test_y=torch.tensor([0, 0, 1]))
    guess = label_mean_images(types.SimpleNamespace(data=data), torch.tensor([1, 0]))
    assert guess.shape == (2, 1, 1, 1)
    assert guess.flatten().tolist() == pytest.approx([0.2, 0.5])


def test_a_grid_folder_that_cannot_be_made_is_refused_before_training(tiny_config, tmp_path):
    from fedaval.errors import FedavalUsageError

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(FedavalUsageError, match="attack.folder=.* cannot be made"):
        run_training(
            tiny_config(
                plugins=["fedavg", ATTACK],
                plugin_options={"attack": {**FAST, "folder": str(tmp_path / "a-file")}},
                out=tmp_path / "run",
            )
        )
    assert not (tmp_path / "run").exists()  # refused while built: no half run left


@pytest.mark.parametrize(
    "options, message",
    [({"ids": "9"}, "bad value attack.ids=[9]; the run's are 0..1"), ({"rounds": "99"}, "attack.rounds=[99]")],
)
def test_clients_or_rounds_the_run_does_not_have_are_refused(tiny_config, tmp_path, options, message):
    """Out of range, nothing was attacked and nothing said."""
    from fedaval.errors import FedavalUsageError

    with pytest.raises(FedavalUsageError, match=re.escape(message)):
        run_training(tiny_config(plugins=["fedavg", ATTACK], plugin_options={"attack": options}, out=tmp_path / "r"))
