"""--stack-clients: a round's clients in lockstep, each step of all of them one vmapped computation
(fedaval/stacked.py). On the CPU: vmap runs here as on a GPU, so nothing is stood in."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TEST_DEVICE, Raises, StandInCapture, one_line_error, strip_timing

from fedaval import hookimpl, stacked
from fedaval.errors import FedavalUsageError, RunFailure

CIFAR10 = Path(__file__).resolve().parent / "data" / "cifar10"  # the suite's CIFAR-10 subset (conftest.py)

# 3 clients of 189, 137 and 300 training images: 6, 5 and 10 minibatches an epoch, each a smaller last one
THREE = dict(scenario_options={"clients": 3, "tasks": 2}, offload_clients="none", momentum=0.9)


@pytest.fixture
def counted(monkeypatch):
    """Counts the stacked computations and the clients stepped in each."""
    sizes: list[int] = []
    step = stacked._Stack.step

    def counting(self, entries, key):
        sizes.append(len(entries))
        return step(self, entries, key)

    monkeypatch.setattr(stacked._Stack, "step", counting)
    return sizes


def two_rounds(tiny_config, **settings):
    from fedaval.build import build_run
    from fedaval.coordinator import run_round

    run = build_run(tiny_config(**settings))
    run.server.begin_task(0)
    run_round(run, 1)
    run_round(run, 2)
    return run


def largest_difference(one, other) -> float:
    """The largest difference between the two runs' clients' parameters,
    buffers and momentum buffers, relative to the largest of them in ``one``
    (at least 1)."""
    worst, largest = 0.0, 1.0
    for a, b in zip(one.clients, other.clients):
        pairs = list(zip(a.model.state_dict().values(), b.model.state_dict().values()))
        states = zip(a.strategy.optimizer.state.values(), b.strategy.optimizer.state.values(), strict=True)
        pairs += [(x["momentum_buffer"], y["momentum_buffer"]) for x, y in states]
        for x, y in pairs:
            worst = max(worst, float((x.double() - y.double()).abs().max()))
            largest = max(largest, float(x.double().abs().max()))
    return worst / largest


@pytest.mark.parametrize(
    "settings",
    [
        dict(model="mlp"),
        dict(model="cnn"),  # BatchNorm's running statistics, stacked and updated per client
        dict(model="cnn", optimizer_state="keep"),  # momentum carried from round 1 into round 2
        dict(model="cnn", lr_schedule="cosine", lr_min=1e-3, momentum=0.0),  # no buffers at all
        dict(model="cnn", dataset="imagefolder", data_root=str(CIFAR10), channels_last=True, augment="standard"),
    ],
    ids=["mlp", "cnn", "keep", "cosine", "cifar-nhwc-augmented"],
)
def test_stacked_rounds_train_each_client_as_it_trains_alone(tiny_config, counted, settings):
    """Two rounds of 3 clients with unequal data: each client's parameters,
    BatchNorm statistics and momentum buffers end where the clients trained
    one after another end, up to the last bits (vmap's grouped convolution
    sums in another order), and each client's random streams end in the same
    state: every draw came from its own stream in its own order. Each
    stacked computation stepped several clients."""
    settings = {**THREE, **settings}
    alone = two_rounds(tiny_config, **settings)
    assert not counted
    together = two_rounds(tiny_config, stack_clients=True, **settings)
    assert counted and max(counted) >= 2 and sum(counted) > len(counted)  # fewer computations than steps
    assert largest_difference(alone, together) < 1e-5
    for a, b in zip(alone.clients, together.clients):
        assert a.rng["python"] == b.rng["python"]
        assert torch.equal(a.rng["torch"], b.rng["torch"])
        numpy = a.rng["numpy"].state["state"], b.rng["numpy"].state["state"]
        assert numpy[0]["pos"] == numpy[1]["pos"] and (numpy[0]["key"] == numpy[1]["key"]).all()
        own_memory(b)


def own_memory(client) -> None:
    """After its training a client's parameters, buffers, gradients and
    momentum buffers each hold memory of their own, not rows of a stack."""
    momenta = [state["momentum_buffer"] for state in client.strategy.optimizer.state.values()]
    grads = [p.grad for p in client.model.parameters() if p.grad is not None]
    assert grads  # the last step's, as after an eager step
    for t in [*client.model.parameters(), *client.model.buffers(), *grads, *momenta]:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_a_group_that_steps_again_reuses_its_stack(tiny_config, monkeypatch):
    """A group's stack is made once: the same clients stepping together
    again, in a later epoch or a later round, are copied into it (their
    tensors views of it again), nothing allocated anew."""
    from fedaval.backends import LocalBackend
    from fedaval.build import build_run
    from fedaval.coordinator import run_round

    made = []
    init = stacked._Stack.__init__

    def counting(self, strategies):
        made.append(len(strategies))
        init(self, strategies)

    monkeypatch.setattr(stacked._Stack, "__init__", counting)
    # one task of 4 clients whose data split evenly (alpha 1e6): 313 to 316 images each, 10 steps an epoch
    config = tiny_config(
        stack_clients=True,
        scenario_options={"clients": 4, "tasks": 1, "alpha": 1e6},
        rounds_per_task=2,
        local_epochs=2,
        offload_clients="none",
        momentum=0.9,
    )
    run = build_run(config)
    sizes = [len(c.train_stream[0].dataset) for c in run.clients]
    run.server.begin_task(0)
    backend = LocalBackend()  # one a run, as coordinator.train makes it
    run_round(run, 1, backend)
    # the full batches of all 4 as one group; the last batches by shape (the sizes differ by a few images)
    assert made[0] == 4 and made.count(4) == 1 and len(made) == 1 + len(set(sizes)) <= stacked.MAX_STACKS, made
    for client in run.clients:
        own_memory(client)
    run_round(run, 2, backend)
    assert len(made) == 1 + len(set(sizes))  # the stacks kept by the backend
    for client in run.clients:
        own_memory(client)


def test_the_global_streams_after_a_stacked_round_are_the_sequential_rounds(tiny_config):
    """The clients' streams are swapped out at every step and their scopes
    end as they began: the run's own streams go on as after sequential rounds."""
    import random

    ends = []
    for stack in (False, True):
        two_rounds(tiny_config, stack_clients=stack, **THREE)
        ends.append((random.getstate(), torch.get_rng_state()))
    assert ends[0][0] == ends[1][0] and torch.equal(ends[0][1], ends[1][1])


