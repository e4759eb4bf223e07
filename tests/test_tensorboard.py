"""TensorBoard holds Avalanche's accuracy and forgetting for the global model and each client."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fedaval import hookimpl


def test_avalanche_metrics_per_owner_in_tensorboard(tiny_config, tmp_path):
    from fedaval.api import run_training

    run_training(tiny_config())
    tags = set()
    for path in (tmp_path / "run" / "tb").glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(path))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    for owner in ("global", "client000", "client001"):
        assert f"Top1_Acc_Stream/eval_phase/test_stream/{owner}" in tags
        assert f"StreamForgetting/eval_phase/test_stream/{owner}" in tags
        assert f"Top1_Acc_Exp/eval_phase/test_stream/Exp000/{owner}" in tags
    assert {"Fed/bytes_up", "Fed/a_glo", "Fed/utility", "Fed/loss/classification"} <= tags
    # the x axis is the federated round
    events = list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1  # one writer for the server and every client
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("Top1_Acc_Stream/eval_phase/test_stream/global")]
    assert steps == [1, 2, 3, 4]


def test_a_rounds_scalars_are_one_event_with_the_values_of_the_record(tiny_config, tmp_path):
    """Every scalar of a round (Avalanche's metrics of every owner, the round's
    own figures) goes to the events file as one event at the round's step."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from fedaval.api import run_training

    results = run_training(tiny_config())
    (path,) = (tmp_path / "run" / "tb").glob("events.out.tfevents.*")
    events = [e for e in EventFileLoader(str(path)).Load() if e.HasField("summary")]
    assert [e.step for e in events] == [1, 2, 3, 4]
    for event, record in zip(events, results["rounds"]):
        values = {v.tag: v for v in event.summary.value}
        assert "Top1_Acc_Stream/eval_phase/test_stream/client001" in values
        stored = values["Fed/a_glo"]  # the loader turns simple values into tensors
        value = stored.simple_value if stored.HasField("simple_value") else stored.tensor.float_val[0]
        assert abs(value - record["a_glo"]) < 1e-6


INTERRUPT_AT = {"round": 4}


class InterruptOnce:
    """Ctrl-C when round ``INTERRUPT_AT["round"]`` begins (module state: a
    plugin attribute would come back from the checkpoint)."""

    name = "interrupt-once"

    @hookimpl
    def fedaval_client_epoch_start(self, run, client, epoch):
        if run.round == INTERRUPT_AT.get("round"):
            INTERRUPT_AT.clear()
            raise KeyboardInterrupt


def test_a_resumed_run_logs_each_round_once(tiny_config, tmp_path):
    """Interrupted in round 4 with round 2's checkpoint the newest, the run had
    logged round 3; resumed, it logs round 3 again. TensorBoard showed both
    (steps 1, 2, 3, 3, 4, with the first try's values) until the resumed writer
    purged from the round it runs again."""
    from fedaval.api import resume_training, run_training
    from fedaval.errors import RunInterrupted

    probe = InterruptOnce()
    with pytest.raises(RunInterrupted):
        run_training(tiny_config(checkpoint_every=2), extra_plugins=[probe])
    results = resume_training(tmp_path / "run", extra_plugins=[probe])
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    logged = acc.Scalars("Fed/seconds")
    assert [e.step for e in logged] == [1, 2, 3, 4]
    assert [e.value for e in logged] == pytest.approx([r["seconds"] for r in results["rounds"]])
