"""The speed and memory benchmarks run (tiny settings; no timing is asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # whole trainings

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run(script: str, *args: str) -> str:
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_overhead_benchmark_runs_and_does_the_same_work():
    out = run("overhead.py", "--dataset", "digits", "--tasks", "2", "--rounds-per-task", "1", "--repeats", "1")
    assert "ratio fedaval / plain:" in out
    assert "max |global weight difference|: 0.00e+00" in out  # identical data order, steps and fusion
    # where the seconds go: each side's phases add up to its time, and each side trained and evaluated
    totals = {
        line.split("|")[1].strip(): float(line.split("|")[2])
        for line in out.splitlines()
        if "| fedaval train |" in line or "| plain PyTorch loop |" in line
    }
    phases = {
        line.split("|")[1].strip(): (float(line.split("|")[2]), float(line.split("|")[3]))
        for line in out.splitlines()
        if line.startswith("| ") and line.count("|") == 5 and "phase" not in line
    }
    assert set(phases) == {"outside the rounds", "local training", "fusion", "evaluation", "rest of the rounds"}
    assert sum(fed for fed, _ in phases.values()) == pytest.approx(totals["fedaval train"], abs=0.006)
    assert sum(plain for _, plain in phases.values()) == pytest.approx(totals["plain PyTorch loop"], abs=0.006)
    assert min(phases["local training"] + phases["evaluation"]) > 0


def test_overhead_counts_each_sides_operations_a_round():
    out = run(
        "overhead.py", "--dataset", "digits", "--tasks", "2", "--rounds-per-task", "1", "--repeats", "1", "--count-ops"
    )
    lines = {side: out.split(f"\n{side}: ")[1].split("\n")[0] for side in ("fedaval", "plain")}
    operations = {side: float(line.split()[0].replace(",", "")) for side, line in lines.items()}
    kernels = {
        side: float(line.split(" of them kernels")[0].split()[-1].replace(",", "")) for side, line in lines.items()
    }
    # the same training and evaluation on both sides, fedaval's checkpoints, writes and bookkeeping on top
    assert 0 < operations["plain"] < operations["fedaval"] < 3 * operations["plain"]
    assert all(0 < kernels[side] < operations[side] for side in lines)  # views and allocations launch nothing
    assert "benchmarks/overhead.py" in out and "avalanche/base_sgd.py" in out
    difference = float(out.split("fedaval - plain: ")[1].split()[0].replace(",", ""))
    assert difference == pytest.approx(kernels["fedaval"] - kernels["plain"], abs=0.2)


def test_client_memory_benchmark_runs():
    out = run(
        "client_memory.py",
        "--dataset",
        "digits",
        "--model",
        "mlp",
        "--clients",
        "3,4",
        "--per-round",
        "2",
        "--offload",
        "cpu",
    )
    assert "peak grows by" in out and "one client's stored state" in out


def test_backends_benchmark_compares_results_without_timings():
    """backends.py's "same results" column ignores every timing, including FedProK's E
    (``efficiency*``, seconds per round), which differs from run to run like ``seconds``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("backends_bench", BENCHMARKS / "backends.py")
    assert spec is not None and spec.loader is not None
    backends = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backends)
    one = {"final": {"accuracy": 0.5, "seconds": 1.0, "efficiency": 2.0, "efficiency_computation": 1.5}, "out": "a"}
    two = {"final": {"accuracy": 0.5, "seconds": 3.0, "efficiency": 4.0, "efficiency_computation": 2.5}, "out": "b"}
    assert backends.comparable(one) == backends.comparable(two) == {"final": {"accuracy": 0.5}}


@pytest.mark.parametrize(
    "option, values, labels",
    [
        ("--compile", "off,aot_eager", ("fedaval", "fedaval --compile aot_eager")),
        ("--stack-clients", "off,on", ("fedaval", "fedaval --stack-clients")),
    ],
    ids=["compile", "stacked"],
)
def test_round_throughput_benchmark_runs(cifar10_root, monkeypatch, capsys, option, values, labels):
    small = ["--model", "cnn", "--clients", "3", "--rounds", "3", "--limit-epochs", "1"]
    out = in_process(
        monkeypatch, capsys, "round_throughput.py", *small, option, values, "--data-root", str(cifar10_root)
    )
    assert "300 samples a round" in out  # the subset's 30 training images x 10 classes, every client training
    for label in labels:  # each, in this one invocation
        assert f"ratio {label} / limit:" in out
    assert "(local training)" in out


