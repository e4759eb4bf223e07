"""The local training loop: optimizer state per round, learning-rate
schedules, augmentation (fedaval/training.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fedaval import hookimpl
from fedaval.api import run_training
from fedaval.config import RunConfig
from fedaval.errors import FedavalUsageError
from fedaval.training import round_lr, standard_augment


class OptimizerProbe:
    """At the first epoch of every round: is there momentum left in the
    optimizer, and what learning rate does the round use?"""

    name = "optimizer-probe"

    def __init__(self):
        self.state_at_start: list[int] = []
        self.lrs: dict[int, float] = {}

    @hookimpl
    def fedaval_client_epoch_start(self, run, client, epoch):
        if epoch == 0:
            optimizer = client.strategy.optimizer
            self.state_at_start.append(sum(1 for s in optimizer.state.values() if "momentum_buffer" in s))
            self.lrs[run.round] = optimizer.param_groups[0]["lr"]


def test_momentum_buffers_are_empty_at_the_first_step_of_every_round(tiny_config):
    probe = OptimizerProbe()
    run_training(tiny_config(momentum=0.9), extra_plugins=[probe])
    assert len(probe.state_at_start) == 8 and probe.state_at_start == [0] * 8


def test_keep_carries_momentum_across_rounds_as_before(tiny_config):
    probe = OptimizerProbe()
    run_training(tiny_config(momentum=0.9, optimizer_state="keep"), extra_plugins=[probe])
    assert probe.state_at_start[:2] == [0, 0]  # round 1: nothing yet
    assert all(n > 0 for n in probe.state_at_start[2:])  # later rounds start with last round's momentum


def test_learning_rate_schedules():
    config = RunConfig(lr=0.01, lr_min=1e-4, lr_schedule="exp")
    got = [round_lr(config, r, 5) for r in range(1, 6)]
    assert got[0] == pytest.approx(0.01) and got[-1] == pytest.approx(1e-4)
    assert got[2] == pytest.approx(1e-3)  # geometric: halfway in log space
    config.lr_schedule = "cosine"
    got = [round_lr(config, r, 5) for r in range(1, 6)]
    assert got[0] == pytest.approx(0.01) and got[-1] == pytest.approx(1e-4)
    assert got[2] == pytest.approx((0.01 + 1e-4) / 2)
    config.lr_schedule = "constant"
    assert {round_lr(config, r, 5) for r in range(1, 6)} == {0.01}


def test_the_schedule_reaches_the_optimizer(tiny_config):
    probe = OptimizerProbe()
    run_training(tiny_config(lr=0.1, lr_min=0.001, lr_schedule="exp"), extra_plugins=[probe])
    assert probe.lrs[1] == pytest.approx(0.1) and probe.lrs[4] == pytest.approx(0.001)
    assert probe.lrs[2] == pytest.approx(0.1 * 0.01 ** (1 / 3))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"lr_schedule": "linear"}, "--lr-schedule 'linear'|--lr-schedule linear"),
        ({"lr_schedule": "exp", "lr_min": 0.0}, "--lr-min 0.0"),
        ({"lr_schedule": "cosine", "lr_min": 0.5}, "--lr-min 0.5"),
        ({"augment": "heavy"}, "--augment heavy"),
        ({"optimizer_state": "sometimes"}, "--optimizer-state sometimes"),
        ({"optimizer": "adamw"}, "--optimizer adamw; must be one of sgd, adam"),
        ({"optimizer": "adam", "momentum": 0.9}, "--momentum 0.9; must be 0 with --optimizer adam"),
    ],
)
def test_bad_values_are_one_line_errors(changes, message):
    with pytest.raises(FedavalUsageError, match=message):
        RunConfig(**changes).validate()


def test_standard_augment_crops_and_flips_per_sample():
    torch.manual_seed(0)
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).view(2, 3, 4, 4)
    fill = torch.tensor([-1.0, -2.0, -3.0])
    seen_shift = seen_flip = False
    for _ in range(50):
        out = standard_augment(x, fill, padding=1)
        assert out.shape == x.shape
        for b in range(2):
            # every output pixel is an input pixel of the same channel or that channel's fill
            for c in range(3):
                values = set(out[b, c].flatten().tolist())
                assert values <= set(x[b, c].flatten().tolist()) | {fill[c].item()}
            seen_flip |= torch.equal(out[b], x[b].flip(2))
            seen_shift |= bool((out[b] == fill.view(3, 1, 1)).any())
    assert seen_flip and seen_shift


def test_standard_augment_draws_from_the_global_stream():
    x = torch.randn(8, 3, 32, 32)
    fill = torch.zeros(3)
    torch.manual_seed(1)
    a = standard_augment(x, fill)
    torch.manual_seed(1)
    b = standard_augment(x, fill)
    assert torch.equal(a, b) and not torch.equal(a, x)


def test_augment_auto_resolves_per_dataset():
    from fedaval.training import resolve_augment

    data = lambda name, shape: SimpleNamespace(name=name, input_shape=shape)  # noqa: E731
    assert resolve_augment("auto", data("digits", (1, 8, 8))) == "none"
    assert resolve_augment("auto", data("cifar10", (3, 32, 32))) == "standard"
    assert resolve_augment("auto", data("imagefolder", (3, 32, 32))) == "standard"
    assert resolve_augment("auto", data("imagefolder", (3, 224, 224))) == "none"
    assert resolve_augment("none", data("cifar10", (3, 32, 32))) == "none"


class BatchProbe:
    name = "batch-probe"

    def __init__(self):
        self.first: torch.Tensor | None = None

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        if self.first is None:
            self.first = batch.x.detach().clone()


def test_augmentation_reaches_training_and_is_the_same_on_both_data_paths(tiny_config, tmp_path):
    from helpers import strip_timing

    runs = {}
    for augment in ("none", "standard"):
        for path in ("device", "loader"):
            probe = BatchProbe()
            results = run_training(
                tiny_config(augment=augment, data_path=path, out=str(tmp_path / f"{augment}-{path}")),
                extra_plugins=[probe],
            )
            runs[(augment, path)] = (strip_timing(results["rounds"]), probe.first)
    assert runs[("standard", "device")][0] == runs[("standard", "loader")][0]
    assert torch.equal(runs[("standard", "device")][1], runs[("standard", "loader")][1])
    assert not torch.equal(runs[("standard", "device")][1], runs[("none", "device")][1])


def test_defaults_depend_on_the_dataset_and_given_values_win():
    digits = RunConfig(dataset="digits")
    digits.validate()
    assert (digits.lr, digits.momentum, digits.local_epochs) == (0.05, 0.0, 2)
    cifar = RunConfig(dataset="cifar10")
    cifar.validate()
    assert (cifar.lr, cifar.momentum, cifar.local_epochs) == (0.01, 0.9, 1)
    mine = RunConfig(dataset="digits", lr=0.02, local_epochs=1)
    mine.validate()
    assert (mine.lr, mine.momentum, mine.local_epochs) == (0.02, 0.0, 1)


def test_adam_has_its_own_defaults_and_given_values_win():
    adam = RunConfig(dataset="cifar10", optimizer="adam")
    adam.validate()
    assert (adam.lr, adam.momentum, adam.local_epochs) == (1e-3, 0.0, 1)
    mine = RunConfig(dataset="digits", optimizer="adam", lr=0.01, momentum=0.0)
    mine.validate()
    assert (mine.lr, mine.momentum, mine.local_epochs) == (0.01, 0.0, 2)


class AdamProbe:
    """Each client's optimizer, and how many parameters hold Adam moments
    at the first step of every round."""

    name = "adam-probe"

    def __init__(self):
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.moments_at_start: list[int] = []

    @hookimpl
    def fedaval_client_epoch_start(self, run, client, epoch):
        if epoch == 0:
            optimizer = client.strategy.optimizer
            self.optimizers[client.id] = optimizer
            self.moments_at_start.append(sum(1 for s in optimizer.state.values() if "exp_avg" in s))


@pytest.mark.parametrize("optimizer_state", ["reset", "keep"])
def test_adam_trains_the_clients_and_its_state_follows_the_policy(tiny_config, optimizer_state):
    probe = AdamProbe()
    results = run_training(
        tiny_config(optimizer="adam", lr=0.005, weight_decay=0.0, optimizer_state=optimizer_state),
        extra_plugins=[probe],
    )
    assert all(isinstance(o, torch.optim.Adam) for o in probe.optimizers.values()) and probe.optimizers
    group = next(iter(probe.optimizers.values())).param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (0.005, 0.0)
    if optimizer_state == "reset":
        assert probe.moments_at_start == [0] * len(probe.moments_at_start)
    else:
        assert probe.moments_at_start[:2] == [0, 0] and all(n > 0 for n in probe.moments_at_start[2:])
    matrix = results["final"]["accuracy_matrix"]
    assert matrix[0][0] > 0.7 and matrix[1][1] > 0.7, matrix  # each task learnt (chance: 50%)


@pytest.mark.parametrize("plugin", ["fednova", "apfl"])
def test_methods_whose_update_is_sgds_refuse_adam(tmp_path, plugin):
    from helpers import one_line_error

    line = one_line_error(["train", "-p", plugin, "--optimizer", "adam", "--out", str(tmp_path / "r")])
    assert f"{plugin} needs --optimizer sgd" in line and "not --optimizer adam" in line


@pytest.mark.slow
def test_the_default_digits_run_learns_every_task(tmp_path):
    """The README's default job, FedAvg on fcil-sync digits: each task is
    learnt when it is taught (the accuracy matrix's diagonal), where lr 0.01 x
    1 epoch reached 51% on the first task."""
    results = run_training(RunConfig(device="cpu", out=str(tmp_path / "run"), checkpoint_every=0))
    matrix = results["final"]["accuracy_matrix"]
    assert all(matrix[t][t] >= 0.85 for t in range(len(matrix))), matrix


def test_deterministic_switches_torch_to_deterministic_algorithms(tiny_config, tmp_path):
    from fedaval.build import build_run

    try:
        build_run(tiny_config(deterministic=True, out=str(tmp_path / "a")))
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        build_run(tiny_config(deterministic=False, out=str(tmp_path / "b")))
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False


def test_avalanche_checks_a_strategys_arguments_once_per_class_and_names(monkeypatch):
    """A second construction with the same argument names skips Avalanche's
    signature walks (the argument names, the positional parameters); a
    misspelt argument is still refused naming it."""
    import inspect

    from fedaval.strategy import FederatedStrategy

    def build(**extra):
        model = torch.nn.Linear(2, 2)
        return FederatedStrategy(
            run=None, client=None, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **extra
        )

    build(train_mb_size=7)
    calls = []
    signature = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda *a, **k: calls.append(a) or signature(*a, **k))
    build(train_mb_size=8)
    repeated = len(calls)
    assert repeated == 0
    calls.clear()
    build(train_mb_size=8, train_epochs=2)  # new names: checked, a signature per class of the MRO
    assert len(calls) >= repeated + len(FederatedStrategy.__mro__) - 2
    with pytest.raises(TypeError, match="train_mb_sise"):
        build(train_mb_sise=8)


def test_a_task_start_leaves_an_optimizer_that_holds_the_model_as_it_is_without_avalanches_tree(monkeypatch):
    """At a task start Avalanche's ``update_optimizer`` builds a tree of
    parameter groups (about 1.5 ms per cross-device client); fedaval skips
    it when the optimizer already holds every parameter under its name of
    last time, with the same result. A model that grew still goes through
    Avalanche, which gives the optimizer the new parameter."""
    from avalanche.training.templates.observation_type import batch_observation

    from fedaval.strategy import FederatedStrategy

    calls = []
    original = batch_observation.update_optimizer
    monkeypatch.setattr(batch_observation, "update_optimizer", lambda *a, **k: calls.append(a) or original(*a, **k))
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    strategy = FederatedStrategy(run=None, client=None, model=model, optimizer=optimizer, train_mb_size=4)

    strategy.make_optimizer(reset_optimizer_state=True)  # the first call: no names yet
    strategy.make_optimizer()
    assert calls == []
    assert strategy.optimized_param_id == dict(model.named_parameters())
    assert optimizer.param_groups[0]["params"] == list(model.parameters())

    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert len(optimizer.state) == 4  # momentum buffers
    strategy.make_optimizer()
    assert len(optimizer.state) == 4  # kept, as Avalanche keeps them
    strategy.make_optimizer(reset_optimizer_state=True)
    assert len(optimizer.state) == 0

    model.append(torch.nn.Linear(2, 2))  # the model grew: Avalanche's way
    strategy.make_optimizer()
    assert len(calls) == 1
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in model.parameters()}
    assert strategy.optimized_param_id == dict(model.named_parameters())
