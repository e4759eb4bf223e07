"""--cuda-graphs: a client's backbone replayed from a CUDA graph changes no result.

On the CPU the capture is a stand-in (``fake_make_graphed``) that does what
``torch.cuda.make_graphed_callables`` does to the module (warm-up steps that
move BatchNorm's statistics, a patched ``forward``); the GPU test at the end
runs the real one (FEDAVAL_TEST_DEVICE=cuda, docs/performance.md "On a GPU")."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import TEST_DEVICE, StandInCapture, one_line_error, strip_timing

from fedaval import hookimpl
from fedaval.cuda_graphs import WARMUP_STEPS, GraphedFeatures
from fedaval.errors import FedavalUsageError

CIFAR10 = Path(__file__).resolve().parent / "data" / "cifar10"  # the suite's CIFAR-10 subset (conftest.py)


class FakeCapture:
    """Stands in for make_graphed_callables: runs the warm-up steps on the
    module (as the real one does on a side stream), then patches its forward
    with a "replay" that computes eagerly, is counted, and returns its output
    in the same memory every time (a graph's static output)."""

    def __init__(self):
        self.captures = 0
        self.replays = 0
        self.static: torch.Tensor | None = None

    class Static(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out, static):
            static.copy_(out)
            return static.view_as(static)

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    def __call__(self, module, sample_args, num_warmup_iters, allow_unused_input):
        assert num_warmup_iters == WARMUP_STEPS and allow_unused_input
        for _ in range(num_warmup_iters):
            module(*sample_args).sum().backward()
        module.zero_grad(set_to_none=True)
        original = module.forward
        self.static = None  # each graph has its own output memory

        def replay(*args):
            self.replays += 1
            out = original(*args)
            if self.static is None:
                self.static = torch.empty_like(out)
            return self.Static.apply(out, self.static)

        module.forward = replay
        self.captures += 1
        return module


def backbone():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.ReLU())


