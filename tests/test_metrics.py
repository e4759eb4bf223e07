"""The metrics mean what the papers mean: forgetting and BWT from fedaval's
accuracy matrix, utility averaged over training, efficiency E, methods
without a global model, A_sel under client sampling."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from helpers import one_line_error, tiny_run_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fedaval import hookimpl
from fedaval.evaluation import backward_transfer, forgetting, summarise

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


# ---------------------------------------------------------------- forgetting and BWT by hand


@pytest.mark.parametrize(
    "matrix, expected_forgetting, expected_bwt",
    [
        # best at the diagonal: f = (0.9 - 0.5 + 0.8 - 0.7) / 2; BWT = (0.5 - 0.9 + 0.7 - 0.8) / 2
        ([[0.9], [0.6, 0.8], [0.5, 0.7, 0.9]], 0.25, -0.25),
        # task 0 best after task 1 (0.8, not its diagonal 0.5): f0 = 0.8 - 0.4, f1 = 0.6 - 0.7
        ([[0.5], [0.8, 0.6], [0.4, 0.7, 0.9]], 0.15, 0.0),
        # stage 1 brought no class new to the federation: its column is None and skipped
        ([[0.9], [0.7, None], [0.6, None, 0.8]], 0.3, -0.3),
        # a first stage without new classes
        ([[None], [None, 0.8], [None, 0.5, 0.7]], 0.3, -0.3),
        ([[0.9]], None, None),  # one stage: nothing to forget
        ([], None, None),
    ],
)
def test_forgetting_and_bwt_from_hand_made_matrices(matrix, expected_forgetting, expected_bwt):
    f, b = forgetting(matrix), backward_transfer(matrix)
    assert (f is None) == (expected_forgetting is None) and (b is None) == (expected_bwt is None)
    if f is not None:
        assert f == pytest.approx(expected_forgetting) and b == pytest.approx(expected_bwt)


def test_forgetting_is_against_earlier_task_ends_only():
    """Chaudhry et al.: max over l < T. The last row never counts as its own best."""
    assert forgetting([[0.2], [0.9, 0.5]]) == pytest.approx(0.2 - 0.9)
    assert backward_transfer([[0.2], [0.9, 0.5]]) == pytest.approx(0.7)


# ---------------------------------------------------------------- summarise: utility and efficiency


def rounds_by_hand():
    base = {"bytes_up": 0, "bytes_down": 0, "seconds": 1.0, "seconds_computation": 0.5}
    return [
        {
            **base,
            "round": 1,
            "task_end": True,
            "mean_client_accuracy": 0.8,
            "global_accuracy": 0.9,
            "utility": None,
            "stability": None,
            "plasticity": 0.9,
            "seconds_communication": 0.1,
        },
        {
            **base,
            "round": 2,
            "task_end": False,
            "mean_client_accuracy": 0.6,
            "global_accuracy": 0.5,
            "utility": 0.6,
            "stability": 0.4,
            "plasticity": 0.8,
            "seconds_communication": 0.2,
        },
        {
            **base,
            "round": 3,
            "task_end": True,
            "mean_client_accuracy": 0.7,
            "global_accuracy": 0.45,
            "utility": 0.4,
            "stability": 0.3,
            "plasticity": 0.5,
            "seconds_communication": 0.3,
        },
    ]


def test_utility_is_the_average_over_task_ends_and_the_last_value_is_kept():
    """FedProK Sec. 4: stability and plasticity are taken "after the completion
    of training on task t" and averaged over the training. Round 2 is
    mid-stage: until session 20 it counted (utility 0.5, the mean of 0.6 and
    0.4); round 1 has no previous stage."""
    rounds = rounds_by_hand()
    final = summarise(rounds, [[0.9], [0.3, 0.5]])
    assert final["utility"] == pytest.approx(0.4)
    assert final["stability"] == pytest.approx(0.3) and final["plasticity"] == pytest.approx(0.5)
    assert (final["utility_last"], final["stability_last"], final["plasticity_last"]) == (0.4, 0.3, 0.5)
    assert final["average_accuracy"] == pytest.approx((0.9 + 0.45) / 2)
    assert final["average_client_accuracy"] == pytest.approx((0.8 + 0.7) / 2)
    assert final["forgetting"] == pytest.approx(0.6) and final["bwt"] == pytest.approx(-0.6)
    fourth = {**rounds[2], "round": 4, "utility": 0.2, "stability": 0.1, "plasticity": 0.3}
    longer = summarise([*rounds, fourth], [[0.9], [0.3, 0.5], [0.2, 0.4, 0.6]])
    assert longer["utility"] == pytest.approx(0.3)  # (0.4 + 0.2) / 2, the two stage ends with a previous stage
    assert longer["stability"] == pytest.approx(0.2) and longer["plasticity"] == pytest.approx(0.4)


def test_efficiency_is_computation_plus_communication_per_round():
    final = summarise(rounds_by_hand(), [[0.9]])
    assert final["efficiency_computation"] == pytest.approx(0.5)
    assert final["efficiency_communication"] == pytest.approx(0.2)
    assert final["efficiency"] == pytest.approx(0.7)


def test_communication_seconds_from_bytes_and_link_speed():
    from fedaval.coordinator import communication_seconds

    assert communication_seconds(12_500_000, 100) == pytest.approx(1.0)  # 100 Mbit at 100 Mbit/s
    assert communication_seconds(12_500_000, 1000) == pytest.approx(0.1)


@pytest.mark.parametrize("value", ["0", "-5"])
def test_link_speed_must_be_positive(value):
    line = one_line_error(["train", "--link-mbps", value, "--quiet"])
    assert f"--link-mbps {float(value)}" in line and "> 0" in line


# ---------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def fedavg_run(tmp_path_factory):
    from fedaval.api import run_training

    out = tmp_path_factory.mktemp("fedavg") / "run"
    return out, run_training(tiny_run_config(out, link_mbps=10.0))


def test_run_records_forgetting_from_its_matrix_and_avalanche_separately(fedavg_run):
    _, results = fedavg_run
    final = results["final"]
    assert results["federation_model"] == "global" == final["federation_model"]
    matrix = final["accuracy_matrix"]
    assert matrix == [t["accuracy"] for t in results["tasks"]]
    assert final["forgetting"] == pytest.approx(forgetting(matrix))
    assert final["bwt"] == pytest.approx(backward_transfer(matrix))
    last = results["rounds"][-1]
    assert "avalanche_forgetting" in last and "avalanche_bwt" in last
    assert final["avalanche_forgetting"] == last["avalanche_forgetting"]
    # during a stage, forgetting compares with the earlier stages' ends
    mid = results["rounds"][2]  # first round of task 1
    assert mid["forgetting"] == pytest.approx(forgetting([matrix[0], mid["global_task_accuracy"]]))


def test_run_records_efficiency_without_evaluation(fedavg_run):
    _, results = fedavg_run
    for r in results["rounds"]:
        assert r["seconds_computation"] == pytest.approx(r["seconds_local"] + r["seconds_fusion"])
        assert r["seconds_communication"] == pytest.approx((r["bytes_up"] + r["bytes_down"]) * 8 / 10e6)
        assert r["seconds_computation"] < r["seconds"]
    final = results["final"]
    n = len(results["rounds"])
    assert final["efficiency"] == pytest.approx(
        sum(r["seconds_computation"] + r["seconds_communication"] for r in results["rounds"]) / n
    )


def test_tensorboard_has_fedavals_and_avalanches_forgetting(fedavg_run):
    out, _ = fedavg_run
    tags = set()
    for path in (out / "tb").glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(path))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert {
        "Fed/forgetting",
        "Fed/bwt",
        "Fed/global_accuracy",
        "Fed/average_accuracy",
        "Fed/seconds_computation",
        "Fed/seconds_communication",
    } <= tags
    assert "StreamForgetting/eval_phase/test_stream/global" in tags


@pytest.fixture(scope="module")
def pfcl_run(tmp_path_factory):
    from fedaval.api import run_training

    out = tmp_path_factory.mktemp("pfcl") / "run"
    return out, run_training(tiny_run_config(out, plugins=["pfcl"]))


GLOBAL_FINAL = (
    "accuracy",
    "average_accuracy",
    "forgetting",
    "bwt",
    "avalanche_forgetting",
    "avalanche_bwt",
    "a_glo",
    "utility",
    "stability",
    "plasticity",
    "utility_last",
    "accuracy_matrix",
)


def test_pfcl_is_judged_by_its_clients_not_the_untrained_server(pfcl_run):
    """Before, final.accuracy etc. came from the server's never-trained model."""
    out, results = pfcl_run
    final = results["final"]
    assert results["federation_model"] == "clients" == final["federation_model"]
    assert all(final[key] is None for key in GLOBAL_FINAL), {k: final[k] for k in GLOBAL_FINAL}
    evaluated = [r for r in results["rounds"] if "mean_client_accuracy" in r]
    assert evaluated and all(r["global_accuracy"] is None and r["a_glo"] is None for r in evaluated)
    ends = [r["mean_client_accuracy"] for r in evaluated if r["task_end"]]
    assert final["mean_client_accuracy"] == evaluated[-1]["mean_client_accuracy"] > 0.3
    assert final["average_client_accuracy"] == pytest.approx(sum(ends) / len(ends))
    assert [t["mean_client_accuracy"] for t in results["tasks"]] == ends
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["final"]["accuracy"] is None


