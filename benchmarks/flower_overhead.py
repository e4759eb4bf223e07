"""fedaval against Flower's simulation engine doing the same FedAvg work, in one
invocation (benchmark only: Flower is the optional ``flower`` extra).

    pip install -e '.[flower]'
    python benchmarks/flower_overhead.py            # CIFAR-10 subset, cnn, 3 clients, 5 tasks x 3 rounds
    python benchmarks/flower_overhead.py --write    # also appends the table to benchmarks/results/flower_overhead.md

The work is the work of ``benchmarks/overhead.py`` (``time_plain``), cut into
Flower's pieces, with that file's helpers imported, not copied:

* ServerApp (runs in this process, in a thread of ``flwr.simulation.run_simulation``):
  the fcil-sync partition and schedule from the run's seed, the initial global
  model (``torch.manual_seed(seed)`` then ``build_model``), Flower's own
  message-API ``FedAvg`` strategy (``flwr.serverapp.strategy.FedAvg``, all
  clients every round, weights = the ``num-examples`` each client reports,
  i.e. its sample count), and the global evaluation after every round as the
  strategy's ``evaluate_fn`` (the round-0 call Flower makes before training
  is answered with ``None`` and does no work).
* ClientApp (runs in Ray actors, one per CPU given to Flower): ``train`` does
  ``time_plain``'s local training; the continual-learning task of the round
  comes in the train config (``task-of-round`` indexed by Flower's
  ``server-round``). ``evaluate`` evaluates the client's own trained model on
  the test samples of its seen classes, with one draw from its generator per
  seen task (fedaval's eval loaders), and ignores the global arrays Flower
  sends with it.
* Client state between rounds lives in Flower's per-node ``Context.state``
  (kept by the simulation engine in this process and shipped to whichever
  actor runs the node's next message), not in actor memory: a client is not
  pinned to an actor. It holds the client's whole ``state_dict`` (so BatchNorm's
  int ``num_batches_tracked`` stays local: only the float entries, the ones
  FedAvg averages, are replaced by the download), its torch.Generator state,
  and its seen tasks. The optimiser (SGD, momentum 0) has no state, so a new
  one each round does the same steps as a kept one.

Flower's FedAvg accumulates ``value * weight`` in the arrays' own dtype
(float32 numpy, Python-float weights) in reply arrival order, where fedaval
and ``time_plain`` accumulate in float64 in client order: the final global
models then agree only within float tolerance. ``--exact`` adds one untimed
run with the same strategy whose ``aggregate_train`` accumulates in float64 in
client order, to show that everything else is the same work (difference 0.0).

Timed on the Flower side: the whole ``run_simulation`` call (Ray start and
shutdown, actor start-up, data loading in the ServerApp and in every actor,
message and Context (de)serialisation). Timed on fedaval's side:
``overhead.time_fedaval`` (``fedaval.api.run_training`` with its default
results.json, TensorBoard and checkpoint writing). Interpreter start-up and
imports are not timed on either side.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no network calls from Flower
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # ``overhead`` and this module importable here and in Ray's workers
    sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import overhead  # noqa: E402
import torch  # noqa: E402
from overhead import accuracy, draw, max_difference, normalise, shuffled  # noqa: E402
from torch import nn  # noqa: E402

try:
    import flwr
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation
except ImportError as error:  # pragma: no cover - benchmark-only dependency
    raise SystemExit(f"Flower is not installed ({error}); pip install -e '.[flower]'") from error

SETTINGS = (
    "dataset",
    "data_root",
    "model",
    "clients",
    "tasks",
    "alpha",
    "rounds_per_task",
    "clients_per_round",
    "local_epochs",
    "batch_size",
    "lr",
    "seed",
)


# --- shared by both halves -----------------------------------------------------------
_SETUP: dict = {}


def setup(config) -> dict:
    """Data, partition and schedule of the run, once per process (the ServerApp's
    and every Ray actor's), exactly as ``time_plain`` builds them."""
    from fedaval.build import make_schedule
    from fedaval.datasets import load_dataset
    from fedaval.scenarios.partition import fcil_sync

    key = tuple(config[k.replace("_", "-")] for k in SETTINGS)
    if key not in _SETUP:
        s = dict(zip(SETTINGS, key))
        data = load_dataset(s["dataset"], s["data_root"] or None, False)
        rng = np.random.default_rng(s["seed"])
        partition = fcil_sync(data.train_y.numpy(), data.num_classes, s["clients"], s["tasks"], s["alpha"], rng)
        schedule = make_schedule(partition, s["rounds_per_task"], s["clients_per_round"], rng)
        _SETUP.clear()
        _SETUP[key] = {"s": s, "data": data, "partition": partition, "schedule": schedule, "models": {}}
    return _SETUP[key]


def model_for(run: dict) -> nn.Module:
    """This process's model object (a container: its whole state is loaded from
    the client's Context before use)."""
    from fedaval.models import build_model

    if "model" not in run["models"]:
        data = run["data"]
        run["models"]["model"] = build_model(run["s"]["model"], data.input_shape, data.num_classes)
    return run["models"]["model"]


# --- ClientApp ------------------------------------------------------------------------
client_app = ClientApp()


def _restore(context: Context, run: dict, client_id: int):
    """The client's model, generator and seen tasks from its Context (first
    call: a fresh model, whose float entries the download replaces, and the
    generator seeded from (seed, client id) as fedaval seeds it)."""
    model = model_for(run)
    if "model" in context.state:
        model.load_state_dict(context.state["model"].to_torch_state_dict())
        generator = torch.Generator()
        generator.set_state(context.state["rng"].to_torch_state_dict()["state"].clone())
        seen = list(context.state["client"]["seen"])
        trained = bool(context.state["client"]["trained"])
    else:
        from fedaval.models import build_model

        data = run["data"]
        model.load_state_dict(build_model(run["s"]["model"], data.input_shape, data.num_classes).state_dict())
        seed = int(np.random.SeedSequence([run["s"]["seed"], client_id]).generate_state(1)[0])
        generator, seen, trained = torch.Generator().manual_seed(seed), [], False
    return model, generator, seen, trained


def _save(context: Context, model: nn.Module, generator: torch.Generator, seen: list[int], trained: bool) -> None:
    context.state["model"] = ArrayRecord({k: v.detach().clone() for k, v in model.state_dict().items()})
    context.state["rng"] = ArrayRecord({"state": generator.get_state()})
    context.state["client"] = ConfigRecord({"seen": seen, "trained": trained})  # seen is never empty here


@client_app.train()
def client_train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    config = msg.content["config"]
    run = setup(config)
    s, data = run["s"], run["data"]
    client_id = int(context.node_config["partition-id"])
    task = int(config["task-of-round"][int(config["server-round"]) - 1])
    model, generator, seen, _ = _restore(context, run, client_id)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict(), strict=False)  # the float entries only
    optimizer = torch.optim.SGD(model.parameters(), lr=s["lr"], momentum=0.0, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    tasks = run["partition"].clients[client_id]
    index = torch.as_tensor(tasks.indices[task])
    if task not in seen:
        seen.append(task)
    model.train()
    for _ in range(s["local_epochs"]):
        order = index[shuffled(len(index), generator)]
        for i in range(0, len(order), s["batch_size"]):
            batch = order[i : i + s["batch_size"]]
            optimizer.zero_grad()
            loss = loss_fn(model(normalise(data.train_x[batch], data.mean, data.std)), data.train_y[batch])
            loss.backward()
            optimizer.step()
    _save(context, model, generator, seen, True)
    shared = ArrayRecord({k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()})
    metrics = MetricRecord({"num-examples": len(index), "client-id": client_id})
    return Message(content=RecordDict({"arrays": shared, "metrics": metrics}), reply_to=msg)


@client_app.evaluate()
def client_evaluate(msg: Message, context: Context) -> Message:
    """The client's own model (trained this round), not the global arrays sent."""
    torch.set_num_threads(1)
    run = setup(msg.content["config"])
    data = run["data"]
    client_id = int(context.node_config["partition-id"])
    model, generator, seen, trained = _restore(context, run, client_id)
    if not trained:
        raise RuntimeError("every client trains every round in this benchmark")
    tasks = run["partition"].clients[client_id]
    classes = sorted({c for t in seen for c in tasks.classes[t]})
    for _ in sorted(seen):  # one pass per seen task, drawn like an eval loader
        draw(generator)
    mask = torch.isin(data.test_y, torch.tensor(classes))
    score = accuracy(model, data.test_x[mask], data.test_y[mask], data)
    _save(context, model, generator, seen, False)
    metrics = MetricRecord({"accuracy": score, "num-examples": int(mask.sum())})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


# --- ServerApp ------------------------------------------------------------------------
class FedAvgFloat64(FedAvg):
    """Flower's FedAvg with the aggregation of fedaval/time_plain: float64
    accumulation in client order (``--exact`` only; not timed)."""

    def aggregate_train(self, server_round, replies):
        replies = [m for m in replies if not m.has_error()]
        if len(replies) == 0:
            return None, None
        contents = sorted((m.content for m in replies), key=lambda c: int(c["metrics"]["client-id"]))
        weights = [float(c["metrics"]["num-examples"]) for c in contents]
        fused = {}
        for key in contents[0]["arrays"]:
            values = [torch.from_numpy(c["arrays"][key].numpy()) for c in contents]
            acc = torch.zeros_like(values[0], dtype=torch.float64)
            for value, w in zip(values, weights):
                acc += value.to(torch.float64) * (w / sum(weights))
            fused[key] = acc.to(values[0].dtype)
        return ArrayRecord(fused), MetricRecord({"num-examples": sum(weights)})


def make_server_app(args, holder: dict, exact: bool) -> ServerApp:
    from fedaval.models import build_model

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        config = ConfigRecord(
            {k.replace("_", "-"): getattr(args, k) if k != "data_root" else (args.data_root or "") for k in SETTINGS}
        )
        run = setup(config)
        data, partition, schedule = run["data"], run["partition"], run["schedule"]
        everyone = list(range(len(partition.clients)))
        if any(chosen != everyone for chosen in schedule):
            raise SystemExit("Flower's FedAvg samples all nodes here; this benchmark needs every client every round")
        task_of_round = [t for t in range(partition.num_tasks) for _ in range(args.rounds_per_task)]
        torch.manual_seed(args.seed)
        server = build_model(args.model, data.input_shape, data.num_classes)
        shared = {k: v.detach().clone() for k, v in server.state_dict().items() if v.is_floating_point()}
        seen_by_task = []
        for task in range(partition.num_tasks):
            seen_by_task.append(
                sorted(
                    set(seen_by_task[-1] if seen_by_task else [])
                    | {c for cl in partition.clients for c in cl.classes[task]}
                )
            )

        def evaluate(server_round: int, arrays: ArrayRecord):
            if server_round == 0:  # Flower's evaluation before training: fedaval has none
                return None
            server.load_state_dict(arrays.to_torch_state_dict(), strict=False)
            if server_round == 1:
                holder["round1_end"] = time.perf_counter()
            mask = torch.isin(data.test_y, torch.tensor(seen_by_task[task_of_round[server_round - 1]]))
            return MetricRecord({"accuracy": accuracy(server, data.test_x[mask], data.test_y[mask], data)})

        n = len(everyone)
        strategy = (FedAvgFloat64 if exact else FedAvg)(
            fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n
        )
        train_config = ConfigRecord(dict(config))
        train_config["task-of-round"] = task_of_round
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(shared),
            num_rounds=len(task_of_round),
            train_config=train_config,
            evaluate_config=ConfigRecord(dict(config)),
            evaluate_fn=evaluate,
        )
        holder["later_rounds_s"] = time.perf_counter() - holder["round1_end"]
        holder["state"] = {k: v.clone() for k, v in result.arrays.to_torch_state_dict().items()}
        holder["accuracy"] = result.evaluate_metrics_serverapp[len(task_of_round)]["accuracy"]

    return app