def test_a_stacked_run_is_reproducible_and_reports_what_the_sequential_run_does(tiny_config, tmp_path):
    from fedaval.api import run_training

    def results(name, **settings):
        out = strip_timing(run_training(tiny_config(out=str(tmp_path / name), **THREE, **settings)))
        out["config"].pop("stack_clients")
        return out

    once, twice = results("once", stack_clients=True), results("twice", stack_clients=True)
    assert once == twice
    alone = results("alone")
    assert once["final"].keys() == alone["final"].keys()
    for key, value in alone["final"].items():
        if isinstance(value, float):
            assert once["final"][key] == pytest.approx(value, abs=1e-3), key


@pytest.mark.parametrize(
    "settings",
    [
        dict(precision="bf16", model="cnn"),  # the stacked forward and each criterion under autocast
        # a new group of clients each round, offloaded between rounds: stacks made, kept and forgotten
        dict(
            scenario_options={"clients": 6, "tasks": 2}, clients_per_round=3, rounds_per_task=3, offload_clients="disk"
        ),
    ],
    ids=["bf16", "sampled-offloaded"],
)
def test_a_stacked_run_reports_the_sequential_accuracies(tiny_config, tmp_path, settings):
    from fedaval.api import run_training

    final = {}
    for stack in (False, True):
        config = tiny_config(out=str(tmp_path / str(stack)), momentum=0.9, stack_clients=stack, **settings)
        final[stack] = run_training(config)["final"]
    for key in ("accuracy", "mean_client_accuracy", "forgetting"):
        assert final[True][key] == pytest.approx(final[False][key], abs=1e-3), key