def benchmark_main(monkeypatch, script: str):
    """A benchmark's ``main``, to run in this process (no interpreter to start, no imports again), with
    this process's ``--threads`` (which ``main`` sets) added to its arguments."""
    import importlib

    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [script])  # argparse's program name
    main = importlib.import_module(script.removesuffix(".py")).main
    return lambda *args: main([*args, "--threads", str(torch.get_num_threads())])


def usage_error(monkeypatch, script: str, *args: str) -> str:
    """A benchmark run in this process, expecting argparse's refusal (exit 2): its last line."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit:
        benchmark_main(monkeypatch, script)(*args)
    assert exit.value.code == 2, err.getvalue()
    return err.getvalue().strip().splitlines()[-1]


def in_process(monkeypatch, capsys, script: str, *args: str) -> str:
    """A benchmark run in this process: its standard output."""
    assert benchmark_main(monkeypatch, script)(*args) == 0
    return capsys.readouterr().out


def test_round_throughput_refuses_compile_with_the_backbones_graphs_and_streams_on_the_cpu(monkeypatch):
    assert usage_error(monkeypatch, "round_throughput.py", "--compile", "inductor", "--cuda-graphs", "all") == (
        "round_throughput.py: error: --compile inductor takes --cuda-graphs off, step or off+step, not all"
    )
    assert usage_error(monkeypatch, "round_throughput.py", "--device", "cpu", "--client-streams", "1,4") == (
        "round_throughput.py: error: --client-streams 1,4 needs a CUDA device; --device is cpu"
    )
    assert usage_error(monkeypatch, "round_throughput.py", "--stack-clients", "on", "--compile", "inductor") == (
        "round_throughput.py: error: --stack-clients on takes --compile off and --cuda-graphs off, step or off+step"
    )


def small_step_host(monkeypatch, capsys, *args: str) -> str:
    """step_host.py in this process, 3 rounds, one repeat, 20 plain steps, and ``args``: its output."""
    return in_process(
        monkeypatch, capsys, "step_host.py", "--rounds", "3", "--repeats", "1", "--plain-steps", "20", *args
    )


def test_step_host_with_stacked_clients_measures_the_host_work_per_clients_step(monkeypatch, capsys):
    out = small_step_host(monkeypatch, capsys, "--stack-clients", "--null-graphs")
    assert "--stack-clients (its time per step: per client's step)" in out
    per_step = float(out.split("median: fedaval ")[1].split(" us/step")[0])
    assert 0 < per_step < 1e6


def test_step_host_benchmark_runs(monkeypatch, capsys):
    out = small_step_host(monkeypatch, capsys, "--local-epochs", "1")
    assert "62 backbone parameters" in out and "fedaval's own host work" in out
    outside = float(out.split("a client round outside its minibatches ")[-1].split(" ms")[0])
    assert 0 < outside < 1000  # the round's host seconds less its minibatches' span, per client


def test_step_host_counts_each_sides_operations_per_step(monkeypatch, capsys):
    out = small_step_host(monkeypatch, capsys, "--layers", "0", "--count-ops")
    assert "(2 backbone parameters)" in out
    fedaval = float(out.split("ATen operations, fedaval (")[1].split("): ")[1].split()[0])
    plain = float(out.split("ATen operations, plain (50 steps): ")[1].split()[0])
    # a linear backbone, its classifier, the loss, the backward and SGD: some 50 operations a step, and
    # fedaval's minibatch building and loss bookkeeping on top (65.6 and 53.0 on the CPU, session 30)
    assert 40 < plain < fedaval < 2 * plain
    assert "avalanche/base_sgd.py" in out and "fedaval/strategy.py" in out


def test_step_host_with_null_graphs_measures_the_host_work_around_a_replay(monkeypatch, capsys):
    """--null-graphs: fedaval with --cuda-graph-scope step on the CPU, every graph a replay that does
    nothing: what is left a step is the loop's own work (17.6 operations against the plain loop's 5.0
    on the CPU, session 30: the batch built and normalised, copied in, the outputs copied out)."""
    out = small_step_host(monkeypatch, capsys, "--null-graphs", "--count-ops")
    assert "every graph a replay that does nothing" in out and "fedaval's own host work" in out
    fedaval = float(out.split("ATen operations, fedaval (")[1].split("): ")[1].split()[0])
    plain = out.split("ATen operations, plain (50 steps): ")[1].split("\n")[0]
    assert plain.startswith("5.0 operations a step, 5.0 of them kernels")  # randint, two index, two copies
    assert 10 < fedaval < 30 and "fedaval/cuda_graphs.py" in out


def test_ewc_penalty_benchmark_compares_avalanches_plugin_with_fedewcs():
    out = run("ewc_penalty.py", "--model", "cnn", "--experiences", "2", "--steps", "2", "--repeats", "1")
    assert "Avalanche's EWCPlugin" in out and "FusedEWCPlugin" in out
    line = out.split("largest relative difference: penalty ")[-1].splitlines()[0]  # "9.8e-08, gradients 0.0e+00"
    penalty, gradients = (float(part.split()[-1]) for part in line.split(","))
    assert penalty < 1e-6 and gradients < 1e-5  # the same sums, added up in another order


def test_glfc_task_steps_benchmark_runs_and_herds_as_avalanche():
    out = run("glfc_task_steps.py", "--rows", "300", "--dim", "32", "--quota", "40", "--repeats", "1")
    assert "same order: True" in out and "gradient inversion" in out


def test_round_throughput_refuses_cuda_graphs_without_a_gpu(monkeypatch):
    assert usage_error(monkeypatch, "round_throughput.py", "--device", "cpu", "--cuda-graphs", "both") == (
        "round_throughput.py: error: --cuda-graphs both needs a CUDA device; --device is cpu"
    )


def test_round_throughput_profiles_fedavals_rounds(cifar10_root):
    out = run(
        "round_throughput.py",
        "--model",
        "cnn",
        "--clients",
        "2",
        "--rounds",
        "3",
        "--data-root",
        str(cifar10_root),
        "--profile",
        "python",
    )
    assert "cProfile of all rounds" in out and "Ordered by: internal time" in out and "ratio" not in out


def test_cuda_identity_checks_pass_on_the_cpu(cifar10_root):
    """The GPU's identity checks (same results twice, resumed checkpoints) on the CPU, one quick setting."""
    out = run(
        "cuda_identity.py",
        "--device",
        "cpu",
        "--settings",
        "gldp-sthfl",
        "--rounds-per-task",
        "2",
        "--resume-rounds",
        "3",
        "--data-root",
        str(cifar10_root),
    )
    assert "gldp-sthfl: twice with --deterministic: same" in out
    assert "gldp-sthfl: resumed from round 3: same" in out and "all required checks passed" in out


