"""--compile: each client's training forward of the backbone through torch.compile (fedaval/training.py).

``aot_eager`` (dynamo's capture and AOTAutograd's backward, run by eager kernels) stands in on the CPU
for what must hold whatever the backend: the compiled function is what trains, and it changes no
result. ``inductor`` runs once here too, with its generated C++ kernels."""

from __future__ import annotations

import pytest
import torch
from helpers import TEST_DEVICE, one_line_error, strip_timing

from fedaval import hookimpl
from fedaval.errors import FedavalUsageError


class GradFns:
    """Records the autograd node that made each training step's features."""

    name = "grad_fns"

    def __init__(self):
        self.training: set[str] = set()

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        self.training.add(type(batch.features.grad_fn).__name__)
        return {}


def compiled_and_eager(tiny_config, tmp_path, backend: str, **settings) -> tuple[dict, dict, GradFns]:
    from fedaval.api import run_training

    results, probes = {}, {}
    settings.setdefault("model", "cnn")
    for compile in ("off", backend):
        probes[compile] = GradFns()
        config = tiny_config(out=str(tmp_path / compile), compile=compile, **settings)
        results[compile] = strip_timing(run_training(config, extra_plugins=[probes[compile]]))
        results[compile]["config"].pop("compile")
    eager_nodes = probes["off"].training - {"NoneType"}  # the backbone's last operation (the CNN's flatten)
    assert eager_nodes and "CompiledFunctionBackward" not in eager_nodes
    # the backbone's output comes from AOTAutograd's compiled function: what trained was compiled
    assert "CompiledFunctionBackward" in probes[backend].training
    assert not eager_nodes & probes[backend].training
    return results["off"], results[backend], probes[backend]


def test_aot_eager_trains_through_the_compiled_backbone_with_the_eager_results(tiny_config, tmp_path, monkeypatch):
    """The compiled function is what trains (its autograd node made the features), the classifier and
    the optimizer around it as they were: run by eager kernels, the results are the eager run's, bit for
    bit, momentum and a last batch of another size included (one graph for both sizes). Evaluation
    (without gradients) does not go through it."""
    from fedaval import training

    compiled_features, calls = training.compiled_features, []

    def spy(backend):
        def call(module, x):
            calls.append((torch.is_grad_enabled(), len(x)))
            return compiled_features(backend)(module, x)

        return call

    monkeypatch.setattr(training, "compiled_features", spy)
    eager, compiled, _ = compiled_and_eager(tiny_config, tmp_path, "aot_eager", momentum=0.9)
    assert compiled == eager
    assert {grad for grad, _ in calls} == {True}  # training steps only
    assert len({size for _, size in calls}) >= 2  # full and last batches


def test_inductor_trains_from_generated_kernels(tiny_config, tmp_path):
    """inductor's generated kernels (C++ on the CPU) sum in other orders: the run learns as the eager
    one does, its losses close to the eager ones, not necessarily equal; two runs with the same seed
    give the same results. The MLP: its few kernels
    compile in seconds (the CNN's take about 25 s here; benchmarks/compile_methods.py runs them)."""
    from fedaval.api import run_training

    eager, compiled, _ = compiled_and_eager(tiny_config, tmp_path, "inductor", momentum=0.9, model="mlp")
    losses = [r["rounds"][-1]["losses"]["loss/classification"] for r in (eager, compiled)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)
    assert compiled["final"]["accuracy"] == pytest.approx(eager["final"]["accuracy"], abs=0.05)
    # and a second compiled run with the same seed is the first one, bit for bit
    config = tiny_config(out=str(tmp_path / "again"), compile="inductor", momentum=0.9, model="mlp")
    again = strip_timing(run_training(config, extra_plugins=[GradFns()]))
    again["config"].pop("compile")
    assert again == compiled


def test_a_frozen_backbone_runs_compiled_for_what_it_is_now(tiny_config, tmp_path, monkeypatch):
    """FedProK freezes the backbone from task 1 on (requires_grad False, eval mode): the compiled
    function takes the frozen backbone too (compiled again for it, not replaying the training one's
    graph), and the run is the eager one's."""
    from fedaval import training

    compiled_features, frozen = training.compiled_features, []

    def spy(backend):
        def call(module, x):
            frozen.append(not any(p.requires_grad for p in module.parameters()))
            return compiled_features(backend)(module, x)

        return call

    monkeypatch.setattr(training, "compiled_features", spy)
    settings = dict(plugins=["fedprok"], momentum=0.9, scenario_options={"clients": 2, "tasks": 2})
    eager, compiled, probe = compiled_and_eager(tiny_config, tmp_path, "aot_eager", **settings)
    assert True in frozen and False in frozen
    assert "NoneType" in probe.training  # the frozen backbone's features carry no gradient
    assert compiled == eager


def test_bad_compile_is_a_one_line_error(tmp_path):
    line = one_line_error(["train", "--compile", "max-autotune", "--out", str(tmp_path / "run")])
    assert line == "fedaval: error: bad value --compile max-autotune; must be one of off, inductor, aot_eager"
    assert not (tmp_path / "run").exists()