@pytest.mark.parametrize("plugin", ["fedavg", "fednova", "fedrep", "fedreplay", "dp", "hgp"])
@pytest.mark.filterwarnings("ignore:hgp. no -o hgp.weights")
def test_every_method_stacking_allows_ends_where_its_sequential_run_ends(tiny_config, plugin):
    """The in-tree plugins that pass --stack-clients' checks keep their state
    per client: their calls interleaving within a round changes nothing (HGP:
    its frozen ViT backbone stacked too, randomly initialised here)."""
    settings = dict(THREE, plugins=[plugin], **({} if plugin == "hgp" else {"model": "cnn"}))
    alone = two_rounds(tiny_config, **settings)
    together = two_rounds(tiny_config, stack_clients=True, **settings)
    assert largest_difference(alone, together) < 1e-5
    for a, b in zip(alone.server.model.state_dict().values(), together.server.model.state_dict().values()):
        assert float((a.double() - b.double()).abs().max()) < 1e-5 * max(1.0, float(a.double().abs().max()))


def test_a_failing_client_is_dropped_and_the_others_train_on(tiny_config, tmp_path):
    """Client 1 raises in its local training of round 2: the other clients'
    stacked steps go on, as they would one after another."""
    from fedaval.api import run_training

    def final(name, **settings):
        config = tiny_config(out=str(tmp_path / name), on_client_failure="drop", **THREE, **settings)
        out = run_training(config, [Raises()])
        return out["rounds"][1]["failed_clients"], out["final"]["accuracy"]

    alone = final("alone")
    together = final("together", stack_clients=True)
    assert together[0] == alone[0] and alone[0]
    assert together[1] == pytest.approx(alone[1], abs=1e-3)


def test_a_stacked_step_that_fails_fails_the_clients_it_stepped(tiny_config, monkeypatch):
    """A failure of a stacked computation is each of its clients' failure (the
    policy applies); with --on-client-failure fail it stops the run."""
    from fedaval.build import build_run
    from fedaval.coordinator import run_round

    def fails(self, entries, key):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(stacked._Stack, "step", fails)
    run = build_run(tiny_config(stack_clients=True, on_client_failure="fail", **THREE))
    run.server.begin_task(0)
    with pytest.raises(RunFailure, match="CUDA out of memory"):
        run_round(run, 1)


class Misused:
    """A plugin misused in client 1's receive (a FedavalUsageError): the same in every client."""

    name = "misused"

    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        if client.id == 1:
            raise FedavalUsageError("misused")


def test_an_error_that_is_not_a_clients_stops_every_thread(tiny_config):
    import threading

    from fedaval.build import build_run
    from fedaval.coordinator import run_round

    run = build_run(tiny_config(stack_clients=True, **THREE), [Misused()])
    run.server.begin_task(0)
    with pytest.raises(FedavalUsageError, match="misused"):
        run_round(run, 1)
    assert not [t for t in threading.enumerate() if t.name.startswith("fedaval-client-")]
    assert stacked._active is None


def test_an_interrupt_in_a_client_stops_the_round_and_leaves_no_thread():
    import threading

    lockstep = stacked.Lockstep(torch.device("cpu"))
    ran = []

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        lockstep.run([lambda: ran.append(0), interrupted, lambda: ran.append(2)])
    assert ran == [0]  # the third client never got its turn
    assert not [t for t in threading.enumerate() if t.name.startswith("fedaval-client-")]


def test_a_client_trained_outside_a_stacked_round_is_an_error(tiny_config):
    from fedaval.build import build_run

    run = build_run(tiny_config(stack_clients=True, **THREE))
    client = run.clients[0]
    client.task = 0
    with pytest.raises(RuntimeError, match="outside the in-process backend's round"):
        client.train_round(1, 0, begins=True, ends=False)