def train(features, module, batches):
    """SGD steps through ``features`` (the module or its graphed stand-in)."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    outputs = []
    for x in batches:
        optimizer.zero_grad(set_to_none=True)
        out = features(x)
        out.square().mean().backward()
        optimizer.step()
        outputs.append(out.detach())
    return outputs


def batches(sizes):
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(n, 6, generator=generator) for n in sizes]


def test_graphed_steps_equal_eager_steps_and_the_warm_up_leaves_no_trace():
    eager = backbone()
    graphed_module = copy.deepcopy(eager)
    fake = FakeCapture()
    graphed = GraphedFeatures(graphed_module, make_graphed=fake)
    data = batches([8, 8, 8, 3])  # the last, partial batch runs eagerly

    expected = train(eager, eager, data)
    got = train(graphed, graphed_module, data)

    assert (fake.captures, fake.replays) == (1, 3)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(eager.state_dict().values(), graphed_module.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # BatchNorm's statistics: the warm-up's undone
    assert "forward" not in vars(graphed_module)  # the module's own forward is back, for eval and plugins


def test_a_replaced_or_frozen_parameter_is_captured_again():
    module = backbone()
    fake = FakeCapture()
    graphed = GraphedFeatures(module, make_graphed=fake)
    x = batches([8])[0]
    graphed(x)
    graphed(x)
    assert fake.captures == 1
    module[0].weight.data = module[0].weight.data.clone()  # a new address, as loading an offloaded client gives
    graphed(x)
    assert fake.captures == 2
    module[0].bias.requires_grad_(False)
    graphed(x)
    assert fake.captures == 3
    graphed(batches([16])[0])  # a larger batch: its own graph
    assert fake.captures == 4
    # a new Parameter on the same memory: the graph's input is the old object, which would get the gradient
    module[0].weight = torch.nn.Parameter(module[0].weight.data)
    graphed(batches([16])[0])
    assert fake.captures == 5


def test_a_step_does_not_walk_the_modules_again():
    """Listing ResNet-18's parameters and buffers every step cost some 150 us
    of the host's time a step; they are listed again only after torch
    registered a tensor or a module somewhere."""
    module = backbone()
    fake = FakeCapture()
    graphed = GraphedFeatures(module, make_graphed=fake)
    x = batches([8])[0]
    graphed(x)
    walks = []
    real = module.named_modules
    module.named_modules = lambda *a, **k: walks.append(1) or real(*a, **k)  # what parameters() and buffers() walk
    for _ in range(3):
        graphed(x)
    assert walks == [] and fake.captures == 1 and fake.replays >= 3
    torch.nn.Linear(2, 2)  # registers parameters: the next step lists the module's tensors again
    graphed(x)
    assert len(walks) == 2 and fake.captures == 1  # parameters() and buffers(); the same tensors: no capture


def test_evaluation_and_no_grad_run_the_module_itself():
    module = backbone()
    fake = FakeCapture()
    graphed = GraphedFeatures(module, make_graphed=fake)
    x = batches([8])[0]
    with torch.no_grad():
        graphed(x)
    module.eval()
    graphed(x)
    assert fake.captures == fake.replays == 0


def test_each_step_returns_its_own_features():
    module = backbone()
    graphed = GraphedFeatures(module, make_graphed=FakeCapture())
    x = batches([8])[0]
    first = graphed(x)
    second = graphed(x)
    assert first.data_ptr() != second.data_ptr()


def test_a_failed_capture_leaves_the_module_as_it_was():
    module = backbone()
    before = copy.deepcopy(module.state_dict())

    def fails(module, sample_args, **kwargs):
        module(*sample_args)  # a warm-up step moved BatchNorm's statistics
        module.forward = lambda x: x
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="stream is capturing"):
        GraphedFeatures(module, make_graphed=fails)(batches([8])[0])
    assert "forward" not in vars(module)
    for a, b in zip(before.values(), module.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_backbone_with_module_hooks_is_refused():
    module = backbone()
    module[0].register_forward_hook(lambda *args: None)
    with pytest.raises(FedavalUsageError, match="--cuda-graphs cannot capture .* module hooks \\(on 0\\)"):
        GraphedFeatures(module, make_graphed=FakeCapture())(batches([8])[0])


def test_features_that_are_not_a_module_are_refused():
    with pytest.raises(FedavalUsageError, match="features to be a torch.nn.Module, not a method"):
        GraphedFeatures(backbone().forward)


def test_an_offloaded_client_holds_no_graph(tiny_config):
    from fedaval.build import build_run

    client = build_run(tiny_config()).clients[0]
    strategy = client.strategy
    strategy._graphed = graphed = GraphedFeatures(strategy.model.features, make_graphed=FakeCapture())
    graphed(
        torch.randn(4, *client.run.data.input_shape, device=client.run.device)
    )  # holds the patched forward, a closure pickle refuses
    client.offload()
    assert client.strategy._graphed is None and graphed.captures == 1


@pytest.fixture
def stand_in_graphs(monkeypatch):
    """--cuda-graphs on the CPU, each client's capture stood in by FakeCapture; yields the fakes made."""
    from fedaval import cuda_graphs, strategy

    fakes = []

    def graphed(module):
        fakes.append(FakeCapture())
        return GraphedFeatures(module, make_graphed=fakes[-1])

    monkeypatch.setattr(strategy, "GraphedFeatures", graphed)
    monkeypatch.setattr(cuda_graphs, "check_device", lambda *args: None)
    return fakes


def with_and_without_graphs(tiny_config, tmp_path, settings) -> dict[bool, dict]:
    """results.json of the run ``settings`` describe, without (``False``) and
    with (``True``) ``--cuda-graphs``, timings and that option left out."""
    from fedaval.api import run_training

    results = {}
    for graphs in (False, True):
        config = tiny_config(out=str(tmp_path / str(graphs)), cuda_graphs=graphs, **settings)
        results[graphs] = strip_timing(run_training(config))
        results[graphs]["config"].pop("cuda_graphs")
    return results


SAMPLED = dict(model="cnn", scenario_options={"clients": 4, "tasks": 2}, clients_per_round=2, offload_clients="none")


def test_a_run_through_stand_in_graphs_gives_the_same_results(tiny_config, tmp_path, stand_in_graphs):
    """The strategy's wiring (features through the graph while training,
    eager in evaluation and for short batches, the warm-up undone) changes no
    result when a replay computes what an eager step does."""
    results = with_and_without_graphs(tiny_config, tmp_path, SAMPLED)
    assert results[True] == results[False]
    assert sum(f.captures for f in stand_in_graphs) >= 4 and sum(f.replays for f in stand_in_graphs) > 0


