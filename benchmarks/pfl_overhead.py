"""fedaval against Apple's pfl simulator doing the same FedAvg work, in one
invocation (benchmark only: pfl is the optional ``pfl`` extra, installed in its
own environment).

    python3 -m venv /work/pfl-venv && /work/pfl-venv/bin/pip install -e '.[pfl]'
    /work/pfl-venv/bin/python benchmarks/pfl_overhead.py                     # all shapes, 3 alternating repeats
    /work/pfl-venv/bin/python benchmarks/pfl_overhead.py --shapes cross-device --exact --write

pfl 0.6 (``pfl.algorithm.FederatedAveraging`` run by
``pfl.aggregate.simulate.SimulatedBackend`` on a ``pfl.model.pytorch.PyTorchModel``)
and ``fedaval.api.run_training`` (``overhead.time_fedaval``) train the same
model on the same data. Three shapes (``--shapes``, default all):

* ``long-task``: the shared CIFAR-10 subset (``--train-per-class`` /
  ``--test-per-class``), ``cnn``, ``--clients`` 3 clients, one task of
  ``--long-rounds`` 15 rounds, every client every round.
* ``short-tasks``: the same data, fcil-sync with ``--tasks`` 5 tasks of
  ``--rounds-per-task`` 3 rounds (``overhead.py``'s default work).
* ``cross-device``: pfl's own cross-device shape scaled to this machine:
  ``--cd-clients`` 1000 clients of ``--cd-images`` 50 CIFAR-10 images each
  (fcil-sync, one task, Dirichlet alpha 1e6: 5 images of every class each),
  ``--cd-per-round`` 50 sampled per round (fedaval's ``--clients-per-round``,
  with its default ``--offload-clients auto``, which keeps all 1000 ``cnn``
  clients live since they fit in memory), batch ``--cd-batch`` 10, ``--cd-rounds`` 200
  rounds, ``--cd-test-per-class`` 10 test images per class.

What is identical (the work of ``overhead.time_plain``, cut into pfl's pieces,
with that file's helpers imported, not copied): the data (fedaval's
``load_dataset``), partition and client sampling (fedaval's ``fcil_sync`` and
``make_schedule`` from the run's seed: pfl's user sampler replays that
schedule, one user id per call, in client-id order within a round), the initial
model (``torch.manual_seed(seed)`` then ``build_model``), local training (SGD,
``--lr``, momentum 0, weight decay 1e-4, a fresh optimizer per client round,
``--local-epochs`` epochs of the same minibatches in the same order: every
epoch's order is drawn from the client's own ``torch.Generator``, seeded from
(seed, client id), as fedaval's data loaders draw it), FedAvg weights (each
client's sample count) and the evaluation fedaval does after every round (the
global model on the test samples of every class seen so far; each client
trained in the round on the test samples of its own seen classes, with one draw
from its generator per seen task, as fedaval's eval loaders draw). The final
global models are compared (max |difference|).

Differences between the two sides:

* Aggregation arithmetic. pfl sums the users' weighted float32 model
  differences (sample count x (local - global)), divides by the total weight
  and applies the average to the central model with its central optimizer
  (SGD, learning rate 1.0: global + average difference), all in float32;
  fedaval averages the clients' weights themselves in float64 in client order
  and rounds the average to float32. The final models then agree only within
  float tolerance. ``--exact`` adds one untimed pfl run per shape whose users
  send (sample count / round total) x local weights in float64, summed by
  pfl's own ``SumAggregator`` in client order, the sum (rounded to float32)
  replacing the central model, which is fedaval's arithmetic: difference 0.0.
* Weighting. pfl's ``FederatedAveraging`` weights every user alike unless a
  weighting postprocessor is given; the pfl side is given pfl's own
  ``WeightByDatapoints`` (fedaval's FedAvg weights by sample count).
* BatchNorm statistics. pfl's ``PyTorchModel`` federates the trainable
  parameters only: BatchNorm's running means and variances would stay on the
  one central module, carried from each simulated user into the next and
  never averaged. The pfl side uses a ``PyTorchModel`` subclass that adds the
  floating-point buffers to pfl's federated variables (reset for every user,
  averaged and applied like the parameters), which is what fedaval's FedAvg
  does with every floating-point state_dict entry. The integer
  ``num_batches_tracked`` is federated on neither side (unused by BatchNorm
  with its default momentum).
* Client sampling. pfl's own user samplers draw users at random
  (``get_user_sampler('random' | 'minimize_reuse')``); the pfl side's sampler
  replays fedaval's schedule instead, so the same clients train in the same
  order (pfl's cohort size is one number: every round samples as many).
* Minibatch order. pfl's ``Dataset`` yields a user's data in stored order, the
  same every epoch; the pfl side's user dataset (a ``Dataset`` subclass) draws
  each epoch's order from the client's generator instead.
* Evaluation. pfl's own local evaluation (the user's model on its training
  data before and after local training, at iteration 0 and every
  ``evaluation_frequency`` iterations) is switched off; fedaval's evaluation
  is done instead: the global model by a pfl callback after every central
  iteration, each client's model inside ``train_one_user`` right after its
  training (fedaval evaluates it after the round's fusion: the same numbers,
  since each client has its own generator and evaluation changes no weight).
* Client state. fedaval keeps every client (model, Avalanche strategy,
  evaluator, random streams; offloaded to pickles in memory in the
  cross-device shape) for the whole run; pfl keeps no model per user (one
  central module is trained for each user and reset), and the pfl side keeps
  only each client's generator and seen tasks.
* Data. pfl's side gathers every client's samples once at set-up (as pfl's
  ``FederatedDataset.from_slices`` does) and indexes them per minibatch;
  fedaval's device data path gathers every minibatch from the whole dataset.
  The same images reach the model, normalised the same way.
* Output. fedaval writes what a run writes by default (rounds.jsonl,
  results.json, TensorBoard events, checkpoints per ``--checkpoint-every
  auto``); pfl writes nothing, and its per-iteration metrics printout
  (``send_metrics_to_platform``) is off.

Timed on pfl's side: its whole simulation, data set-up included (loading the
data, partition, schedule, initial model, pfl's objects, then
``FederatedAveraging.run``). Timed on fedaval's side: ``overhead.time_fedaval``
(``fedaval.api.run_training`` with its defaults, ``--augment none``, in a
temporary run folder removed after each run). Each timed run has an
interpreter of its own (``--in-process``: all in this one), so that each side
runs in the process state its users get: fedaval's ``--host-memory keep``
(its default: freed host memory kept for reuse) would otherwise stay with the
process and speed up the pfl side too; ``--pfl-host-memory keep`` gives the
pfl side's processes the same policy, which compares the frameworks alone.
Interpreter start-up and imports are not timed on either side: an untimed
one-round run of the same side comes first in each process (lazy imports,
first allocations), and each shape's data is loaded once untimed (the
decoded-image cache, which both sides then read). Repeats alternate which
side goes first; medians are reported, and the ratio fedaval / pfl.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # ``overhead`` and ``cifar_data`` importable when run from elsewhere
    sys.path.insert(0, str(HERE))

os.environ.setdefault("PFL_PYTORCH_DEVICE", "cpu")  # both sides on the CPU (pfl picks CUDA when present)

import numpy as np  # noqa: E402
import overhead  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from overhead import accuracy, draw, max_difference, normalise, shape_work, shuffled  # noqa: E402
from torch import nn  # noqa: E402

try:
    import pfl
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel
    from pfl.stats import MappedVectorStatistics
except ImportError as error:  # pragma: no cover - benchmark-only dependency
    raise SystemExit(f"pfl is not installed ({error}); pip install -e '.[pfl]' in its own environment") from error

SHAPES = ("long-task", "short-tasks", "cross-device")


# --- the pfl side -------------------------------------------------------------------
class Classifier(nn.Module):
    """fedaval's model with the ``loss`` and ``metrics`` methods pfl's
    ``PyTorchModel`` calls; the input normalisation of fedaval's data path
    inside (``overhead.normalise``)."""

    def __init__(self, net: nn.Module, mean, std):
        super().__init__()
        self.net, self.mean, self.std = net, mean, std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(normalise(x, self.mean, self.std))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.train()
        return F.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        self.eval()
        return {"accuracy": Weighted(float((self(x).argmax(1) == y).sum()), len(y))}


class PyTorchModelWithBuffers(PyTorchModel):
    """pfl's ``PyTorchModel`` with the floating-point buffers (BatchNorm's
    running statistics) federated like the parameters, as fedaval's FedAvg
    federates every floating-point state_dict entry: pfl reads, resets and
    differences its ``variable_map``, and an averaged buffer difference is
    added as the central SGD (learning rate 1.0) adds a parameter's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.buffers = {k: b for k, b in self.pytorch_model.named_buffers() if b.is_floating_point()}
        self.variable_map.update(self.buffers)

    def apply_model_update(self, statistics: MappedVectorStatistics):
        for name, buffer in self.buffers.items():
            buffer.add_(statistics[name])
        parameters = {k: v for k, v in statistics.items() if k not in self.buffers}
        return super().apply_model_update(MappedVectorStatistics(parameters, weight=statistics.weight))