def test_pfcl_tensorboard_has_client_figures_and_no_global_model(pfcl_run):
    out, _ = pfcl_run
    tags = set()
    for path in (out / "tb").glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(path))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert {"Fed/mean_client_accuracy", "Fed/average_client_accuracy", "Fed/a_loc"} <= tags
    assert not any(tag.endswith("/global") for tag in tags), sorted(t for t in tags if t.endswith("/global"))
    assert not {"Fed/global_accuracy", "Fed/a_glo", "Fed/average_accuracy", "Fed/forgetting"} & tags


def test_report_shows_pfcl_client_figures_and_blank_global_columns(pfcl_run, fedavg_run, tmp_path):
    from fedaval.report import write_report

    report = write_report([pfcl_run[0], fedavg_run[0]], tmp_path, figures=False)
    lines = report.table.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")] for r in lines[2:]}
    pfcl, fedavg = rows["fedavg+pfcl"] if "fedavg+pfcl" in rows else rows["pfcl"], rows["fedavg"]
    for column in ("final acc", "avg acc", "forgetting", "A_glo", "utility"):
        assert pfcl[header.index(column)] == "", column
    for column in ("client acc", "avg client acc", "E s/round"):
        assert pfcl[header.index(column)] != "" and fedavg[header.index(column)] != "", column
    assert fedavg[header.index("final acc")] != ""