def test_a_client_idle_next_round_lets_its_graph_go(tiny_config, stand_in_graphs):
    from fedaval.build import build_run
    from fedaval.coordinator import run_round

    run = build_run(tiny_config(cuda_graphs=True, **dict(SAMPLED, clients_per_round=3)))
    run.server.begin_task(0)
    run_round(run, 1)
    trained, upcoming = set(run.schedule[0]), set(run.schedule[1])
    assert trained - upcoming and trained & upcoming  # the schedule has both cases (seed 0: 013, then 012)
    for k in trained:
        kept = run.clients[k].strategy._graphed
        assert (kept is not None) == (k in upcoming), k


def test_cuda_graphs_on_the_cpu_is_a_one_line_error(tmp_path):
    out = tmp_path / "run"
    line = one_line_error(["train", "--cuda-graphs", "--device", "cpu", "--out", str(out)])
    assert line == (
        "fedaval: error: --cuda-graphs needs a CUDA device; --device cpu is not one: "
        "allowed with cuda, cuda:<index>, or auto on a machine with a GPU"
    )
    assert not out.exists()


@pytest.mark.skipif(not TEST_DEVICE.startswith("cuda"), reason="CUDA graphs need a GPU (FEDAVAL_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("model", ["auto", "cnn"])
def test_on_a_gpu_the_graphs_change_no_result(tiny_config, tmp_path, monkeypatch, model):
    """Deterministic algorithms (tiny_config on a GPU): the same results.json
    with and without graphs, clients offloaded to host memory and back
    (their storages move, so graphs are captured again)."""
    captures = []
    capture = GraphedFeatures._capture
    monkeypatch.setattr(GraphedFeatures, "_capture", lambda self, x: (captures.append(x.shape), capture(self, x)))

    settings = dict(model=model, scenario_options={"clients": 3, "tasks": 2}, clients_per_round=2)
    settings.update(offload_clients="cpu", rounds_per_task=3)
    results = with_and_without_graphs(tiny_config, tmp_path, settings)
    assert results[True] == results[False]
    assert len(captures) >= 3 and all(shape[0] == 32 for shape in captures)  # every client, at full batches


# --- --cuda-graph-scope step ---------------------------------------------------------------------


def step_capture(model, optimizer) -> StandInCapture:
    """A client's step capture stood in: its parameters, buffers and momentum buffers left as they were."""
    return StandInCapture(
        lambda: [*model.parameters(), *model.buffers(), *(s["momentum_buffer"] for s in optimizer.state.values())]
    )


@pytest.fixture
def stand_in_step_graphs(monkeypatch):
    """--cuda-graph-scope step on the CPU, each client's capture stood in by StandInCapture; yields the graphed steps made."""
    from fedaval import cuda_graphs, strategy
    from fedaval.cuda_graphs import GraphedStep

    made = []

    def graphed(strat):
        made.append(GraphedStep(strat, capture=step_capture(strat.model, strat.optimizer)))
        return made[-1]

    monkeypatch.setattr(strategy, "GraphedStep", graphed)
    monkeypatch.setattr(cuda_graphs, "check_device", lambda *args: None)
    return made


def with_and_without_step_graphs(tiny_config, tmp_path, settings) -> dict[bool, dict]:
    from fedaval.api import run_training

    results = {}
    for graphs in (False, True):
        scope = dict(cuda_graphs=True, cuda_graph_scope="step") if graphs else {}
        config = tiny_config(out=str(tmp_path / str(graphs)), **scope, **settings)
        results[graphs] = strip_timing(run_training(config))
        for option in ("cuda_graphs", "cuda_graph_scope"):
            results[graphs]["config"].pop(option)
    return results


@pytest.mark.parametrize(
    "extra",
    [
        dict(momentum=0.9),  # --optimizer-state reset: the momentum buffers zeroed in place each round
        dict(momentum=0.9, optimizer_state="keep"),
        dict(momentum=0.9, lr_schedule="cosine", lr_min=1e-3),  # a new learning rate each round: captured anew
        dict(momentum=0.0),
        dict(momentum=0.9, offload_clients="cpu"),  # a client's strategy pickled between rounds: captured anew
        dict(momentum=0.9, precision="bf16"),  # the captured forward and loss under autocast
        # CIFAR-10's 3 channels in NHWC order, the static batch too, in bfloat16
        dict(momentum=0.9, precision="bf16", channels_last=True, dataset="imagefolder", data_root=str(CIFAR10)),
        dict(momentum=0.9, model="cnn", compile="aot_eager"),  # the compiled backbone inside the captured step
    ],
    ids=["reset", "keep", "cosine", "no-momentum", "offloaded", "bf16", "nhwc-bf16", "compiled"],
)
def test_a_run_through_stand_in_step_graphs_gives_the_same_results(tiny_config, tmp_path, stand_in_step_graphs, extra):
    """The strategy's loop with the whole step replayed (callbacks after the
    replay, the update in the graph, zero momentum buffers made before the
    capture and zeroed, not dropped, at a round's start) changes no result
    when a replay computes what an eager step does."""
    results = with_and_without_step_graphs(tiny_config, tmp_path, dict(SAMPLED, **extra))
    assert results[True] == results[False]
    fakes = [g._capture_step for g in stand_in_step_graphs]
    assert sum(f.captures for f in fakes) >= 4 and sum(f.replays for f in fakes) >= 10
    assert all(g.replays == g._capture_step.replays for g in stand_in_step_graphs)


def test_a_step_graphed_run_resumed_from_a_checkpoint_gives_the_whole_runs_results(
    tiny_config, tmp_path, stand_in_step_graphs
):
    """A checkpoint holds the momentum buffers the graphs update, not the graphs: a run resumed from
    mid-task (round 2) and from a task's start (round 4) captures anew and ends as the whole run, and as
    the run without graphs."""
    from fedaval import checkpoint
    from fedaval.api import run_training
    from fedaval.build import build_run
    from fedaval.coordinator import train

    settings = dict(momentum=0.9, rounds_per_task=3, keep_checkpoints=100)
    eager = strip_timing(run_training(tiny_config(out=str(tmp_path / "eager"), **settings)))
    config = tiny_config(out=str(tmp_path / "whole"), cuda_graphs=True, cuda_graph_scope="step", **settings)
    whole = strip_timing(run_training(config))
    for round in (2, 4):
        run = build_run(config, out_dir=tmp_path / f"resumed{round}")
        results = checkpoint.restore(run, checkpoint.path_for(tmp_path / "whole", round))
        assert strip_timing(train(run, results=results)) == whole
    for option in ("cuda_graphs", "cuda_graph_scope"):
        whole["config"].pop(option)
        eager["config"].pop(option)
    assert whole == eager


def test_a_client_keeps_one_graph_for_its_full_batches_and_one_for_its_last(tiny_config, stand_in_step_graphs):
    """One task of 3 rounds, constant learning rate: each client captures
    the full batch and its epoch's last, smaller one once, and replays them
    in every later round; the momentum buffers stay the same tensors."""
    from fedaval.build import build_run
    from fedaval.coordinator import run_round

    run = build_run(
        tiny_config(cuda_graphs=True, cuda_graph_scope="step", momentum=0.9, rounds_per_task=3, offload_clients="none")
    )
    run.server.begin_task(0)
    run_round(run, 1)
    client = run.clients[0]
    graphed = client.strategy._graphed_step
    buffers = [s["momentum_buffer"] for s in client.strategy.optimizer.state.values()]
    shapes = sorted(shape[0][0] for shape in graphed._graphs)
    assert shapes[-1] == 32 and len(shapes) == 2, shapes  # the epoch's last batch is smaller
    run_round(run, 2)
    assert client.strategy._graphed_step is graphed and graphed.captures == 2
    assert [s["momentum_buffer"] for s in client.strategy.optimizer.state.values()] == buffers
    last = next(g for g in graphed._graphs.values() if g.x.shape[0] < 32)  # each epoch ends with it
    assert all(p.grad is g for p, g in zip(last.params, last.grads))  # the step's gradients, as after an eager step


def test_a_third_batch_shape_replaces_the_smaller_graph():
    from fedaval.cuda_graphs import GraphedStep

    graphed = GraphedStep.__new__(GraphedStep)
    graphed._graphs = {}
    for batch in (32, 20, 12):
        graphed._keep(((batch, 1), torch.float32, (batch,), torch.int64), object())
    assert sorted(shape[0][0] for shape in graphed._graphs) == [12, 32]


def test_the_step_scope_without_cuda_graphs_is_a_one_line_error(tmp_path):
    out = tmp_path / "run"
    line = one_line_error(["train", "--cuda-graph-scope", "step", "--device", "cpu", "--out", str(out)])
    assert line == "fedaval: error: --cuda-graph-scope step needs --cuda-graphs (it says what the graphs capture)"
    line = one_line_error(["train", "--cuda-graph-scope", "all", "--out", str(out)])
    assert line == "fedaval: error: bad value --cuda-graph-scope all; must be one of features, step"
    assert not out.exists()


class ChangesTheStep:
    """A third-party plugin whose Avalanche plugin acts inside a step."""

    name = "changes-the-step"

    @hookimpl
    def fedaval_client_avalanche_plugins(self, run, client):
        from avalanche.core import SupervisedPlugin

        class ScalesTheLoss(SupervisedPlugin):
            def before_backward(self, strategy, **kwargs):
                strategy.loss = strategy.loss * 2

        return [ScalesTheLoss()]


@pytest.mark.parametrize(
    "settings, why",
    [
        (dict(plugins=["fedprox"]), "plugin 'fedprox' acts inside it (fedaval_client_loss)"),
        (
            dict(plugins=["fedavg"], extra=[ChangesTheStep()]),
            "the Avalanche plugin ScalesTheLoss acts inside it (before_backward)",
        ),
        (dict(plugins=["fedewc"]), "the Avalanche plugin FusedEWCPlugin acts inside it (before_backward)"),
    ],
    ids=["loss-term", "avalanche-plugin", "fedewc"],
)
def test_a_plugin_acting_inside_a_step_refuses_the_step_scope(tiny_config, stand_in_step_graphs, settings, why):
    """A captured step would run a local-loss term or an Avalanche callback once, at the capture: refused as
    the run is built, naming what acts inside the step."""
    from fedaval.build import build_run

    extra = settings.pop("extra", [])
    with pytest.raises(FedavalUsageError) as error:
        build_run(tiny_config(cuda_graphs=True, cuda_graph_scope="step", **settings), extra)
    assert str(error.value) == (
        f"--cuda-graph-scope step captures the whole training step, and {why}; use --cuda-graph-scope features"
    )


def test_the_step_scope_with_adam_is_refused(tiny_config, stand_in_step_graphs):
    from fedaval.build import build_run

    with pytest.raises(FedavalUsageError, match="^--cuda-graph-scope step needs --optimizer sgd, not adam"):
        build_run(tiny_config(cuda_graphs=True, cuda_graph_scope="step", optimizer="adam", momentum=0.0))


@pytest.mark.skipif(not TEST_DEVICE.startswith("cuda"), reason="CUDA graphs need a GPU (FEDAVAL_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("model", ["auto", "cnn"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_a_gpu_the_step_graphs_change_no_result(tiny_config, tmp_path, monkeypatch, model, precision):
    """As the features' test above, with the whole step captured and SGD with momentum (the momentum buffers
    updated by the graph, zeroed at each round's start)."""
    from fedaval.cuda_graphs import GraphedStep

    captures = []
    capture = GraphedStep._capture
    monkeypatch.setattr(
        GraphedStep, "_capture", lambda self, strat, x, y: (captures.append(x.shape), capture(self, strat, x, y))[1]
    )

    settings = dict(model=model, scenario_options={"clients": 3, "tasks": 2}, clients_per_round=2, momentum=0.9)
    settings.update(offload_clients="cpu", rounds_per_task=3, precision=precision, keep_checkpoints=100)
    results = with_and_without_step_graphs(tiny_config, tmp_path, settings)
    assert results[True] == results[False]
    assert len(captures) >= 3 and any(shape[0] == 32 for shape in captures)

    # and a checkpoint taken mid-task on the GPU resumes there to the same results (item 1 for this scope)
    from fedaval import checkpoint
    from fedaval.build import build_run
    from fedaval.coordinator import train

    config = tiny_config(out=str(tmp_path / "True"), cuda_graphs=True, cuda_graph_scope="step", **settings)
    run = build_run(config, out_dir=tmp_path / "resumed")
    resumed = strip_timing(train(run, results=checkpoint.restore(run, checkpoint.path_for(tmp_path / "True", 2))))
    for option in ("cuda_graphs", "cuda_graph_scope"):
        resumed["config"].pop(option)
    assert resumed == results[True]