class ClientData(Dataset):
    """One client's samples of one task; every epoch's minibatch order is drawn
    from the client's generator as a shuffling torch DataLoader draws it
    (``overhead.shuffled``), where pfl's ``Dataset`` keeps the stored order."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, client: dict, weight: float):
        super().__init__(raw_data=(x, y), user_id=str(client["id"]), metadata={"weight": weight})
        self.client = client

    def iter(self, batch_size):  # noqa: A003 - pfl's name
        x, y = self.raw_data
        order = shuffled(len(y), self.client["rng"])
        for i in range(0, len(order), batch_size):
            batch = order[i : i + batch_size]
            yield x[batch], y[batch]


class FedAvgAsFedaval(FederatedAveraging):
    """pfl's ``FederatedAveraging`` with fedaval's evaluation instead of pfl's
    own local one, and, with ``exact``, fedaval's aggregation arithmetic
    (float64 terms summed in client order by pfl's ``SumAggregator``)."""

    def __init__(self, run: dict, exact: bool):
        super().__init__()
        self.bench, self.exact = run, exact  # not self.run: FederatedAlgorithm.run is the training loop

    def get_next_central_contexts(self, *args, **kwargs):
        contexts, model, metrics = super().get_next_central_contexts(*args, **kwargs)
        if contexts is not None:  # pfl's local evaluation (users' training data, before and after training): off
            contexts = tuple(dataclasses.replace(c, do_evaluation=False) for c in contexts)
        return contexts, model, metrics

    def train_one_user(self, initial_model_state, model, user_dataset, central_context):
        statistics, metrics = super().train_one_user(initial_model_state, model, user_dataset, central_context)
        if self.exact:  # fedaval's terms, (sample count / round total) x local weights in float64
            w = user_dataset.metadata["weight"]
            statistics = MappedVectorStatistics({k: v.detach().double() * w for k, v in model.variable_map.items()})
        evaluate_client(self.bench, user_dataset.client, model.pytorch_model.net)
        return statistics, metrics

    def process_aggregated_statistics(self, central_context, aggregate_metrics, model, statistics):
        if not self.exact:
            return super().process_aggregated_statistics(central_context, aggregate_metrics, model, statistics)
        model.set_parameters(MappedVectorStatistics({k: v.to(torch.float32) for k, v in statistics.items()}))
        return model, Metrics()


def evaluate_client(run: dict, client: dict, net: nn.Module) -> float:
    """fedaval's evaluation of a client trained this round: its model on the
    test samples of its seen classes, one generator draw per seen task."""
    data = run["data"]
    classes = sorted({c for t in client["seen"] for c in client["tasks"].classes[t]})
    for _ in sorted(client["seen"]):  # one pass per seen task, drawn like an eval loader
        draw(client["rng"])
    mask = torch.isin(data.test_y, torch.tensor(classes))
    return accuracy(net, data.test_x[mask], data.test_y[mask], data)


class GlobalEvaluation(TrainingProcessCallback):
    """fedaval's evaluation of the global model after every round: the test
    samples of every class the federation has seen."""

    def __init__(self, run: dict):
        self.run = run

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        run, data = self.run, self.run["data"]
        task = central_iteration // run["work"].rounds_per_task
        mask = torch.isin(data.test_y, torch.tensor(run["seen_by_task"][task]))
        run["accuracy"] = accuracy(model.pytorch_model.net, data.test_x[mask], data.test_y[mask], data)
        return False, Metrics()


def time_pfl(work, exact: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    """Wall time of one pfl simulation of ``work``, data set-up included, and
    its final global model."""
    from fedaval.build import make_schedule
    from fedaval.datasets import load_dataset
    from fedaval.models import build_model
    from fedaval.scenarios.partition import fcil_sync

    start = time.perf_counter()
    data = load_dataset(work.dataset, work.data_root, False)
    rng = np.random.default_rng(work.seed)
    partition = fcil_sync(data.train_y.numpy(), data.num_classes, work.clients, work.tasks, work.alpha, rng)
    schedule = make_schedule(partition, work.rounds_per_task, work.clients_per_round, rng)
    if len({len(chosen) for chosen in schedule}) != 1:
        raise SystemExit("pfl's cohort size is one number here; this schedule samples different counts per round")
    torch.manual_seed(work.seed)
    net = build_model(work.model, data.input_shape, data.num_classes)
    seen_by_task: list[list[int]] = []
    for task in range(partition.num_tasks):
        new = {c for cl in partition.clients for c in cl.classes[task]}
        seen_by_task.append(sorted(set(seen_by_task[-1] if seen_by_task else []) | new))
    run = {"work": work, "data": data, "seen_by_task": seen_by_task}
    clients = [
        {
            "id": k,
            "tasks": tasks,
            "seen": [],
            "rng": torch.Generator().manual_seed(int(np.random.SeedSequence([work.seed, k]).generate_state(1)[0])),
            "slices": [
                (data.train_x[torch.as_tensor(index)], data.train_y[torch.as_tensor(index)]) for index in tasks.indices
            ],
        }
        for k, tasks in enumerate(partition.clients)
    ]

    def make_user(user: tuple[int, int]) -> ClientData:
        round, k = user
        task, client = round // work.rounds_per_task, clients[k]
        if task not in client["seen"]:
            client["seen"].append(task)
        total = float(sum(len(clients[j]["slices"][task][1]) for j in schedule[round]))
        x, y = client["slices"][task]
        return ClientData(x, y, client, len(y) / total)

    replay = iter([(round, k) for round, chosen in enumerate(schedule) for k in chosen])
    users = FederatedDataset(make_user, lambda: next(replay))
    model = PyTorchModelWithBuffers(
        model=Classifier(net, data.mean, data.std),
        local_optimizer_create=functools.partial(torch.optim.SGD, momentum=0.0, weight_decay=1e-4),
        central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
    )
    backend = SimulatedBackend(
        training_data=users, val_data=users, postprocessors=[] if exact else [WeightByDatapoints()]
    )
    FedAvgAsFedaval(run, exact).run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=len(schedule),
            evaluation_frequency=len(schedule),
            train_cohort_size=len(schedule[0]),
            val_cohort_size=None,
        ),
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_batch_size=work.batch_size, local_num_epochs=work.local_epochs, local_learning_rate=work.lr
        ),
        callbacks=[GlobalEvaluation(run)],
        send_metrics_to_platform=False,
    )
    seconds = time.perf_counter() - start
    return seconds, {k: v.detach().clone() for k, v in net.state_dict().items()}