def test_a_sel_differs_from_a_loc_when_clients_are_sampled(tmp_path):
    from fedaval.api import run_training

    results = run_training(
        tiny_run_config(
            tmp_path / "run",
            plugins=["gldp"],
            scenario="sthfl",
            scenario_options={"clients": 4, "tasks": 2},
            clients_per_round=2,
            rounds_per_task=2,
        )
    )
    rounds = [r for r in results["rounds"] if r.get("a_sel") is not None]
    assert all(len(r["clients"]) == 2 for r in results["rounds"])
    assert any(r["a_sel"] != pytest.approx(r["a_loc"]) for r in rounds)
    scenario = results["scenario"]
    assert scenario["samples_per_client"] > 0
    assert 0 < scenario["data_fraction_used"] <= 1 and scenario["effective_imbalance"] >= 1


class SeenClassesProbe:
    """At each stage's end: GLDP's A_loc of both predictions recomputed on each
    started client's seen classes, and how many of those classes the client's
    whole-list test stream (``test_stream``) puts in a task it never trained."""

    name = "seen-probe"

    def __init__(self):
        self.a_loc: list[tuple[int, float, float]] = []  # (round, GLDP-GP, GLDP-LP)
        self.in_skipped_tasks = 0

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        from fedaval.plugins.gldp import base_features
        from fedaval.prototypes import nearest_prototype_scores
        from fedaval.streams import indices_of_classes, make_dataset, new_classes

        if not run.now.task_ends:
            return None
        gldp = run.plugins.objects["gldp"]
        accs: dict[str, list[float]] = {"global": [], "local": []}
        for client in run.clients:
            if not client.tasks_started:
                continue
            seen = client.seen_classes()
            whole_list = {c for t in client.tasks_started for c in new_classes(client.tasks.classes)[t]}
            self.in_skipped_tasks += len(set(seen) - whole_list)
            test = make_dataset(run.data, "test", indices_of_classes(run.data, seen))
            features, labels = base_features(client.model, test, run.device, run=run)
            for predict, values in accs.items():
                scores = nearest_prototype_scores(features, gldp.prototypes_for(client, predict), run.num_classes)
                values.append(float((scores.argmax(dim=1) == labels).float().mean()))
        self.a_loc.append((round, *(sum(v) / len(v) for v in accs.values())))
        return None


