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
    ],
    ids=["fedavg", "gldp", "pfcl", "replay"],
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
    from fedaval import device_data
    from fedaval.build import build_run
    from fedaval.coordinator import train

    made = []
    original = device_data.DeviceBatches.__init__

    def counting(self, run, loader, source, split):
        made.append((split, type(loader).__name__))
        original(self, run, loader, source, split)

    monkeypatch.setattr(device_data.DeviceBatches, "__init__", counting)
    train(build_run(tiny_config(data_path="auto")))
    assert {"train", "test"} == {split for split, _ in made}
    assert {"DataLoader", "SingleDatasetDataLoader"} == {kind for _, kind in made}

    made.clear()
    train(build_run(tiny_config(data_path="loader")))
    assert made == []

    made.clear()
    replay = build_run(tiny_config(plugins=["avalanche:ReplayPlugin"], data_path="device"))
    train(replay)
    # task 1's loader is ours; from task 2 the ReplayPlugin brings its own loader
    # (over data + buffer), which is used as it is
    assert sum(split == "train" for split, _ in made) == 2 * len(replay.clients)


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