def test_compile_with_the_backbones_graph_is_refused_and_inductor_needs_triton_on_a_gpu(monkeypatch):
    """A backbone graphed alone (--cuda-graph-scope features) is captured from the module, which a
    compiled function is not; inductor on a GPU generates Triton kernels. Both one-line errors, before
    any training (the GPU stood in: the checks read the config and ask torch for Triton)."""
    import torch.utils._triton

    from fedaval.config import RunConfig
    from fedaval.training import check_compile

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(FedavalUsageError) as error:
        check_compile(RunConfig(compile="inductor", cuda_graphs=True), gpu)
    assert str(error.value) == (
        "--compile inductor with --cuda-graphs needs --cuda-graph-scope step (not features): the compiled "
        "backbone runs inside the captured step"
    )
    check_compile(RunConfig(compile="aot_eager", cuda_graphs=True, cuda_graph_scope="step"), cpu)
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: False)
    with pytest.raises(FedavalUsageError) as error:
        check_compile(RunConfig(compile="inductor"), gpu)
    assert str(error.value) == (
        "--compile inductor on a GPU needs Triton, which this Python does not have; use --compile off"
    )
    check_compile(RunConfig(compile="inductor"), cpu)  # C++ kernels on the CPU
    check_compile(RunConfig(compile="aot_eager"), gpu)  # no kernels generated


class Branching(torch.nn.Module):
    """A backbone whose forward branches on a value it computes: no single graph holds it."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        return y if y.sum() > 0 else -y


def test_a_backbone_that_does_not_compile_whole_or_runs_out_of_recompilations_is_a_one_line_error():
    """Never a silent fallback to eager: a graph break, and the recompilation limit reached, are errors
    naming the backbone (the limit lowered to 1 here; a run's is 64)."""
    import torch._dynamo

    from fedaval.config import RunConfig
    from fedaval.training import compiled_backbone

    config = RunConfig(compile="aot_eager")
    with pytest.raises(FedavalUsageError) as error:
        compiled_backbone(config, Branching(), torch.randn(2, 4))
    assert str(error.value).startswith("--compile aot_eager: Branching does not compile as one graph (")
    assert str(error.value).endswith("); use --compile off") and "\n" not in str(error.value)

    linear = torch.nn.Linear(4, 4)
    with torch._dynamo.config.patch(recompile_limit=1):
        with pytest.raises(FedavalUsageError) as error:
            for requires_grad in (True, False, True):  # each a variant to compile for
                linear.weight.requires_grad_(requires_grad)
                compiled_backbone(config, linear, torch.randn(2, 4))
    assert str(error.value) == (
        "--compile aot_eager: Linear was compiled 1 times (each new batch shape, mode or requires_grad needs "
        "one) and would run eagerly from here; use --compile off"
    )


@pytest.mark.skipif(not TEST_DEVICE.startswith("cuda"), reason="inductor's Triton kernels need a GPU")
def test_on_a_gpu_inductor_trains_as_the_eager_run_does(tiny_config, tmp_path):
    """On CUDA: Triton's kernels train the backbone, and the run learns as the eager one does."""
    eager, compiled, _ = compiled_and_eager(tiny_config, tmp_path, "inductor", momentum=0.9)
    losses = [r["rounds"][-1]["losses"]["loss/classification"] for r in (eager, compiled)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
    assert compiled["final"]["accuracy"] == pytest.approx(eager["final"]["accuracy"], abs=0.05)


@pytest.mark.parametrize(
    "method, extra",
    [
        ("gldp", {"local_epochs": 2}),  # its base and head epochs
        ("pfcl", {}),
        ("fedlwf", {}),
        ("fedewc", {}),
        # 2 of 3 clients a round, the third's strategy pickled until it trains again
        ("fedavg", {"offload_clients": "cpu", "clients_per_round": 2, "scenario_options": {"clients": 3, "tasks": 2}}),
    ],
    ids=["gldp", "pfcl", "fedlwf", "fedewc", "offloaded"],
)
def test_the_methods_results_do_not_change_under_aot_eager(tiny_config, tmp_path, method, extra):
    """Methods that read the step's features (GLDP's prototypes, PFCL's), call a model of their own
    beside the client's (FedLwF's old model) or add an Avalanche penalty (FedEWC), and clients offloaded
    between rounds, train through the compiled backbone to the eager results. Session 31 ran every one
    of the 22 plugins this way: the same results.json each (docs/performance.md, item 3)."""
    settings = dict(plugins=[method], momentum=0.9, scenario_options={"clients": 2, "tasks": 2})
    settings.update(extra)
    eager, compiled, _ = compiled_and_eager(tiny_config, tmp_path, "aot_eager", **settings)
    assert compiled == eager


@pytest.mark.skipif(not TEST_DEVICE.startswith("cuda"), reason="inductor's Triton kernels and CUDA graphs need a GPU")
def test_on_a_gpu_the_step_graphs_of_a_compiled_backbone_change_no_result(tiny_config, tmp_path):
    """--compile inductor inside the captured step: Triton's kernels captured with the rest of the step
    give what they give replayed one by one."""
    settings = dict(model="cnn", scenario_options={"clients": 3, "tasks": 2}, clients_per_round=2, momentum=0.9)
    settings.update(rounds_per_task=2, compile="inductor")
    from test_cuda_graphs import with_and_without_step_graphs

    results = with_and_without_step_graphs(tiny_config, tmp_path, settings)
    assert results[True] == results[False]