def test_clients_are_tested_on_every_class_they_trained_on_when_they_skipped_a_stage(tmp_path, monkeypatch):
    """A client not sampled in any round of a stage has not trained it; a class
    that came first in that stage and again in a later stage it trained is one
    of its seen classes (a_glo counts it) and must be in its own test set too
    (a_loc and a_sel through the core's evaluation, GLDP's A_loc of both
    predictions), where it was left out."""
    from fedaval.api import run_training
    from fedaval.strategy import FederatedStrategy

    tested = []
    eval_experiences = FederatedStrategy.eval

    def recording_eval(self, exps, **kwargs):
        if self.client is not None:  # the server's model is tested on the federation's classes
            labels = {int(y) for e in exps for y in e.dataset.targets}
            tested.append((self.client.id, labels, set(self.client.seen_classes())))
        return eval_experiences(self, exps, **kwargs)

    monkeypatch.setattr(FederatedStrategy, "eval", recording_eval)
    probe = SeenClassesProbe()
    scenario = {"clients": 10, "classes_per_task": 2, "tasks": 3, "imbalance": 10.0}
    config = tiny_run_config(
        tmp_path / "run", plugins=["gldp"], scenario="sthfl", scenario_options=scenario, clients_per_round=5
    )
    results = run_training(config, extra_plugins=[probe])
    assert probe.in_skipped_tasks > 0, "the setting must have a class first met in a skipped stage"
    assert tested
    for client_id, labels, seen in tested:
        assert labels == seen, f"client {client_id} tested on {sorted(labels)}, trained on {sorted(seen)}"
    reported = {r["round"]: r["plugin_metrics"]["gldp"] for r in results["rounds"] if r["task_end"]}
    for round, gp, lp in probe.a_loc:
        assert reported[round]["gldp_a_loc_gp"] == pytest.approx(gp, abs=1e-6)
        assert reported[round]["gldp_a_loc_lp"] == pytest.approx(lp, abs=1e-6)


def test_idle_clients_keep_their_result_unless_a_plugin_calls_it_stale(tmp_path):
    """A client not trained since its last evaluation keeps its result; a
    ``fedaval_client_evaluation_stale`` returning True has it evaluated again
    (asked only for such clients). That extra evaluation leaves the client's
    random streams where they were (evaluation draws from them): training is
    the same either way."""
    from fedaval.api import run_training

    class Watch:
        name = "watch"

        def __init__(self, stale):
            self.stale = stale
            self.evaluated: list[tuple[int, int]] = []
            self.asked: list[tuple[int, int]] = []

        @hookimpl(wrapper=True)
        def fedaval_client_evaluate(self, run, client):
            self.evaluated.append((run.round, client.id))
            return (yield)

        @hookimpl
        def fedaval_client_evaluation_stale(self, run, client):
            self.asked.append((run.round, client.id))
            return self.stale

    runs = {}
    for stale in (False, True):
        watch = Watch(stale)
        config = tiny_run_config(
            tmp_path / f"run-{stale}",
            scenario_options={"clients": 3, "tasks": 2},
            clients_per_round=1,
            rounds_per_task=3,
        )
        runs[stale] = run_training(config, extra_plugins=[watch]), watch
    for stale, (results, watch) in runs.items():
        started: set[int] = set()
        for r in results["rounds"]:
            sampled = set(r["clients"])
            idle = started - sampled
            started |= sampled
            evaluated = {k for round, k in watch.evaluated if round == r["round"]}
            assert {k for round, k in watch.asked if round == r["round"]} == idle
            assert evaluated == (started if stale else sampled)
        assert any(round > 1 and k not in results["rounds"][round - 1]["clients"] for round, k in watch.asked)
    (kept, _), (again, _) = runs[False], runs[True]
    assert [r["losses"] for r in kept["rounds"]] == [r["losses"] for r in again["rounds"]]
    assert [r["global_accuracy"] for r in kept["rounds"]] == [r["global_accuracy"] for r in again["rounds"]]


def test_gldp_preset_agrees_with_its_header_and_the_paper():
    """GLDP: K = 50 global rounds over M = 5 stages, 10 clients sampled per round, 20 clients."""
    path = CONFIGS / "gldp-cifar10-sthfl.toml"
    text = path.read_text()
    data = tomllib.loads(text)
    sthfl = data["options"]["sthfl"]
    total = data["rounds-per-task"] * sthfl["tasks"]
    assert total == 250 and "250 rounds" in text.splitlines()[2]
    assert 0 < data["clients-per-round"] < sthfl["clients"]
    assert data["clients-per-round"] == 10 and sthfl["clients"] == 20