class Dropout:
    """A model whose backbone draws random numbers in training."""

    name = "dropout-model"

    @hookimpl
    def fedaval_register_models(self, register):
        from fedaval.models import SplitModel

        def build(input_shape, num_classes):
            size = 1
            for n in input_shape:
                size *= n
            features = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(size, 16), torch.nn.Dropout(0.5))
            return SplitModel(features, torch.nn.Linear(16, num_classes), 16)

        register("dropout", build)


@pytest.mark.parametrize(
    "settings, error",
    [
        (dict(backend="ray"), "--stack-clients needs --backend local (the clients of one process), not --backend ray"),
        (dict(optimizer="adam", momentum=0.0), "--stack-clients needs --optimizer sgd, not adam"),
        (dict(compile="aot_eager"), "--stack-clients does not combine with --compile aot_eager"),
        (
            dict(plugins=["fedprox"]),
            "--stack-clients computes each step of a round's clients at once, and plugin 'fedprox' acts inside it "
            "(fedaval_client_loss); run without it",
        ),
        (
            dict(plugins=["fedlwf"]),
            "--stack-clients computes each step of a round's clients at once, and the Avalanche plugin "
            "DeviceIndexLwFPlugin acts inside it (before_backward); run without it",
        ),
    ],
    ids=["ray", "adam", "compile", "loss-term", "avalanche-plugin"],
)
def test_what_stacking_cannot_compute_is_refused_as_the_run_is_built(tiny_config, settings, error):
    from fedaval.build import build_run

    with pytest.raises(FedavalUsageError) as raised:
        build_run(tiny_config(stack_clients=True, **settings))
    assert error in str(raised.value)


def test_a_model_drawing_random_numbers_in_a_stacked_step_is_a_one_line_error(tiny_config):
    from fedaval.build import build_run
    from fedaval.coordinator import run_round

    run = build_run(tiny_config(stack_clients=True, model="dropout", **THREE), [Dropout()])
    run.server.begin_task(0)
    with pytest.raises(FedavalUsageError, match="draws random numbers in training"):
        run_round(run, 1)