# --- shapes, timing, report ---------------------------------------------------------
def setting(work, shape: str) -> str:
    data = work.data_text
    sampled = f", {work.clients_per_round} sampled per round" if work.clients_per_round else ", all every round"
    return (
        f"{shape}: {data}, model {work.model}, fcil-sync {work.clients} clients (alpha {work.alpha:g}) x "
        f"{work.tasks} task(s) x {work.rounds_per_task} rounds{sampled}, {work.local_epochs} local epoch(s), "
        f"batch {work.batch_size}, lr {work.lr}, seed {work.seed}"
    )


def time_fedaval(work, tmp: Path, name: str) -> tuple[float, dict[str, torch.Tensor]]:
    out = tmp / name
    try:
        return overhead.time_fedaval(work, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def time_side(side: str, work, tmp: Path, name: str, pfl_host_memory: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One timed run of ``side`` in this process (the pfl side's process first
    given ``pfl_host_memory``, fedaval's ``--host-memory`` policy)."""
    if side == "fedaval":
        return time_fedaval(work, tmp, name)
    from fedaval import host_memory

    host_memory.apply(pfl_host_memory)
    return time_pfl(work)


def time_isolated(args, side: str, work, tmp: Path, name: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One timed run of ``side`` in an interpreter of its own (``--child``),
    after an untimed one-round run there (lazy imports, first allocations), so
    that neither side runs in the process state the other left: the C
    library's malloc policy above all (fedaval's ``--host-memory keep``, once
    applied, stays with the process; a pfl user's process has glibc's own)."""
    job = tmp / f"{name}-{side}.pt"
    torch.save({"side": side, "work": work, "threads": args.threads, "pfl_host_memory": args.pfl_host_memory}, job)
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(job)], check=True)
    seconds, state = torch.load(job, weights_only=False)["result"]
    job.unlink()
    return seconds, state


def child(job_path: str) -> int:
    """``--child JOB``: the timed run that ``time_isolated`` asked for."""
    job = torch.load(job_path, weights_only=False)
    torch.set_num_threads(job["threads"])
    tmp = Path(tempfile.mkdtemp(prefix="fedaval-pfl-child-"))
    try:
        warm = copy.copy(job["work"])
        warm.tasks, warm.rounds_per_task = 1, 1
        time_side(job["side"], warm, tmp, "warm-up", job["pfl_host_memory"])
        job["result"] = time_side(job["side"], job["work"], tmp, "timed", job["pfl_host_memory"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    torch.save(job, job_path)
    return 0


def measure(args, shape: str, tmp: Path, warm_up: bool) -> dict:
    """``--repeats`` alternating timed runs of both sides on one shape, each
    in a fresh interpreter (``--in-process``: all in this one, after an
    untimed one-round run of each with ``warm_up``), and the largest weight
    difference."""
    from fedaval.datasets import load_dataset

    work = shape_work(args, shape)
    load_dataset(work.dataset, work.data_root, False)  # untimed: the decoded-image cache of this shape's data
    if warm_up and args.in_process:
        warm = copy.copy(work)
        warm.tasks, warm.rounds_per_task = 1, 1
        time_fedaval(warm, tmp, f"{shape}-warm-up")
        time_pfl(warm)
    times: dict[str, list[float]] = {"fedaval": [], "pfl": []}
    difference = 0.0
    for repeat in range(args.repeats):
        states = {}
        for side in ("fedaval", "pfl") if repeat % 2 == 0 else ("pfl", "fedaval"):
            if args.in_process:
                seconds, states[side] = time_side(side, work, tmp, f"{shape}-{repeat}", args.pfl_host_memory)
            else:
                seconds, states[side] = time_isolated(args, side, work, tmp, f"{shape}-{repeat}")
            times[side].append(seconds)
            print(f"{shape}, repeat {repeat}: {side} {seconds:.3f} s", flush=True)
        difference = max(difference, max_difference(states["fedaval"], states["pfl"]))
    result = {"setting": setting(work, shape), "times": times, "difference": difference, "exact": None}
    if args.exact:
        result["exact"] = max_difference(states["fedaval"], time_pfl(work, exact=True)[1])
    return result


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    overhead.add_work_arguments(parser)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    parser.add_argument("--long-rounds", type=int, default=15, help="rounds of the long-task shape's one task")
    cd = overhead.CROSS_DEVICE
    parser.add_argument("--cd-clients", type=int, default=cd["cd_clients"], help="cross-device: clients")
    parser.add_argument(
        "--cd-images", type=int, default=cd["cd_images"], help="cross-device: CIFAR-10 training images per client"
    )
    parser.add_argument(
        "--cd-per-round", type=int, default=cd["cd_per_round"], help="cross-device: clients sampled per round"
    )
    parser.add_argument("--cd-rounds", type=int, default=cd["cd_rounds"], help="cross-device: rounds")
    parser.add_argument("--cd-batch", type=int, default=cd["cd_batch"], help="cross-device: local batch size")
    parser.add_argument(
        "--cd-test-per-class",
        type=int,
        default=cd["cd_test_per_class"],
        help="cross-device: CIFAR-10 test images per class",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, choices=(1, 2), help="torch threads, both sides")
    parser.add_argument(
        "--exact", action="store_true", help="add an untimed pfl run per shape with fedaval's float64 aggregation"
    )
    parser.add_argument(
        "--pfl-host-memory",
        default="release",
        choices=("release", "keep"),
        help="the pfl side's process under fedaval's --host-memory policy (default release: glibc's own, "
        "what a pfl user gets; keep: the same as fedaval's default, to compare the frameworks alone)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="time both sides in this process (faster; the side that runs later inherits the malloc policy "
        "fedaval applied, so the ratio then leaves fedaval's --host-memory out)",
    )
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/results/pfl_overhead.md")
    args = parser.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown or not shapes:
        parser.error(f"--shapes: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SHAPES)}")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    results = {}
    tmp = Path(tempfile.mkdtemp(prefix="fedaval-pfl-"))
    try:
        for shape in shapes:
            results[shape] = measure(args, shape, tmp, warm_up=shape == shapes[0])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load_after = os.getloadavg()

    rows = [
        "| shape | fedaval median s | pfl median s | ratio fedaval / pfl | fedaval, all repeats s | pfl, all repeats s "
        "| max abs weight difference (pfl's float32 FedAvg) | same, pfl aggregating like fedaval (--exact) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape, r in results.items():
        fed, pf = statistics.median(r["times"]["fedaval"]), statistics.median(r["times"]["pfl"])
        exact = "not run" if r["exact"] is None else f"{r['exact']:.2e}"
        rows.append(
            f"| {shape} | {fed:.3f} | {pf:.3f} | **{fed / pf:.3f}** | "
            f"{' '.join(f'{t:.3f}' for t in r['times']['fedaval'])} | {' '.join(f'{t:.3f}' for t in r['times']['pfl'])} "
            f"| {r['difference']:.2e} | {exact} |"
        )
    load = f"load average (1, 5, 15 min) {' '.join(f'{v:.2f}' for v in load_before)} before, {' '.join(f'{v:.2f}' for v in load_after)} after"
    print("\n".join(rows))
    print(load)
    if args.write:
        argv_text = " ".join(argv)
        text = (
            f"\n## {', '.join(shapes)}\n\n"
            f"Command: `python benchmarks/pfl_overhead.py{' ' + argv_text if argv_text else ''}`\n"
            f"Date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}; machine: {platform.machine()}, "
            f"{os.cpu_count()} CPU cores, {load}; {args.threads} torch thread(s) on both sides; pfl {pfl.__version__}, "
            f"torch {torch.__version__}; {args.repeats} alternating repeats\n\n"
            + "\n".join(f"- {r['setting']}" for r in results.values())
            + "\n\n"
            + "\n".join(rows)
            + "\n\nDifferences between the two sides (from the script's docstring):\n\n"
            + differences()
            + "\n"
        )
        path = HERE / "results" / "pfl_overhead.md"
        header = (
            "# fedaval vs Apple's pfl simulator, same FedAvg work\n\n"
            "Written by `benchmarks/pfl_overhead.py --write`; one section per invocation. "
            "pfl is a benchmark-only dependency (the `pfl` extra, in its own environment).\n"
        )
        path.write_text((path.read_text() if path.exists() else header) + text)
    return 0


def differences() -> str:
    """The docstring's list of differences, as markdown bullets."""
    assert __doc__ is not None
    text = __doc__.split("Differences between the two sides:\n", 1)[1].split("\n\nTimed on", 1)[0].strip()
    return "\n".join(("- " + line[2:]) if line.startswith("* ") else line for line in text.splitlines())


if __name__ == "__main__":
    raise SystemExit(main())