def time_flower(
    args, cpus: int, exact: bool = False, holder: dict | None = None
) -> tuple[float, dict[str, torch.Tensor]]:
    """Wall time of one ``run_simulation`` call and its final global model;
    ``holder`` also gets ``later_rounds_s``, the time from the global
    evaluation of round 1 to the end of the last round (the steady state: Ray,
    actor start-up, imports and data loading in the actors, and Flower's
    shutdown are all outside it)."""
    import flower_overhead  # the ClientApp from an importable module, so Ray's workers import it, not unpickle copies

    holder = {} if holder is None else holder
    backend_config = {
        "init_args": {"num_cpus": cpus, "num_gpus": 0, "address": "local", "include_dashboard": False},
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
    }
    start = time.perf_counter()
    run_simulation(
        server_app=make_server_app(args, holder, exact),
        client_app=flower_overhead.client_app,
        num_supernodes=args.clients,
        backend_name="ray",
        backend_config=backend_config,
    )
    seconds = time.perf_counter() - start
    if "state" not in holder:
        raise RuntimeError("the Flower run did not finish (see its log above)")
    return seconds, holder["state"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    overhead.add_work_arguments(parser)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process (fedaval, the ServerApp)")
    parser.add_argument(
        "--cpus", default="1,2", help="CPUs (= Ray actors, 1 torch thread each) given to Flower, one side each"
    )
    parser.add_argument(
        "--exact", action="store_true", help="add an untimed Flower run with float64, client-order FedAvg"
    )
    parser.add_argument(
        "--write", action="store_true", help="append the table to benchmarks/results/flower_overhead.md"
    )
    args = parser.parse_args(argv)
    args.device = "cpu"
    torch.set_num_threads(args.threads)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    overhead.resolve_data_root(args)
    cpus = [int(c) for c in args.cpus.split(",")]
    sides = ["fedaval"] + [f"flower-{c}" for c in cpus]

    times: dict[str, list[float]] = {side: [] for side in sides}
    rounds_times: dict[str, list[float]] = {side: [] for side in sides[1:]}
    differences: dict[str, float] = {}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="fedaval-flower-") as tmp:
        overhead.time_plain(args)  # warm-up: decoded-image cache, allocator, lazy imports
        for repeat in range(args.repeats):
            order = sides[repeat % len(sides) :] + sides[: repeat % len(sides)]
            states = {}
            for side in order:
                if side == "fedaval":
                    seconds, states[side] = overhead.time_fedaval(args, Path(tmp) / f"run{repeat}")
                else:
                    for _attempt in range(3):  # on a shared machine, another job's `ray stop` can kill our raylet
                        holder: dict = {}
                        try:
                            seconds, states[side] = time_flower(args, int(side.split("-")[1]), holder=holder)
                            break
                        except Exception as error:  # noqa: BLE001
                            failures.append(f"repeat {repeat}, {side}: {type(error).__name__}: {str(error)[:120]}")
                            print(f"repeat {repeat}: {side} failed ({failures[-1]}); again", flush=True)
                    else:
                        raise RuntimeError("Flower failed three times: " + "; ".join(failures))
                    rounds_times[side].append(holder["later_rounds_s"])
                times[side].append(seconds)
                print(f"repeat {repeat}: {side} {seconds:.3f} s", flush=True)
            for side in sides[1:]:
                differences[side] = max(differences.get(side, 0.0), max_difference(states["fedaval"], states[side]))
        if args.exact:
            try:
                _, exact_state = time_flower(args, cpus[-1], exact=True)
                differences["exact"] = max_difference(states["fedaval"], exact_state)
            except Exception as error:  # noqa: BLE001
                failures.append(f"--exact run: {type(error).__name__}: {str(error)[:120]}")

    medians = {side: statistics.median(times[side]) for side in sides}
    names = {"fedaval": "fedaval train (in-process, 1 torch thread)"}
    names.update(
        {f"flower-{c}": f"Flower run_simulation, Ray {c} CPU(s) = {c} actor(s) x 1 torch thread" for c in cpus}
    )
    rows = ["| side | median s | all repeats s | of which rounds 2 to last, median s |", "|---|---|---|---|"]
    rows += [
        f"| {names[side]} | {medians[side]:.3f} | {' '.join(f'{t:.3f}' for t in times[side])} | "
        f"{f'{statistics.median(rounds_times[side]):.3f}' if side in rounds_times else 'n/a'} |"
        for side in sides
    ]
    summary = [
        f"ratio fedaval / Flower ({side.split('-')[1]} CPU(s)): {medians['fedaval'] / medians[side]:.3f}   "
        f"max |global weight difference|: {differences[side]:.2e} (Flower's float32 FedAvg)"
        for side in sides[1:]
    ]
    if "exact" in differences:
        summary.append(
            f"max |global weight difference| with Flower's strategy aggregating in float64, client order "
            f"(--exact, untimed): {differences['exact']:.2e}"
        )
    if failures:
        summary.append("Flower runs that failed and were run again (not timed): " + "; ".join(failures))
    print("\n".join(rows))
    print("\n".join(summary))
    if args.write:
        argv_text = " ".join(argv if argv is not None else sys.argv[1:])
        setting = (
            f"{args.dataset} ({'shared CIFAR-10, first ' + str(args.train_per_class) + ' train / ' + str(args.test_per_class) + ' test images per class' if args.dataset == 'imagefolder' else 'built in'}), "
            f"model {args.model}, fcil-sync {args.clients} clients x {args.tasks} tasks, {args.rounds_per_task} rounds per task, "
            f"{args.local_epochs} local epoch(s), batch {args.batch_size}, lr {args.lr}, CPU, seed {args.seed}, {args.repeats} alternating repeats"
        )
        import ray

        text = (
            f"\n## {args.dataset}, {args.model}\n\nCommand: `python benchmarks/flower_overhead.py{' ' + argv_text if argv_text else ''}`\n"
            f"Date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}; machine: {platform.machine()}, "
            f"{os.cpu_count()} CPU cores shared with other jobs (times are noisy; compare only within one invocation); "
            f"Flower {flwr.__version__} (flwr.simulation.run_simulation, ServerApp/ClientApp message API, "
            f"flwr.serverapp.strategy.FedAvg), Ray {ray.__version__}, torch {torch.__version__}\n"
            f"Setting: {setting}.\n\n" + "\n".join(rows) + "\n\n" + "\n".join(f"- {line}" for line in summary) + "\n"
        )
        path = HERE / "results" / "flower_overhead.md"
        header = (
            "# fedaval vs Flower's simulation engine, same FedAvg work\n\n"
            "Written by `benchmarks/flower_overhead.py --write`; one section per invocation. "
            "Flower is a benchmark-only dependency (the `flower` extra).\n"
        )
        path.write_text((path.read_text() if path.exists() else header) + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
