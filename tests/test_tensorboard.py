"""TensorBoard holds Avalanche's accuracy and forgetting for the global model and each client."""

from __future__ import annotations

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


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