def test_round_throughput_in_processes_runs_and_checks_its_split(cifar10_root):
    """``--processes 2``: two fedaval runs at once, 5 of the 10 clients each, their rate over their common span."""
    out = run(
        "round_throughput.py",
        "--model",
        "cnn",
        "--device",
        "cpu",
        "--rounds",
        "3",
        "--processes",
        "2",
        "--train-per-class",
        "20",
        "--limit-epochs",
        "1",
    )
    assert "fedaval as 2 runs at once, 5 clients each" in out
    assert re.search(r"fedaval in 2 processes: 200 samples a round in all; [0-9,]+ samples/s", out)
    assert re.search(r"ratio fedaval in 2 processes / limit: [0-9.]+ \(whole rounds\)", out)
    bad = subprocess.run(
        [sys.executable, str(BENCHMARKS / "round_throughput.py"), "--device", "cpu", "--processes", "3"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--processes 3 must divide --clients 10" in bad.stderr


def test_spawned_processes_that_fail_stop_the_measurement(monkeypatch):
    """A measuring process that dies raises at once, not after the queue's time-out (the others, waiting
    at the barrier, are stopped)."""
    import time

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from round_throughput import spawned

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="a measuring process exited with 1"):
        spawned(sys.exit, 2)  # sys.exit(rank, barrier, results): a TypeError in each child, exit status 1
    assert time.monotonic() - start < 60


def test_gpu_ceilings_runs_on_the_cpu(cifar10_root):
    out = run(
        "gpu_ceilings.py",
        "--device",
        "cpu",
        "--model",
        "cnn",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--processes",
        "2",
        "--limit-batch",
        "64",
        "--stacked",
        "3",
        "--compile",
        "aot_eager",
        "--data-root",
        str(cifar10_root),
    )
    for line in ("batch 64 (the limit)", "batch 32, bf16", "batch 32, channels-last", "batch 32 x 2 processes"):
        assert line in out
    assert re.search(r"batch 32, torch.compile aot_eager +[0-9,]+ samples/s", out)
    assert "CUDA graph" not in out and "model graphed" not in out  # the GPU only
    # three models as one vmapped step: each model's step as its own loop's, and timed
    check = re.search(
        r"batch 32 x 3 models, one vmapped step: first step against each model's own, largest difference (\S+)", out
    )
    assert check is not None and float(check.group(1)) < 1e-5
    assert re.search(r"batch 32 x 3 models, one vmapped step +[0-9,]+ samples/s", out)


def test_round_cost_benchmark_splits_out_the_evaluation_forward_passes():
    import re

    out = run("round_cost.py", "--rounds-per-task", "16", "--tasks", "1")
    forward = [float(x) for x in re.findall(r"evaluation forward passes +([0-9.]+) ms", out)]
    fixed = [float(x) for x in re.findall(r"fixed +([0-9.]+) ms", out)]
    beyond = [float(x) for x in re.findall(r"fixed less them +([0-9.]+) ms", out)]
    assert len(forward) == len(fixed) == len(beyond) == 2
    assert all(f > 0 for f in forward)  # the evaluation's forward passes were timed, every round
    assert "fixed cost less the evaluation forward passes, median per tenth of the run (ms):" in out


def test_fedprok_ceiling_probe_changes_nothing_and_scores_every_task(tiny_config, tmp_path):
    """benchmarks/fedprok_ceiling.py's probe draws from no random stream: the
    run beside it is the run without it; it reports once, at task 0's end,
    an accuracy that is the test-count-weighted mean of its per-task ones."""
    import importlib.util

    import torch

    from fedaval.api import run_training

    spec = importlib.util.spec_from_file_location("fedprok_ceiling", BENCHMARKS / "fedprok_ceiling.py")
    assert spec is not None and spec.loader is not None
    ceiling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ceiling)

    settings = dict(plugins=["fedprok"], scenario_options={"clients": 2, "tasks": 3}, rounds_per_task=2)
    probe = ceiling.LinearProbe()
    kept = []

    class Keep:
        name = "keep"

        @ceiling.hookimpl
        def fedaval_setup(self, run):
            kept.append(run)

    probed = run_training(tiny_config(**settings, out=tmp_path / "probed"), extra_plugins=[probe, Keep()])
    plain = run_training(tiny_config(**settings, out=tmp_path / "plain"))
    drop = ("plugin_metrics", "seconds")
    strip = [{k: v for k, v in r.items() if not k.startswith(drop)} for r in probed["rounds"]]
    assert strip == [{k: v for k, v in r.items() if not k.startswith(drop)} for r in plain["rounds"]]
    reports = [r["round"] for r in probed["rounds"] if r["plugin_metrics"].get("probe")]
    assert reports == [2]  # task 0's last round
    result = probed["rounds"][1]["plugin_metrics"]["probe"]
    run = kept[0]
    tasks = run.federation_new_classes()
    counts = [int(torch.isin(run.data.test_y, torch.tensor(c)).sum()) for c in tasks]
    weighted = sum(result[f"task_{t}"] * n for t, n in enumerate(counts)) / sum(counts)
    assert sum(counts) == len(run.data.test_y)
    assert result["accuracy"] == pytest.approx(weighted) and 0.2 < result["accuracy"] <= 1.0