def test_forgetting_when_a_stage_brings_no_class_new_to_the_federation(tmp_path):
    """sthfl on digits, seed 0: stage 3 brings no class new to the federation
    (the server has no experience for it); its matrix column is None and
    forgetting and BWT come from the columns that exist."""
    from fedaval.api import run_training

    results = run_training(tiny_run_config(tmp_path / "run", scenario="sthfl", scenario_options={}, rounds_per_task=1))
    new = [set(c) for c in results["scenario"]["federation_task_classes"]]
    assert new[2] <= new[0] | new[1], "the setting this test needs: stage 3 adds nothing"
    matrix = results["final"]["accuracy_matrix"]
    assert len(matrix) == 3 and matrix[2][2] is None and None not in matrix[2][:2]
    assert results["final"]["forgetting"] == pytest.approx(forgetting(matrix))
    assert results["final"]["bwt"] == pytest.approx(backward_transfer(matrix))
    assert results["final"]["forgetting"] is not None
    # Avalanche's figure: stage 3 is the current one although it has no experience, so stages 1 and
    # 2 keep their stage-end reference and, evaluated once a stage, it is minus the BWT
    assert results["final"]["avalanche_forgetting"] == pytest.approx(-results["final"]["bwt"])


class ServerModel:
    """A plugin whose federation model is neither "global" nor "clients"."""

    name = "servermodel"

    @hookimpl
    def fedaval_federation_model(self, run):
        return "server"


def test_a_bad_federation_model_is_a_one_line_error(tmp_path):
    from fedaval.api import run_training
    from fedaval.errors import FedavalUsageError

    with pytest.raises(
        FedavalUsageError, match="bad value 'server' from fedaval_federation_model; allowed: global, clients"
    ):
        run_training(tiny_run_config(tmp_path / "run", rounds_per_task=1), extra_plugins=[ServerModel()])


def test_computation_seconds_include_the_clients_upload_work(tiny_config):
    """A method's upload work (PFCL's and FedProK's prototypes over the
    client's data) is client computation, FedProK's tau2: before, only
    the training call was timed, and PFCL's prototype pass on Tiny-ImageNet
    (20 to 60 s a round) was missing from E."""
    import time

    from fedaval import hookimpl
    from fedaval.api import run_training

    class SlowUpload:
        name = "slow_upload"

        @hookimpl
        def fedaval_client_upload(self, run, client):
            time.sleep(0.2)
            return {}

    results = run_training(tiny_config(rounds_per_task=1), extra_plugins=[SlowUpload()])
    for r in results["rounds"]:
        clients = len(r["clients"])
        assert r["seconds_local"] >= 0.2 * clients


# ---------------------------------------------------------------- the evaluator's callbacks


def test_evaluators_skip_the_callbacks_no_metric_acts_on(tiny_config, monkeypatch):
    """Avalanche's evaluator called every metric (and swapped in a logging
    copy of the experience) in every callback, seven of them per training
    minibatch; fedaval's calls them only where a metric or logger acts."""
    from fedaval.api import run_training
    from fedaval.evaluation import MetricsEvaluator

    dispatched: list[str] = []
    original = MetricsEvaluator._update_metrics_and_loggers

    def spy(self, strategy, callback):
        dispatched.append(callback)
        return original(self, strategy, callback)

    monkeypatch.setattr(MetricsEvaluator, "_update_metrics_and_loggers", spy)
    run_training(tiny_config())
    assert {"before_eval", "after_eval_exp", "after_eval", "before_training_exp"} <= set(dispatched)
    per_minibatch = {"before_training_iteration", "before_forward", "after_forward", "before_backward"}
    per_minibatch |= {"after_backward", "before_update", "after_update", "after_training_iteration"}
    per_minibatch.add("after_eval_iteration")  # evaluation in one pass feeds the metric its counts directly
    assert not per_minibatch & set(dispatched)


