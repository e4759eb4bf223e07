"""Property test (hypothesis): ``fedaval train`` with random option values
ends with status 0 or 2, never a traceback (issue 19).

The command runs in-process, as a user would call it, through parsing,
validation, plugin loading, data loading, the partition and the set-up of
server and clients. Only the training loop itself is replaced by a stub
returning an empty results.json (training is what the rest of the suite
runs; here it would make each example take seconds)."""

from __future__ import annotations

import itertools

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedaval.cli import cli

pytestmark = pytest.mark.slow  # whole trainings

INTS = st.integers(min_value=-3, max_value=2**33)
SMALL_INTS = st.integers(min_value=-2, max_value=8)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32) | st.sampled_from([0.0, 0.01, 0.5, 1.0])

OPTIONS = {
    "--seed": INTS,
    "--seeds": st.sampled_from(["1,2", "1,-2", "3,3", "a,b", str(2**32), "7"]),
    "--lr": FLOATS,
    "--momentum": FLOATS,
    "--weight-decay": FLOATS,
    "--utility-lambda": FLOATS,
    "--client-gpus": FLOATS,
    "--rounds-per-task": SMALL_INTS,
    "--local-epochs": SMALL_INTS,
    "--clients-per-round": st.integers(min_value=-2, max_value=1000),
    "--batch-size": SMALL_INTS,
    "--eval-every": SMALL_INTS,
    "--checkpoint-every": SMALL_INTS,
    "--keep-checkpoints": SMALL_INTS,
    "--device": st.sampled_from(["cpu", "tpu", "cuda:x"]),
    "--data-path": st.sampled_from(["auto", "device", "loader", "gpu"]),
    "--offload-clients": st.sampled_from(["auto", "none", "cpu", "disk", "tape"]),
    "--host-memory": st.sampled_from(["keep", "release", "free"]),
    "--checkpoint-writer": st.sampled_from(["auto", "thread", "fork"]),
    "--backend": st.sampled_from(["local", "spark"]),  # not ray: starting Ray takes seconds
    "--on-client-failure": st.sampled_from(["drop", "fail", "retry"]),
    "--scenario": st.sampled_from(["fcil-sync", "fcil-async", "sthfl", "fcl-random", "nosuch"]),
    "--dataset": st.sampled_from(["digits", "nosuch", "cifar10"]),
    "--model": st.sampled_from(["auto", "mlp", "cnn", "vgg"]),
    "--plugins": st.sampled_from(
        ["fedavg", "fedprox", "fedrep", "gldp,fedrep", "fednova,gldp", "nosuch", "os:path", "fedlwf,fedreplay"]
    ),
    "-o": st.sampled_from(
        [
            "fedprox.mu=abc",
            "fedprox.mu=-1",
            "fedprox.mu=0.1",
            "nosuch.x=1",
            "noequals",
            "x=1",
            "avalanche.ewc_lambda=abc",
        ]
    ),
}
SCENARIO_OPTIONS = st.sampled_from(["clients", "tasks"]).flatmap(
    lambda key: st.integers(min_value=-1, max_value=6).map(lambda v: f"{key}={v}")
)

_folders = itertools.count()


@pytest.fixture(scope="module")
def stub_training():
    """Replace the training loop by an empty, complete results.json."""
    import fedaval.api

    def fake_train(run, results, show_progress, time_limit=None):
        return {
            "plugins": run.plugins.names,
            "config": run.config.to_dict(),
            "scenario": {"num_tasks": run.num_tasks},
            "final": {},
            "rounds": [],
            "status": {"state": "complete"},
        }

    mp = pytest.MonkeyPatch()
    mp.setattr(fedaval.api, "_train", fake_train)
    yield
    mp.undo()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    chosen=st.dictionaries(st.sampled_from(sorted(OPTIONS)), st.none(), max_size=5).flatmap(
        lambda keys: st.fixed_dictionaries({k: OPTIONS[k] for k in keys})
    ),
    scenario_options=st.lists(SCENARIO_OPTIONS, max_size=2),
)
def test_random_options_end_with_status_0_or_2_and_no_traceback(
    tmp_path_factory, stub_training, chosen, scenario_options
):
    scenario = chosen.get("--scenario", "fcil-sync")
    args = ["train", "--quiet", "--out", str(tmp_path_factory.getbasetemp() / f"prop-{next(_folders)}")]
    if "--device" not in chosen:
        args += ["--device", "cpu"]
    for name, value in chosen.items():
        args += [name, str(value)]
    for item in scenario_options:
        args += ["-o", f"{scenario}.{item}"]
    if scenario == "fcil-sync" and not scenario_options:
        args += ["-o", "fcil-sync.clients=2", "-o", "fcil-sync.tasks=2"]  # keep the set-up small
    result = CliRunner().invoke(cli, args)
    assert result.exit_code in (0, 2), f"{args}\n{result.output}\n{result.exception!r}"
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.exception)
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("fedaval: error: "), result.stderr