def test_fedprok_gap_probe_changes_nothing_and_measures_the_run_s_own_model(tiny_config, tmp_path):
    """benchmarks/fedprok_ceiling.py's GapProbe: the run beside it is the run
    without it; at every task's end from task 1 on it scores the global model
    as the run does (its ``global`` is the round's recorded accuracy), each
    client's last fit, the pooled fit and the ceiling; and its pooled set of
    one client is that client's own objective: a fit on it reaches the loss
    ``fit_head`` reaches on the client's real features and plan."""
    import importlib.util

    import torch

    from fedaval.api import run_training
    from fedaval.plugins.fedprok_math import fit_head, plan_translation

    spec = importlib.util.spec_from_file_location("fedprok_ceiling", BENCHMARKS / "fedprok_ceiling.py")
    assert spec is not None and spec.loader is not None
    ceiling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ceiling)

    settings = dict(plugins=["fedprok"], scenario_options={"clients": 2, "tasks": 3}, rounds_per_task=2)
    probed = run_training(tiny_config(**settings, out=tmp_path / "probed"), extra_plugins=[ceiling.GapProbe()])
    plain = run_training(tiny_config(**settings, out=tmp_path / "plain"))
    drop = ("plugin_metrics", "seconds")
    strip = [{k: v for k, v in r.items() if not k.startswith(drop)} for r in probed["rounds"]]
    assert strip == [{k: v for k, v in r.items() if not k.startswith(drop)} for r in plain["rounds"]]
    reports = {r["round"]: r for r in probed["rounds"] if r["plugin_metrics"].get("gap")}
    assert sorted(reports) == [4, 6]  # the ends of tasks 1 and 2
    for record in reports.values():
        gap = record["plugin_metrics"]["gap"]
        assert gap["global"] == pytest.approx(record["global_accuracy"], abs=1e-6)
        assert {"client_0", "client_1", "pooled", "ceiling"} <= set(gap)
        assert all(0.0 <= gap[k] <= 1.0 for k in ("client_0", "client_1", "pooled", "ceiling"))

    torch.manual_seed(0)
    real = torch.randn(60, 5) + torch.arange(3).repeat_interleave(20)[:, None]
    labels = torch.arange(3).repeat_interleave(20) + 2  # current classes 2, 3, 4
    protos = torch.stack([real[labels == c].mean(0) for c in (2, 3, 4)])
    plan = plan_translation([0, 1], torch.randn(2, 5) * 3, [2, 3, 4], protos)
    implicit = torch.nn.Linear(5, 5)
    torch.nn.init.zeros_(implicit.weight)
    torch.nn.init.zeros_(implicit.bias)
    loss, _ = fit_head(implicit, real, labels, plan, 1e-3, 500)
    features, targets, count = ceiling.pooled_set([(real, labels, plan)])
    assert count == 60 and len(targets) == 60 + 20 * 2 and set(targets.tolist()) == {0, 1, 2, 3, 4}
    head, _ = ceiling.fit(features, targets, 5, 1e-3, 500, per=count)
    with torch.no_grad():
        pooled_loss = torch.nn.functional.cross_entropy(head(features), targets, reduction="sum") / 60
    assert float(pooled_loss) == pytest.approx(loss, rel=1e-3)


