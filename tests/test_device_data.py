"""The device data path gives the loader path's minibatches, bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers import strip_timing


def test_batch_is_the_stacked_samples(cifar10_root):
    from fedaval.datasets import TensorImageDataset, load_dataset

    for data in (load_dataset("digits", None, False), load_dataset("imagefolder", str(cifar10_root), False)):
        indices = torch.randperm(len(data.train_y), generator=torch.Generator().manual_seed(0))[:70]
        ds = TensorImageDataset(data.train_x, data.train_y, indices.numpy(), data.mean, data.std)
        positions = torch.tensor([5, 0, 69, 5, 33])
        x, y = ds.batch(positions, data.train_x, data.train_y)
        assert torch.equal(x, torch.stack([ds[int(i)][0] for i in positions]))
        assert torch.equal(y, torch.stack([ds[int(i)][1] for i in positions]))
        assert x.dtype == torch.float32 and y.dtype == torch.int64


@pytest.mark.parametrize(
    "settings",
    [
        dict(plugins=["fedavg"]),
        dict(plugins=["gldp"], scenario="sthfl", scenario_options={"clients": 3, "tasks": 2, "classes_per_task": 2}),
        dict(plugins=["pfcl"], scenario="fcl-random", scenario_options={"clients": 2}),
        dict(plugins=["avalanche:ReplayPlugin"], plugin_options={"avalanche": {"mem_size": "40"}}),
        dict(plugins=["fedprok"]),  # its prototypes' and classifier fit's feature extraction
    ],
    ids=["fedavg", "gldp", "pfcl", "replay", "fedprok"],
)
def test_same_results_on_both_paths(tiny_config, tmp_path, settings):
    from fedaval.api import run_training

    results = {}
    for path in ("loader", "device"):
        out = strip_timing(run_training(tiny_config(out=str(tmp_path / path), data_path=path, **settings)))
        out["config"].pop("data_path")
        results[path] = out
    assert results["loader"] == results["device"]


def test_the_device_path_is_taken_where_it_applies(tiny_config, monkeypatch):
    from fedaval import device_data, one_pass_eval
    from fedaval.build import build_run
    from fedaval.coordinator import train

    made = []
    original = device_data.DeviceBatches.__init__

    def counting(self, run, loader, source, split):
        made.append((split, type(loader).__name__))
        original(self, run, loader, source, split)

    evaluated = []
    original_eval = one_pass_eval.joined_test_batches

    def counting_eval(run, sources, batch_size):
        evaluated.append(len(sources))
        return original_eval(run, sources, batch_size)

    monkeypatch.setattr(device_data.DeviceBatches, "__init__", counting)
    monkeypatch.setattr(one_pass_eval, "joined_test_batches", counting_eval)
    train(build_run(tiny_config(data_path="auto")))
    assert {"train"} == {split for split, _ in made}  # evaluation makes no loader at all:
    assert {"DataLoader"} == {kind for _, kind in made}
    assert evaluated  # the test split's minibatches, made on the device (fedaval.one_pass_eval)

    made.clear()
    evaluated.clear()
    train(build_run(tiny_config(data_path="loader")))
    assert made == [] and evaluated == []

    made.clear()
    replay = build_run(tiny_config(plugins=["avalanche:ReplayPlugin"], data_path="device"))
    train(replay)
    # task 1's loader is ours; from task 2 the ReplayPlugin brings its own loader
    # (over data + buffer), which is used as it is
    assert sum(split == "train" for split, _ in made) == 2 * len(replay.clients)


def test_evaluation_batches_and_random_streams_match_the_loader_path(tiny_config):
    """An evaluation on the device path makes no Avalanche or torch loader, yet
    gives the loader's minibatches and leaves the global generator where the
    loader leaves it (the DataLoader iterator's one draw per experience)."""
    from fedaval.build import build_run

    outcomes = {}
    for path in ("loader", "device"):
        run = build_run(tiny_config(data_path=path, scenario_options={"clients": 2, "tasks": 3}))
        run.server.begin_task(0)
        run.server.begin_task(1)
        torch.manual_seed(7)
        metrics = run.server.evaluate()
        outcomes[path] = (metrics, torch.rand(3))
    assert outcomes["loader"][0] == outcomes["device"][0]
    assert torch.equal(outcomes["loader"][1], outcomes["device"][1])

    from avalanche.benchmarks.utils.data_loader import SingleDatasetDataLoader

    from fedaval.device_data import eval_batches

    data = run.server.test_stream[1].dataset.eval()
    expected = list(SingleDatasetDataLoader(data, batch_size=5))
    got = list(eval_batches(run, data, 5))
    assert len(got) == len(expected) > 2 and len(got[-1][1]) == len(expected[-1][1])
    for (x, y, t), (ex, ey, et) in zip(got, expected):
        assert torch.equal(x.cpu(), ex) and torch.equal(y.cpu(), ey) and torch.equal(t.cpu(), et)


def test_evaluation_gathers_the_test_minibatches_once_per_run(tiny_config, monkeypatch):
    """The test split's evaluation minibatches are gathered and normalised at
    their first evaluation and reused from the run's cache after that: the
    same metrics, the same global random stream, no second gather; a cache
    too small to hold them gathers every time."""
    from fedaval import device_data
    from fedaval.build import build_run
    from fedaval.datasets import TensorImageDataset

    gathered = []
    original = TensorImageDataset.batch

    def counting(self, positions, images, labels):
        gathered.append(len(positions))
        return original(self, positions, images, labels)

    monkeypatch.setattr(TensorImageDataset, "batch", counting)
    outcomes = []
    for budget in (device_data.TEST_BATCH_CACHE_BYTES, 0):
        monkeypatch.setattr(device_data, "TEST_BATCH_CACHE_BYTES", budget)
        run = build_run(tiny_config(data_path="device", scenario_options={"clients": 2, "tasks": 3}))
        run.server.begin_task(0)
        run.server.begin_task(1)
        gathered.clear()
        torch.manual_seed(7)
        first = run.server.evaluate()
        first_gathers = len(gathered)
        second = run.server.evaluate()
        outcomes.append((first, second, torch.rand(3), first_gathers, len(gathered) - first_gathers))
    (first, second, draw, gathers, regathers), (nc_first, nc_second, nc_draw, nc_gathers, nc_regathers) = outcomes
    assert gathers > 0 and regathers == 0 and run.test_batches == {}
    assert nc_regathers == nc_gathers == gathers
    assert first == second == nc_first == nc_second
    assert torch.equal(draw, nc_draw)


def test_feature_extraction_of_a_client_dataset_takes_the_device_path(tiny_config, monkeypatch):
    """The prototype methods' feature extraction (``prototypes.extract_features``
    with the run) reads a client's task data on the device path: no sample
    goes through ``__getitem__``, and the features, the labels and the global
    random stream afterwards are the loader path's."""
    from fedaval.build import build_run
    from fedaval.datasets import TensorImageDataset
    from fedaval.prototypes import extract_features

    run = build_run(tiny_config(data_path="device"))
    client = run.clients[0]
    dataset = client.train_stream[0].dataset
    torch.manual_seed(3)
    expected = extract_features(client.model, dataset, run.device, batch_size=64)
    expected_draw = torch.rand(3)

    def no_sample(self, i):
        raise AssertionError("a sample went through __getitem__")

    monkeypatch.setattr(TensorImageDataset, "__getitem__", no_sample)
    torch.manual_seed(3)
    got = extract_features(client.model, dataset, run.device, batch_size=64, run=run)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(torch.rand(3), expected_draw)


def test_evaluation_does_not_move_a_model_already_on_the_device(tiny_config, monkeypatch):
    from fedaval.build import build_run

    run = build_run(tiny_config(scenario_options={"clients": 2, "tasks": 3}))
    for task in range(3):
        run.server.begin_task(task)
    moved = []
    original = torch.nn.Module.to
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: moved.append(a) or original(self, *a, **k))
    assert run.server.evaluate()
    assert moved == []


