"""--offload-clients: clients not sampled next round keep only a pickle, with no change to any result."""

from __future__ import annotations

import pytest
import torch
from helpers import strip_timing

METHODS = {
    "fedavg": dict(plugins=["fedavg"]),
    # GLDP's round metrics read every client's model from the server side
    "gldp": dict(
        plugins=["gldp"], scenario="sthfl", scenario_options={"clients": 4, "tasks": 2, "classes_per_task": 2}
    ),
    "pfcl": dict(plugins=["pfcl"], scenario="fcl-random", scenario_options={"clients": 4}),
    "replay": dict(plugins=["avalanche:ReplayPlugin"], plugin_options={"avalanche": {"mem_size": "40"}}),
}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_results_do_not_depend_on_where_clients_wait(tiny_config, tmp_path, method):
    from fedaval.api import run_training

    settings = dict(scenario_options={"clients": 4, "tasks": 2}, clients_per_round=2, eval_every=2, rounds_per_task=3)
    settings.update(METHODS[method])
    results = {}
    for where in ("none", "cpu", "disk"):
        out = strip_timing(run_training(tiny_config(out=str(tmp_path / where), offload_clients=where, **settings)))
        out["config"].pop("offload_clients")
        results[where] = out
    assert results["none"] == results["cpu"] == results["disk"]
    assert len(list((tmp_path / "disk" / "clients").glob("client-*.state"))) == 4


def test_offloaded_clients_hold_a_pickle_and_come_back_on_use(tiny_config):
    from fedaval.build import build_run
    from fedaval.coordinator import run_round

    run = build_run(
        tiny_config(scenario_options={"clients": 4, "tasks": 2}, clients_per_round=1, offload_clients="auto")
    )
    assert all(c.offloaded for c in run.clients)  # offloaded as they were built
    assert all("model" not in vars(c) and "strategy" not in vars(c) for c in run.clients)
    run.server.begin_task(0)
    run_round(run, 1)
    upcoming = set(run.schedule[1])
    assert all(c.offloaded for c in run.clients if c.id not in upcoming)
    assert not any(run.clients[k].offloaded for k in set(run.schedule[0]) & upcoming)  # no pointless round trip
    idle = next(c for c in run.clients if c.id not in upcoming)
    weights = idle.model.state_dict()  # reading a heavy part brings the client back
    assert not idle.offloaded and isinstance(weights["classifier.weight"], torch.Tensor)
    assert idle.bridge.client is idle and idle.strategy.model is idle.model
    assert idle.strategy.optimizer.param_groups[0]["params"][0] is next(idle.model.parameters())


def test_auto_keeps_everyone_live_when_all_train_every_round(tiny_config):
    from fedaval.build import build_run

    assert not any(c.offloaded for c in build_run(tiny_config(offload_clients="auto")).clients)


def test_resume_with_offloaded_clients(tiny_config, tmp_path):
    from fedaval import checkpoint
    from fedaval.api import run_training
    from fedaval.build import build_run
    from fedaval.coordinator import train

    config = tiny_config(
        out=str(tmp_path / "whole"),
        scenario_options={"clients": 4, "tasks": 2},
        clients_per_round=2,
        offload_clients="disk",
        keep_checkpoints=10,
    )
    whole = strip_timing(run_training(config))
    run = build_run(config, out_dir=tmp_path / "resumed")
    results = checkpoint.restore(run, checkpoint.path_for(tmp_path / "whole", 3))
    assert strip_timing(train(run, results=results)) == whole