def test_the_cli_refuses_stacking_with_cuda_graphs_in_one_line(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--stack-clients", "--client-streams", "2", "--device", "cpu", "--out", str(out)]
    line = one_line_error(args)
    assert line.startswith("fedaval: error: --client-streams 2 needs a CUDA device")
    line = one_line_error(["train", "--stack-clients", "--plugins", "gldp", "--device", "cpu", "--out", str(out)])
    assert "plugin 'gldp' acts inside it (fedaval_classify)" in line
    assert not out.exists()


@pytest.fixture
def stand_in_capture(monkeypatch):
    from fedaval import cuda_graphs

    fake = StandInCapture()  # the stack puts its own values back after a capture
    monkeypatch.setattr(stacked, "capture", fake)
    monkeypatch.setattr(cuda_graphs, "check_device", lambda *args: None)
    return fake


@pytest.mark.parametrize(
    "extra",
    [
        dict(momentum=0.9),  # the momentum buffers made as zeros before the capture, each round
        dict(momentum=0.9, optimizer_state="keep"),  # carried from round to round: copied into the stack
        dict(momentum=0.9, lr_schedule="cosine", lr_min=1e-3),  # a new learning rate each round: captured anew
        dict(momentum=0.0),
        dict(momentum=0.9, model="cnn", offload_clients="cpu"),  # new strategy objects each round: adopted
    ],
    ids=["reset", "keep", "cosine", "no-momentum", "offloaded-cnn"],
)
def test_the_stacked_step_replayed_from_a_graph_gives_the_eager_stacked_results(
    tiny_config, tmp_path, stand_in_capture, extra
):
    """--stack-clients --cuda-graphs: the stacked step captured once per
    stack, batch shape and learning rate, and replayed, changes no result
    when a replay computes what the eager stacked step does."""
    from fedaval.api import run_training

    results = {}
    for graphs in (False, True):
        scope = dict(cuda_graphs=True, cuda_graph_scope="step") if graphs else {}
        config = tiny_config(out=str(tmp_path / str(graphs)), stack_clients=True, **{**THREE, **scope, **extra})
        results[graphs] = strip_timing(run_training(config))
        for option in ("cuda_graphs", "cuda_graph_scope"):
            results[graphs]["config"].pop(option)
    assert results[True] == results[False]
    # clients of unequal data step in changing groups: graphs captured again and again (equal clients: below)
    assert stand_in_capture.captures >= 2 and stand_in_capture.replays > stand_in_capture.captures


def test_a_graph_is_captured_once_per_stack_and_batch_shape(tiny_config, stand_in_capture):
    from fedaval.backends import LocalBackend
    from fedaval.build import build_run
    from fedaval.coordinator import run_round

    config = tiny_config(
        stack_clients=True,
        cuda_graphs=True,
        cuda_graph_scope="step",
        scenario_options={"clients": 4, "tasks": 1, "alpha": 1e6},
        rounds_per_task=3,
        offload_clients="none",
        momentum=0.9,
    )
    run = build_run(config)
    sizes = {len(c.train_stream[0].dataset) for c in run.clients}
    run.server.begin_task(0)
    backend = LocalBackend()
    run_round(run, 1, backend)
    captured = stand_in_capture.captures
    assert captured == 1 + len(sizes)  # the full batch's; each last batch's shape, in a stack of its own
    run_round(run, 2, backend)
    run_round(run, 3, backend)
    assert stand_in_capture.captures == captured  # the same stacks, rows and learning rate: replayed
    for client in run.clients:
        own_memory(client)


def test_a_failed_capture_is_a_one_line_error(tiny_config, monkeypatch):
    from fedaval import cuda_graphs
    from fedaval.build import build_run
    from fedaval.coordinator import run_round

    def fails(step):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(stacked, "capture", fails)
    monkeypatch.setattr(cuda_graphs, "check_device", lambda *args: None)
    run = build_run(tiny_config(stack_clients=True, cuda_graphs=True, cuda_graph_scope="step", **THREE))
    run.server.begin_task(0)
    with pytest.raises(FedavalUsageError) as error:
        run_round(run, 1)
    assert str(error.value) == (
        "--stack-clients with --cuda-graphs: capturing the stacked step failed (RuntimeError: operation not "
        "permitted when stream is capturing); run without --cuda-graphs"
    )


def test_stacking_with_the_backbones_graphs_is_refused(tiny_config, monkeypatch):
    from fedaval import cuda_graphs
    from fedaval.build import build_run

    monkeypatch.setattr(cuda_graphs, "check_device", lambda *args: None)
    with pytest.raises(FedavalUsageError, match="captures the whole stacked step .*; give --cuda-graph-scope step"):
        build_run(tiny_config(stack_clients=True, cuda_graphs=True))


@pytest.mark.skipif(not TEST_DEVICE.startswith("cuda"), reason="CUDA graphs need a GPU (FEDAVAL_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("model", ["auto", "cnn"])
def test_on_a_gpu_the_stacked_graphs_change_no_result(tiny_config, tmp_path, model):
    """On CUDA, the stacked step replayed from real graphs ends where the
    eager stacked step ends (the same kernels), and both near the clients
    trained one after another."""
    eager = two_rounds(tiny_config, stack_clients=True, model=model, **THREE)
    graphed = two_rounds(
        tiny_config, stack_clients=True, cuda_graphs=True, cuda_graph_scope="step", model=model, **THREE
    )
    alone = two_rounds(tiny_config, model=model, **THREE)
    assert largest_difference(eager, graphed) < 1e-6
    assert largest_difference(alone, graphed) < 1e-4