def test_a_metric_or_logger_that_overrides_a_callback_is_still_called():
    from avalanche.evaluation.metric_definitions import PluginMetric
    from avalanche.evaluation.metrics import accuracy_metrics
    from avalanche.logging import BaseLogger

    from fedaval.evaluation import MetricsEvaluator

    class CountsBackward(PluginMetric):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def result(self):
            return None

        def reset(self):
            pass

        def after_backward(self, strategy):
            self.calls += 1

    class LogsEpochs(BaseLogger):
        def after_training_epoch(self, strategy, metric_values, **kwargs):
            pass

    counter = CountsBackward()
    evaluator = MetricsEvaluator(counter, accuracy_metrics(stream=True), loggers=[LogsEpochs()])
    assert {"after_backward", "after_training_epoch", "after_eval"} <= evaluator.callbacks
    assert not {"before_backward", "after_training_iteration", "before_forward"} & evaluator.callbacks

    class Strategy:
        experience = None

    evaluator.after_backward(Strategy())
    evaluator.before_backward(Strategy())
    assert counter.calls == 1
    # a training-mode metric (minibatch accuracy) acts in the training callbacks
    assert "after_training_iteration" in MetricsEvaluator(accuracy_metrics(minibatch=True), loggers=[]).callbacks


def test_one_pass_metrics_emit_what_avalanches_six_metrics_emit(tiny_config, monkeypatch):
    """Every evaluator (server and clients, three stages, forgetting once a
    stage has passed) computes fedaval's AccuracyForgettingBWT beside
    Avalanche's accuracy/forgetting/BWT plugin metrics; a logger records what
    each side emits in every callback: the same names, values and order."""
    from avalanche.evaluation.metrics import accuracy_metrics, bwt_metrics, forgetting_metrics
    from avalanche.logging import BaseLogger

    import fedaval.evaluation as evaluation
    from fedaval.backends import make_backend
    from fedaval.build import build_run
    from fedaval.coordinator import train
    from fedaval.metrics import AccuracyForgettingBWT

    class Recorder(BaseLogger):
        def __init__(self):
            super().__init__()
            self.ours, self.avalanche = [], []

        def log_metrics(self, metric_values):
            ours = [(v.name, v.value) for v in metric_values if isinstance(v.origin, AccuracyForgettingBWT)]
            theirs = [(v.name, v.value) for v in metric_values if not isinstance(v.origin, AccuracyForgettingBWT)]
            self.ours.append(ours)
            self.avalanche.append(theirs)

    def both():
        return [
            AccuracyForgettingBWT(),
            accuracy_metrics(experience=True, stream=True),
            forgetting_metrics(experience=True, stream=True),
            bwt_metrics(experience=True, stream=True),
        ]

    monkeypatch.setattr(evaluation, "evaluation_metrics", both)
    config = tiny_config(scenario_options={"clients": 2, "tasks": 3}, rounds_per_task=2, checkpoint_every=0)
    run = build_run(config, out_dir=Path(config.out))
    recorders = []
    for strategy in [run.server.strategy, *(c.strategy for c in run.clients)]:
        recorders.append(Recorder())
        strategy.evaluator.loggers.append(recorders[-1])
    train(run, backend=make_backend(run))
    for recorder in recorders:
        assert recorder.ours == recorder.avalanche
        emitted = [name for batch in recorder.ours for name, _ in batch]
        assert any(name.startswith("ExperienceForgetting/") for name in emitted)
        assert "StreamBWT/eval_phase/test_stream" in emitted and "Top1_Acc_Stream/eval_phase/test_stream" in emitted


def test_evaluation_makes_each_experiences_views_and_names_once(tiny_config, monkeypatch):
    """An evaluated experience's eval view of its dataset, its logging view
    and its metric names are made at its first evaluation and reused: the
    server's second evaluation makes none and emits the same metrics. An
    experience given a new dataset gets new views and names, with the same
    metrics; training callbacks get a fresh logging copy every time, as in
    Avalanche; the caches are not pickled."""
    from types import SimpleNamespace

    from avalanche.benchmarks.scenarios.generic_scenario import CLExperience
    from avalanche.benchmarks.utils.data import AvalancheDataset

    import fedaval.metrics as metrics
    from fedaval import state
    from fedaval.build import build_run

    made: list[str] = []

    def counting(owner, name, label):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            made.append(label)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    counting(AvalancheDataset, "eval", "eval view")
    counting(CLExperience, "logging", "logging view")
    counting(metrics, "get_metric_name", "name")
    run = build_run(tiny_config(scenario_options={"clients": 2, "tasks": 3}))
    server = run.server
    made.clear()
    server.begin_task(0)  # the evaluator's before_training_exp already sees the experiences' logging views
    server.begin_task(1)
    first = server.evaluate()
    assert made.count("eval view") == 2 and made.count("logging view") == 2 and made.count("name") == 2 * 3 + 1
    made.clear()
    assert server.evaluate() == first
    assert "eval view" not in made and "logging view" not in made
    assert made.count("name") == 1  # the stream accuracy's, once per evaluation (not per experience)

    experience = server.test_stream[1]
    experience._dataset = experience._dataset.train()  # the same samples, a new dataset object
    made.clear()
    assert server.evaluate() == first
    assert made.count("eval view") == 1 and made.count("logging view") == 1 and made.count("name") == 1 + 3

    evaluator = server.strategy.evaluator
    training = SimpleNamespace(is_training=True)
    assert evaluator.logging_view(experience, training) is not evaluator.logging_view(experience, training)
    assert "_logging_views" in vars(evaluator) and "_logging_views" not in evaluator.__getstate__()
    metric = evaluator.metrics[0]
    assert "_names" in vars(metric) and "_names" not in metric.__getstate__()
    restored = state.loads(run, state.dumps(run, evaluator))
    assert not hasattr(restored, "_logging_views") or not restored._logging_views