def test_target_synthesis_benchmark_scores_both_syntheses_from_a_checkpoint(tiny_config, tmp_path):
    """benchmarks/target_synthesis.py rebuilds a TARGET run from its folder, takes its global model
    from a checkpoint and prints the teacher's cross-entropy and agreement on each synthetic set."""
    from fedaval.api import run_training

    config = tiny_config(plugins=["target"], model="cnn", out=tmp_path / "target", rounds_per_task=1)
    run_training(config)
    out = run("target_synthesis.py", str(tmp_path / "target"), "--widths", "8", "--size", "16")
    rows = [line for line in out.splitlines() if line.startswith("| code") or line.startswith("| paper")]
    assert [r.split("|")[1].strip() for r in rows] == ["code", "paper (its former defaults)"], out
    for row in rows:
        agree = float(row.split("|")[-2])
        assert 0.0 <= agree <= 1.0


def test_gpu_session_full_scale_goes_on_from_a_run_its_time_limit_stopped(cifar10_root, tmp_path):
    """benchmarks/gpu_session.sh --full-scale on the CPU (its dry run): the first command's run
    stops at its --time-limit after round 1 with that round checkpointed (exit 75); the second
    command, with the same RUNS and WORK, resumes it to the end and brings its results back. The
    job is the diagnostic row fedprok-gap (FedProK with benchmarks/fedprok_ceiling.py's GapProbe, a
    plugin the script finds in benchmarks/), whose probe reports at tasks 1 to 4's ends."""
    import json
    import os
    import shutil

    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    env = {
        **os.environ,
        "WORK": str(tmp_path / "work"),
        "RUNS": str(tmp_path / "runs"),
        "OUT": str(tmp_path / "out"),
        "DEVICE": "cpu",
        "MODEL": "cnn",
        "DATA_ROOT": str(cifar10_root),
        "SYNCS_S": "0",
        "DEADLINE": "300",
        "JOBS": "fedprok-gap:42",
        "FULL_SCALE_ARGS": "--rounds-per-task 1",  # 5 rounds
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # python3: this interpreter
    }
    script = str(BENCHMARKS / "gpu_session.sh")
    root = BENCHMARKS.parent

    def session(**extra):
        result = subprocess.run(
            ["bash", script, "--full-scale"], env={**env, **extra}, cwd=root, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result.stdout

    # GLDP's FEDIC row reads an unlabelled folder under /tmp that a GPU machine lacks: not started
    fedic_data = Path("/tmp/tiny-imagenet-100-10-32px")
    session(TIME_LIMIT="0.001", **({} if fedic_data.exists() else {"JOBS": "fedprok-gap:42 t2-fedic:42"}))
    if not fedic_data.exists():
        assert f"t2-fedic-s42: not started, {fedic_data} is not here" in session_log(tmp_path)
    log = (tmp_path / "work" / "t1-fedprok-gap-s42.txt").read_text()
    assert "stopped after round 1 of 5 by --time-limit 0.001" in log, log
    assert "t1-fedprok-gap-s42: started, exit 75" in session_log(tmp_path)
    out = session()
    assert "t1-fedprok-gap-s42: resumed, exit 0" in out, out
    back = tmp_path / "work" / "results" / "t1-fedprok-gap-s42"
    results = json.loads((back / "results.json").read_text())
    assert results["status"] == {"state": "complete", "rounds_done": 5, "rounds_total": 5}
    rounds = [json.loads(line) for line in (back / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds if r["plugin_metrics"].get("gap")] == [2, 3, 4, 5]
    assert (tmp_path / "out" / "session.tgz").stat().st_size > 0


def session_log(tmp_path: Path) -> str:
    return (tmp_path / "work" / "session.log").read_text()


def test_compile_methods_compares_a_methods_runs(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from compile_methods import main

    assert main(["fedprox"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^fedprox +the same results.json; final accuracy differs by 0.0000", out, re.M)


def test_gpu_ceilings_streams_line_steps_each_model_on_its_own_stream(monkeypatch, cifar10_root):
    """The streams ceiling (the GPU only) run here with torch.cuda's stream calls stood in: each model's
    steps are issued inside its own stream, --stream-steps of one model and then of the next, every
    stream waiting for the default one before and the default waiting for all after; eager and with
    the step captured (the capture stood in by the eager step)."""
    import argparse

    import torch
    from helpers import stand_in_cuda_streams

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_ceilings

    from fedaval.datasets import load_dataset

    log, current = stand_in_cuda_streams(monkeypatch)
    monkeypatch.setattr(gpu_ceilings, "sync", lambda device: None)
    monkeypatch.setattr(gpu_ceilings, "whole_step_graph", lambda device, step, x, y, warmup: step)
    step = gpu_ceilings.Loop.step
    monkeypatch.setattr(
        gpu_ceilings.Loop,
        "step",
        lambda self, x, y, *a, **k: (log.append(("step", current[-1].name)), step(self, x, y, *a, **k))[1],
    )

    data = load_dataset("imagefolder", str(cifar10_root), False)
    args = argparse.Namespace(batch=8, warmup=1, stream_steps=2, steps=4)
    for graphed in (False, True):
        log.clear()
        assert gpu_ceilings.streams_rate(data, "cnn", torch.device("cpu"), 2, args, graphed) > 0
        first, second = ("s0", "s1") if not graphed else ("s2", "s3")
        turn = [("step", first)] * 2 + [("step", second)] * 2
        waits_before = [("wait", first, "default"), ("wait", second, "default")]
        waits_after = [("wait", "default", first), ("wait", "default", second)]
        # the warm-up turn, then args.steps / args.stream_steps timed turns
        assert log == waits_before + turn + waits_after + waits_before + turn * 2 + waits_after
