"""--offload-clients: clients not sampled next round keep only a pickle, with no change to any result."""

from __future__ import annotations

import pytest
import torch
from helpers import AGEM, MIR, RAR, strip_timing

METHODS = {
    "fedavg": dict(plugins=["fedavg"]),
    # GLDP's round metrics read every client's model from the server side
    "gldp": dict(
        plugins=["gldp"], scenario="sthfl", scenario_options={"clients": 4, "tasks": 2, "classes_per_task": 2}
    ),
    "pfcl": dict(plugins=["pfcl"], scenario="fcl-random", scenario_options={"clients": 4}),
    "replay": dict(plugins=["avalanche:ReplayPlugin"], plugin_options={"avalanche": {"mem_size": "40"}}),
    # live iterators over their memories between rounds: until session 36 they could not be offloaded
    "agem": dict(plugins=["avalanche:AGEMPlugin"], plugin_options={"avalanche": AGEM}),
    "mir": dict(plugins=["avalanche:MIRPlugin"], plugin_options={"avalanche": MIR}),
    "rar": dict(plugins=["avalanche:RARPlugin"], plugin_options={"avalanche": RAR}),
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
        tiny_config(scenario_options={"clients": 4, "tasks": 2}, clients_per_round=1, offload_clients="cpu")
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


def test_auto_offloads_when_sampling_and_live_clients_would_not_fit(tiny_config, monkeypatch):
    from fedaval import offload
    from fedaval.build import build_run

    settings = dict(scenario_options={"clients": 4, "tasks": 2}, clients_per_round=1, offload_clients="auto")
    run = build_run(tiny_config(**settings))
    assert run.offload_auto == "none" and not any(c.offloaded for c in run.clients)  # 4 small clients fit
    stored = run.clients[0].offload()
    run.clients[0].materialise()
    # what 4 live clients need is about `budget` (the first client's stored state when built differs a little)
    budget = offload.LIVE_FACTOR * stored * 4 / offload.MEMORY_SHARE
    monkeypatch.setattr(offload, "available_memory", lambda device: int(budget / 2))
    run = build_run(tiny_config(**settings))
    assert run.offload_auto == "cpu" and all(c.offloaded for c in run.clients)
    monkeypatch.setattr(offload, "available_memory", lambda device: int(budget * 2))
    assert build_run(tiny_config(**settings)).offload_auto == "none"


def test_available_memory_is_a_plausible_byte_count():
    from fedaval.offload import available_memory

    assert 2**20 < available_memory(torch.device("cpu")) < 2**50


@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_resume_with_offloaded_clients(tiny_config, tmp_path, where):
    """``cpu``: the checkpoint holds the offloaded clients' kept storages (as their raw bytes)."""
    from fedaval import checkpoint
    from fedaval.api import run_training
    from fedaval.build import build_run
    from fedaval.coordinator import train

    config = tiny_config(
        out=str(tmp_path / "whole"),
        scenario_options={"clients": 4, "tasks": 2},
        clients_per_round=2,
        offload_clients=where,
        keep_checkpoints=10,
    )
    whole = strip_timing(run_training(config))
    run = build_run(config, out_dir=tmp_path / "resumed")
    results = checkpoint.restore(run, checkpoint.path_for(tmp_path / "whole", 3))
    assert strip_timing(train(run, results=results)) == whole


def test_offloading_to_memory_keeps_the_tensors_storages_instead_of_copying_them(tiny_config):
    """``--offload-clients cpu`` pickles a client without its tensors' bytes:
    the storages are kept by reference and the loaded client's tensors use
    them again (before: every storage was serialised into the pickle, most of
    the cost of offloading a small client)."""
    from fedaval.build import build_run
    from fedaval.state import KeptStorages

    run = build_run(tiny_config(scenario_options={"clients": 4, "tasks": 2}, clients_per_round=1))
    client = run.clients[0]
    weight = client.model.classifier.weight
    pointer, values = weight.untyped_storage().data_ptr(), weight.detach().clone()
    stored = client.offload()
    blob, kept = client._offloaded
    assert isinstance(kept, KeptStorages) and stored == len(blob) + kept.nbytes == client.stored_nbytes
    assert values.cpu().numpy().tobytes() not in blob  # the weights are not in the pickle
    assert all(s.device.type == "cpu" for s in kept.storages)  # a GPU's storages wait in host memory
    if weight.device.type == "cpu":  # on the CPU, kept as they are and used again
        assert pointer in {s.data_ptr() for s in kept.storages}
    else:  # on a GPU, copied to the host (the device memory is freed) and back to the device when loaded
        assert f"{weight.device.type}:{weight.device.index or 0}" in kept.devices
    loaded = client.model.classifier.weight
    assert loaded is not weight and loaded.device == weight.device
    assert (loaded.untyped_storage().data_ptr() == pointer) == (weight.device.type == "cpu")
    assert torch.equal(loaded, values) and loaded.grad is None


@pytest.mark.parametrize("protocol", [4, 5])
def test_kept_storages_pickle_as_raw_bytes_and_come_back_equal(protocol):
    import pickle

    from fedaval.state import KeptStorages

    tensors = [torch.arange(6, dtype=torch.float32), torch.tensor([1, 2], dtype=torch.int64), torch.zeros(0)]
    kept = KeptStorages()
    for t in tensors:
        kept.keep(t._typed_storage())
    kept.keep(torch.tensor([7], dtype=torch.uint8).untyped_storage())
    data = pickle.dumps(kept, protocol=protocol)
    assert data.count(b"PK") == 0  # no torch.save archive per storage
    back = pickle.loads(data)
    assert len(back) == 4 and back.nbytes == kept.nbytes
    for t, storage in zip(tensors, back.storages):  # bytes only: the dtype goes with each tensor's reference
        assert isinstance(storage, torch.UntypedStorage)
        assert torch.equal(torch.tensor([], dtype=t.dtype).set_(storage, 0, t.shape, t.stride()), t)
    assert bytes(torch.empty(0, dtype=torch.uint8).set_(back.storages[3]).numpy()) == bytes([7])
    first = torch.tensor([], dtype=torch.float32).set_(back.storages[0], 0, (6,), (1,))
    first[0] = 99.0  # storages of their own, not views of the pickle's bytes
    assert first[0] == 99.0 and tensors[0][0] == 0.0


def test_kept_storages_of_format_2_checkpoints_are_still_read():
    """Until session 10 every storage's bytes went into one bytes object."""
    import numpy as np

    from fedaval.state import _unpack_storages

    a, b = torch.arange(3, dtype=torch.float32), torch.tensor([5], dtype=torch.int64)
    data = np.concatenate([a.numpy().view(np.uint8), b.numpy().view(np.uint8)]).tobytes()
    back = _unpack_storages([("float32", None, 12), ("int64", None, 8)], data)
    assert torch.equal(torch.tensor([], dtype=torch.float32).set_(back.storages[0]), a)
    assert torch.equal(torch.tensor([], dtype=torch.int64).set_(back.storages[1]), b)


def test_a_copying_keep_holds_the_storage_as_it_was_and_keeps_shared_storages_shared():
    """A checkpoint keeps copies (the next round changes the tensors in place);
    two tensors on one storage are one storage again when loaded."""
    import io

    from fedaval.state import KeptStorages, RunPickler, RunUnpickler

    base = torch.arange(4, dtype=torch.float32)
    view = base[1:]
    kept = KeptStorages(copy=True)
    buffer = io.BytesIO()
    RunPickler(buffer, {}, keep=kept).dump([base, view])
    base.add_(10)  # after the snapshot
    assert len(kept) == 1
    loaded_base, loaded_view = RunUnpickler(io.BytesIO(buffer.getvalue()), {}, keep=kept).load()
    assert torch.equal(loaded_base, torch.arange(4, dtype=torch.float32))
    loaded_base[1] = -1.0
    assert loaded_view[0] == -1.0  # still one storage


def test_state_is_pickled_and_unpickled_with_the_cyclic_gc_off_and_turned_back_on(tiny_config):
    import gc

    from fedaval import state
    from fedaval.build import build_run

    seen = []

    class Probe:
        def __reduce__(self):
            seen.append(gc.isenabled())
            return (gc.isenabled, ())  # called when unpickled: what it returns is loaded

    run = build_run(tiny_config())
    assert gc.isenabled()
    assert state.loads(run, state.dumps(run, Probe())) is False
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        state.dumps(run, Probe())
        assert not gc.isenabled()  # left as it was
    finally:
        gc.enable()


def test_clients_share_the_runs_test_experiences_and_save_them_by_name(tiny_config, tmp_path):
    """One test experience per task and set of new classes for the whole run
    (before: one copy per client), written by name in offloaded clients and
    checkpoints, and the same objects again after a resume."""
    from fedaval import checkpoint, state
    from fedaval.api import run_training
    from fedaval.build import build_run

    config = tiny_config(
        out=str(tmp_path / "run"), scenario_options={"clients": 4, "tasks": 2, "alpha": 100.0}, clients_per_round=2
    )
    run = build_run(config)
    streams = [c.test_stream for c in run.clients]
    assert all(s[t] is streams[0][t] for s in streams for t in range(2))  # alpha=100: every client has every class
    assert set(map(id, run.test_experiences.values())) == {id(e) for e in streams[0]}
    assert len(state.dumps(run, streams[0])) < 200  # names, not datasets
    run_training(config)
    resumed = build_run(config, out_dir=tmp_path / "resumed")
    checkpoint.restore(resumed, checkpoint.saved(tmp_path / "run")[0][1])
    assert all(
        c.test_stream[t] is resumed.test_experiences[n]
        for c in resumed.clients
        for t, n in enumerate(sorted(resumed.test_experiences))
    )


def test_plain_tensors_are_written_as_references_to_kept_storages_and_load_as_torch_loads_them(monkeypatch):
    """A kept pickle writes a plain tensor or parameter as one reference (its
    storage's index, offset, size, stride, dtype, requires_grad) instead of
    torch's ``__reduce_ex__``; what loads is what torch's reduction loads.
    Tensors torch reduces differently (Python attributes, a conjugate bit)
    still go through torch, and still share their storage with plain ones."""
    import io

    from fedaval.state import KeptStorages, RunPickler, RunUnpickler

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    column = base[:, 1]  # a view: offset 1, stride (4,)
    as_ints = base.view(torch.int32)  # the same storage, another dtype
    weight = torch.nn.Parameter(torch.ones(2, 2))
    frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    leaf = torch.ones(2, requires_grad=True)
    tagged = base[0]  # torch's way: a Python attribute
    tagged.note = "kept"
    conj = torch.tensor([1 + 2j]).conj()  # torch's way: the conjugate bit
    objects = [base, column, as_ints, weight, frozen, leaf, tagged, conj, weight]

    torch_reductions = []
    original = torch.Tensor.__reduce_ex__
    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", lambda t, p: torch_reductions.append(t) or original(t, p))
    kept = KeptStorages(copy=True)
    buffer = io.BytesIO()
    RunPickler(buffer, {}, keep=kept).dump(objects)
    assert [id(t) for t in torch_reductions] == [id(tagged), id(conj)]
    assert len(kept) == 5  # base's storage once for base, column, as_ints and tagged

    loaded = RunUnpickler(io.BytesIO(buffer.getvalue()), {}, keep=kept).load()
    for before, after in zip(objects, loaded, strict=True):
        assert type(after) is type(before) and after.dtype == before.dtype
        assert after.shape == before.shape and after.stride() == before.stride()
        assert after.storage_offset() == before.storage_offset() and after.requires_grad == before.requires_grad
        assert torch.equal(after.resolve_conj(), before.resolve_conj()) and after.grad is None
    new_base, new_column, new_ints, new_weight, _, _, new_tagged, _, weight_again = loaded
    assert weight_again is new_weight and new_tagged.note == "kept"
    new_base[0, 1] = -1.0
    assert new_column[0] == -1.0 and new_tagged[1] == -1.0  # one storage again, torch's way included
    assert new_ints[0, 1] == torch.tensor([-1.0]).view(torch.int32)


def test_ordered_dicts_are_written_without_copyregs_slotnames(monkeypatch):
    """``copyreg._slotnames`` cannot cache its answer on ``OrderedDict`` (a
    built-in type), so OrderedDict's own reduction called it for each of the
    dozen OrderedDicts of every ``nn.Module``; the pickler writes them as that
    reduction does, without the call. An OrderedDict with attributes still
    takes its own reduction."""
    import copyreg
    import io
    from collections import OrderedDict

    from fedaval.state import RunPickler, RunUnpickler

    calls = []
    original = copyreg._slotnames
    monkeypatch.setattr(copyreg, "_slotnames", lambda cls: calls.append(cls) or original(cls))
    plain = OrderedDict([("b", 1), ("a", [2])])
    empty = OrderedDict()
    with_attribute = OrderedDict(x=1)
    with_attribute.note = "kept"
    buffer = io.BytesIO()
    RunPickler(buffer, {}).dump([plain, empty, plain])
    assert calls == []
    back = RunUnpickler(io.BytesIO(buffer.getvalue()), {}).load()
    assert back == [plain, empty, plain] and list(back[0]) == ["b", "a"] and back[0] is back[2]
    assert all(type(d) is OrderedDict for d in back)
    buffer = io.BytesIO()
    RunPickler(buffer, {}).dump(with_attribute)
    loaded = RunUnpickler(io.BytesIO(buffer.getvalue()), {}).load()
    assert loaded == with_attribute and loaded.note == "kept"