# --- --client-test: how a client's accuracy weighs its classes ----------------------
def test_class_mix_accuracy_by_hand():
    import torch

    from fedaval.evaluation import class_mix_accuracy

    labels = torch.tensor([0, 0, 1, 1, 1, 1, 2])
    predicted = torch.tensor([0, 1, 1, 1, 0, 0, 2])  # class 0: 1/2, class 1: 2/4, class 2: 1/1
    assert class_mix_accuracy(predicted, labels, {0: 3, 1: 1}) == pytest.approx((3 * 0.5 + 1 * 0.5) / 4)
    assert class_mix_accuracy(predicted, labels, {1: 1, 2: 3}) == pytest.approx((0.5 + 3) / 4)
    assert class_mix_accuracy(predicted, labels, {2: 1, 5: 9}) == 1.0  # a class without test samples is left out
    assert class_mix_accuracy(predicted, labels, {5: 1}) is None


class MixProbe:
    """The global model's A_glo with each client's classes weighed by its
    training samples, recomputed by hand from the server's predictions."""

    name = "mix-probe"

    def __init__(self):
        self.a_glo: dict[int, float] = {}

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        import numpy as np

        predicted, labels = (t.numpy() for t in run.server.predictions.predictions())
        values = []
        for client in run.clients:
            if not client.tasks_started:
                continue
            idx = np.concatenate([client.tasks.indices[t] for t in client.tasks_started])
            counts = np.bincount(run.data.train_y.cpu().numpy()[idx], minlength=run.num_classes)
            per_class = [(counts[c], (predicted[labels == c] == c).mean()) for c in np.flatnonzero(counts)]
            values.append(sum(n * a for n, a in per_class) / sum(n for n, _ in per_class))
        self.a_glo[round] = float(np.mean(values))


def test_client_test_train_weighs_each_class_by_the_clients_training_share(tmp_path):
    """``--client-test train``: A_glo by hand; the clients' a_loc and GLDP's
    own A_loc (computed apart, from features) agree under the weighing;
    training is untouched, so the global accuracy is the default run's."""
    from fedaval.api import run_training

    settings = dict(
        plugins=["gldp"],
        scenario="sthfl",
        scenario_options={"clients": 4, "classes_per_task": 3, "tasks": 2, "imbalance": 10.0},
        rounds_per_task=2,
    )
    probe = MixProbe()
    mixed = run_training(tiny_run_config(tmp_path / "train", client_test="train", **settings), extra_plugins=[probe])
    plain = run_training(tiny_run_config(tmp_path / "test", **settings))
    assert [r["global_accuracy"] for r in mixed["rounds"]] == [r["global_accuracy"] for r in plain["rounds"]]
    for r in mixed["rounds"]:
        assert r["a_glo"] == pytest.approx(probe.a_glo[r["round"]], abs=1e-6)
        if r["task_end"]:
            assert r["a_loc"] == pytest.approx(r["plugin_metrics"]["gldp"]["gldp_a_loc_gp"], abs=1e-6)
    assert any(m["a_glo"] != pytest.approx(p["a_glo"]) for m, p in zip(mixed["rounds"], plain["rounds"]))
    assert any(m["a_loc"] != pytest.approx(p["a_loc"]) for m, p in zip(mixed["rounds"], plain["rounds"]))
