"""What a round writes (issue 24): every round appended to rounds.jsonl,
results.json rewritten on its schedule only, checkpoints written in the
background and read back in either format, no per-round history kept in the
evaluators."""

from __future__ import annotations

import json

from helpers import strip_timing


def test_rounds_jsonl_has_every_round_and_results_json_follows_its_schedule(tiny_config, tmp_path, monkeypatch):
    import fedaval.coordinator as coordinator
    from fedaval.api import run_training

    written = []
    real = coordinator.atomic_write_json

    def record(path, data):
        written.append(data["status"]["rounds_done"])
        real(path, data)

    monkeypatch.setattr(coordinator, "atomic_write_json", record)
    monkeypatch.setattr(coordinator.ResultsSchedule, "SECONDS", 1e9)  # no time-based rewrite in this test
    out = tmp_path / "run"
    results = run_training(tiny_config(out=str(out), rounds_per_task=3))
    # round 1, the two stages' last rounds (3, 6), and the complete run: never rounds 2, 4 or 5
    assert written == [1, 3, 6, 6]
    assert coordinator.read_rounds(out) == json.loads((out / "results.json").read_text())["rounds"]
    assert [r["round"] for r in coordinator.read_rounds(out)] == [1, 2, 3, 4, 5, 6]
    assert results["final"] == json.loads((out / "results.json").read_text())["final"]

    # a kill in the middle of an append leaves an unfinished last line, which is skipped
    with open(out / coordinator.ROUNDS_FILE, "a") as fh:
        fh.write('{"round": 7, "ta')
    assert len(coordinator.read_rounds(out)) == 6


def test_resume_rewrites_rounds_jsonl_from_the_checkpoint(tiny_config, tmp_path):
    from fedaval import checkpoint
    from fedaval.api import run_training
    from fedaval.build import build_run
    from fedaval.coordinator import read_rounds, train

    config = tiny_config(out=str(tmp_path / "whole"), rounds_per_task=3, keep_checkpoints=10)
    whole = strip_timing(run_training(config))
    assert sorted(r for r, _ in checkpoint.saved(tmp_path / "whole")) == [1, 2, 3, 4, 5, 6], (
        "every round, in the background"
    )
    assert not list((tmp_path / "whole").rglob("*.tmp"))

    resumed_dir = tmp_path / "whole"  # resume in place from round 4: rounds.jsonl holds 6 rounds, must end with 6 again
    run = build_run(config, out_dir=resumed_dir)
    results = checkpoint.restore(run, checkpoint.path_for(resumed_dir, 4))
    assert len(results["rounds"]) == 4
    assert strip_timing(train(run, results=results)) == whole
    assert strip_timing(read_rounds(resumed_dir)) == whole["rounds"]


def test_a_checkpoint_of_format_1_is_still_read(tiny_config, tmp_path):
    from fedaval import checkpoint, state
    from fedaval.atomic import atomic_file
    from fedaval.build import build_run
    from fedaval.random_streams import rng_state

    config = tiny_config(out=str(tmp_path / "run"))
    run = build_run(config, out_dir=tmp_path / "run")
    run.round = 1
    path = checkpoint.path_for(tmp_path / "run", 1)
    path.parent.mkdir(parents=True)
    content = {
        "format": 1,
        "round": 1,
        "task": 0,
        "clients": run.clients,
        "server": run.server,
        "plugins": {name: checkpoint.plugin_state(obj) for name, obj in run.plugins.objects.items()},
        "rng": rng_state(run.device),
        "results": {"rounds": [{"round": 1}]},
    }
    with atomic_file(path) as fh:
        state.dump(run, content, fh)
    fresh = build_run(config, out_dir=tmp_path / "run")
    assert checkpoint.restore(fresh, path) == {"rounds": [{"round": 1}]}
    assert fresh.round == 1 and len(fresh.clients) == len(run.clients)


def test_evaluators_keep_no_history_so_state_does_not_grow_with_rounds(tiny_config, tmp_path):
    from fedaval import hookimpl
    from fedaval.api import run_training

    class Keep:
        @hookimpl
        def fedaval_setup(self, run):
            self.run = run

    keep = Keep()
    run_training(tiny_config(out=str(tmp_path / "run")), extra_plugins=[keep])
    for strategy in [keep.run.server.strategy, *(c.strategy for c in keep.run.clients)]:
        assert strategy.evaluator.collect_all is False
        assert not strategy.evaluator.all_metric_results
        assert strategy.evaluator.get_last_metrics()  # the last values are still there