def test_evaluation_adapts_the_model_per_experience_only_if_it_has_dynamic_modules(tiny_config):
    """Avalanche's model adaptation (a walk over every module) runs for each
    evaluated experience only when the model has a dynamic module to adapt;
    otherwise it is skipped after one check per ``eval()`` call."""
    from avalanche.models.dynamic_modules import DynamicModule

    from fedaval.build import build_run

    class Recorder(DynamicModule):
        def __init__(self):
            super().__init__()
            self.seen = []

        def adaptation(self, experience):
            self.seen.append(experience.current_experience)

    run = build_run(tiny_config(scenario_options={"clients": 2, "tasks": 3}))
    calls = []
    walk = run.server.model.modules
    run.server.model.modules = lambda: calls.append(1) or walk()
    walks = []
    for task in range(3):
        run.server.begin_task(task)
        calls.clear()
        assert run.server.evaluate()
        walks.append(len(calls))
    assert walks[0] <= 2 and walks == [walks[0]] * 3  # checks per call, none per experience
    run.server.model.recorder = Recorder()
    assert run.server.evaluate()
    assert run.server.model.recorder.seen == [0, 1, 2]


def test_saved_clients_refer_to_the_run_data(tiny_config, tmp_path):
    from fedaval import state
    from fedaval.build import build_run
    from fedaval.coordinator import train

    run = build_run(tiny_config())
    train(run)
    blob = state.dumps(run, run.clients[0])
    other = build_run(tiny_config())
    client = state.loads(other, blob)
    source = client.train_stream[0].dataset._datasets[0]
    assert source.images is other.data.train_x
    images = run.data.train_x
    assert len(blob) < images.numel() * images.element_size()
