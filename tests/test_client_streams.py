"""--client-streams K: a round's clients issued on K CUDA streams (fedaval/cuda_streams.py).

On the CPU the streams are stood in by objects that record what the backend asks of them: which
stream each client's work is issued on, and the waits between the streams and the default one. The
GPU test at the end runs real streams (FEDAVAL_TEST_DEVICE=cuda)."""

from __future__ import annotations

import pytest
import torch
from helpers import TEST_DEVICE, one_line_error, stand_in_cuda_streams, strip_timing

from fedaval import hookimpl
from fedaval.errors import FedavalUsageError


@pytest.fixture
def fake_streams(monkeypatch):
    """torch.cuda's stream calls stood in (helpers.stand_in_cuda_streams), the round's read logged too:
    returns the log of waits and reads, and the stack of current streams."""
    from fedaval import backends, cuda_streams

    log, current = stand_in_cuda_streams(monkeypatch)
    monkeypatch.setattr(cuda_streams, "check", lambda config, device: None)
    settle = backends.local.settle
    monkeypatch.setattr(
        backends.local, "settle", lambda results: (log.append(("settle", current[-1].name)), settle(results))
    )
    cuda_streams._streams.cache_clear()
    yield log, current
    cuda_streams._streams.cache_clear()


class WhereClientsRun:
    """Logs the stream current while each client receives, trains and uploads."""

    name = "where_clients_run"

    def __init__(self, log: list, current: list):
        self.log, self.current = log, current

    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        self.log.append(("receive", run.round, client.id, self.current[-1].name))

    @hookimpl
    def fedaval_client_upload(self, run, client):
        self.log.append(("upload", run.round, client.id, self.current[-1].name))


def test_each_client_runs_on_its_stream_after_the_default_one_and_before_the_round_reads(
    tiny_config, tmp_path, fake_streams
):
    """3 clients a round on 2 streams: the round's first and third clients on the first stream, the second
    on the second; each stream waits for the default stream before each client's work, the default waits
    for both before the round's one read, and the results are those of one stream."""
    from fedaval.api import run_training

    log, current = fake_streams
    settings = dict(scenario_options={"clients": 3, "tasks": 2}, momentum=0.9, rounds_per_task=2)
    results = {}
    for k in (1, 2):
        log.clear()
        config = tiny_config(out=str(tmp_path / str(k)), client_streams=k, **settings)
        results[k] = strip_timing(run_training(config, extra_plugins=[WhereClientsRun(log, current)]))
        results[k]["config"].pop("client_streams")
    assert results[2] == results[1]

    rounds = [e for e in log if e[0] in ("receive", "upload")]
    assert {(e[1], e[2], e[3]) for e in rounds if e[0] == "receive"} == {
        (r, c, "s0" if c != 1 else "s1") for r in range(1, 5) for c in range(3)
    }
    assert all(e[3] == next(f[3] for f in rounds if f[0] == "receive" and f[1:3] == e[1:3]) for e in rounds)
    first_round = log[: next(i for i, e in enumerate(log) if e[0] == "settle") + 1]
    assert first_round == [
        ("wait", "s0", "default"),
        ("receive", 1, 0, "s0"),
        ("upload", 1, 0, "s0"),
        ("wait", "s1", "default"),
        ("receive", 1, 1, "s1"),
        ("upload", 1, 1, "s1"),
        ("wait", "s0", "default"),
        ("receive", 1, 2, "s0"),
        ("upload", 1, 2, "s0"),
        ("wait", "default", "s0"),
        ("wait", "default", "s1"),
        ("settle", "default"),
    ]
    assert [e for e in log if e[0] == "settle"] == [("settle", "default")] * 4


def test_one_stream_issues_everything_on_the_default_stream(tiny_config, fake_streams):
    from fedaval.api import run_training

    log, current = fake_streams
    run_training(tiny_config(), extra_plugins=[WhereClientsRun(log, current)])
    assert {e[3] for e in log if e[0] == "receive"} == {"default"}
    assert not [e for e in log if e[0] == "wait"]


def test_client_streams_on_the_cpu_or_with_ray_or_out_of_range_is_a_one_line_error(tmp_path):
    from fedaval.config import RunConfig
    from fedaval.cuda_streams import check

    line = one_line_error(["train", "--client-streams", "4", "--device", "cpu", "--out", str(tmp_path / "a")])
    assert (
        line
        == "fedaval: error: --client-streams 4 needs a CUDA device; --device cpu is cpu: use --client-streams 1 or a GPU"
    )
    line = one_line_error(["train", "--client-streams", "0", "--out", str(tmp_path / "b")])
    assert line == "fedaval: error: bad value --client-streams 0; must be an integer from 1 to 64"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(FedavalUsageError) as error:
        check(RunConfig(client_streams=2, backend="ray"), torch.device("cuda"))
    assert (
        str(error.value) == "--client-streams 2 needs --backend local (the clients of one process), not --backend ray"
    )
    check(RunConfig(client_streams=1, backend="ray"), torch.device("cpu"))  # one stream asks nothing


@pytest.mark.skipif(not TEST_DEVICE.startswith("cuda"), reason="CUDA streams need a GPU (FEDAVAL_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("graphs", [None, "features", "step"])
def test_on_a_gpu_clients_on_streams_give_the_results_of_one_stream(tiny_config, tmp_path, graphs):
    """Real streams, 4 clients a round on 3 of them, under --deterministic (tiny_config's on a GPU): the
    same results.json as the clients issued on one stream, without CUDA graphs and with either scope."""
    from fedaval.api import run_training

    settings = dict(model="cnn", scenario_options={"clients": 4, "tasks": 2}, momentum=0.9, rounds_per_task=2)
    if graphs:
        settings.update(cuda_graphs=True, cuda_graph_scope=graphs)
    results = {}
    for k in (1, 3):
        results[k] = strip_timing(run_training(tiny_config(out=str(tmp_path / str(k)), client_streams=k, **settings)))
        results[k]["config"].pop("client_streams")
    assert results[3] == results[1]
