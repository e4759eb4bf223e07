"""The ``fedaval`` command. Thin: it parses, then calls the library.

``fedaval --help``, ``fedaval plugins`` and ``fedaval scenarios`` do not
import torch.
"""

from __future__ import annotations

from contextlib import contextmanager

import click

from fedaval import config_file
from fedaval.errors import FedavalUsageError, RunFailure, RunInterrupted, RunStopped


def parse_assignments(values: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """``("gldp.lam=0.3", "sthfl.clients=20")`` -> ``{"gldp": {"lam": "0.3"}, ...}``."""
    out: dict[str, dict[str, str]] = {}
    for value in values:
        key, sep, raw = value.partition("=")
        owner, dot, name = key.partition(".")
        if not sep or not dot or not owner or not name:
            raise FedavalUsageError(f"bad option {value!r}; expected -o name.key=value, e.g. -o fedprox.mu=0.01")
        out.setdefault(owner.strip(), {})[name.strip()] = raw.strip()
    return out


class OneLineUsageError(click.UsageError):
    """A click usage error (an unknown option or command, a value of the wrong
    type, a missing value) shown as the one line fedaval's own usage errors
    are, status 2, instead of click's usage block."""

    def show(self, file=None) -> None:
        where = f" (see '{self.ctx.command_path} --help')" if self.ctx is not None else ""
        click.echo(f"fedaval: error: {self.format_message()}{where}", file=file, err=file is None)


def one_line(exc: click.UsageError) -> OneLineUsageError:
    if isinstance(exc, OneLineUsageError):
        return exc
    return OneLineUsageError(exc.format_message(), exc.ctx)


class FedavalGroup(click.Group):
    """Prints a :class:`FedavalUsageError` or a click usage error (parsing)
    as one line and exits with status 2, a :class:`RunFailure` as one line
    and exits with status 1, a :class:`RunInterrupted` (Ctrl-C, SIGTERM) as
    one line and exits with status 130, a :class:`RunStopped`
    (``--time-limit``) as one line and exits with status 75."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:  # the group's own options and arguments
            raise one_line(exc) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:  # the command's name, and its options as it parses them
            raise one_line(exc) from None
        except FedavalUsageError as exc:
            click.echo(f"fedaval: error: {exc}", err=True)
            ctx.exit(2)
        except RunFailure as exc:
            show_traceback(exc)
            click.echo(f"fedaval: run stopped: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except RunInterrupted as exc:
            click.echo(f"fedaval: {exc}", err=True)
            ctx.exit(130)
        except RunStopped as exc:
            click.echo(f"fedaval: {exc}", err=True)
            ctx.exit(75)
        except KeyboardInterrupt:  # before the first round started (loading data, building clients)
            click.echo(
                "fedaval: interrupted before the run's first round finished; its folder holds no results", err=True
            )
            ctx.exit(130)


def show_traceback(exc: BaseException) -> None:
    """With ``FEDAVAL_TRACEBACK=1``, the whole traceback of a run's failure
    (and of what caused it: a client's, a worker's) before its one line: for
    a plugin author following an error into their code."""
    import os
    import traceback

    if os.environ.get("FEDAVAL_TRACEBACK", "") not in ("", "0"):
        click.echo("".join(traceback.format_exception(exc)).rstrip(), err=True)


@contextmanager
def sigterm_as_interrupt():
    """Within the block SIGTERM raises :class:`KeyboardInterrupt`, as Ctrl-C
    does, so a terminated run records where it stopped and says how to resume."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@click.group(cls=FedavalGroup)
@click.version_option(package_name="fedaval")
def cli() -> None:
    """Federated continual learning on Avalanche. Methods are plugins."""


@cli.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    is_eager=True,
    callback=config_file.load_into_context,
    help="TOML file of these options (see configs/README.md); the command line wins.",
)
@click.option(
    "--plugins",
    "-p",
    "plugins",
    multiple=True,
    default=("fedavg",),
    show_default=True,
    help="Method plugins by name or package.module:Class; repeat or comma-separate.",
)
@click.option(
    "--option",
    "-o",
    "options",
    multiple=True,
    metavar="NAME.KEY=VALUE",
    help="A plugin's or the scenario's option, e.g. -o gldp.lam=0.5 -o sthfl.clients=20.",
)
@click.option("--scenario", default="fcil-sync", show_default=True, help="Setting; see `fedaval scenarios`.")
@click.option(
    "--dataset",
    default="digits",
    show_default=True,
    help="digits, mnist, fashion-mnist, cifar10, cifar100, tiny-imagenet or imagefolder.",
)
@click.option("--data-root", default=None, help="Folder holding the dataset (torchvision layout, or train/ and test/).")
@click.option("--download", is_flag=True, help="Download a torchvision dataset into --data-root if missing.")
@click.option(
    "--model",
    default="auto",
    show_default=True,
    help="auto (mlp on 8x8 images, else cnn), mlp, cnn, resnet18, resnet34, or a model a plugin registers.",
)
@click.option("--rounds-per-task", default=3, show_default=True, type=int, help="Federated rounds per task.")
@click.option(
    "--local-epochs", default=None, type=int, help="Local epochs per round. Default: 2 on digits, 1 elsewhere."
)
@click.option("--clients-per-round", default=0, show_default=True, type=int, help="Clients sampled per round (0: all).")
@click.option(
    "--client-sampling",
    default="round",
    show_default=True,
    help="When --clients-per-round draws its clients: round, afresh every round; task, once per task, the "
    "same clients in each of its rounds (PFCL's Algorithm 1).",
)
@click.option("--batch-size", default=32, show_default=True, type=int, help="Minibatch size of local training.")
@click.option(
    "--optimizer",
    default="sgd",
    show_default=True,
    help="Local optimizer: sgd, or adam (Adam; --lr default 1e-3, no --momentum).",
)
@click.option(
    "--lr",
    default=None,
    type=float,
    help="Local learning rate. Default: 0.05 on digits, 0.01 elsewhere; 1e-3 with --optimizer adam.",
)
@click.option(
    "--momentum", default=None, type=float, help="Local SGD momentum. Default: 0 on digits, 0.9 elsewhere (sgd only)."
)
@click.option(
    "--weight-decay", default=1e-4, show_default=True, type=float, help="Weight decay (L2 on the gradient), >= 0."
)
@click.option(
    "--optimizer-state",
    default="reset",
    show_default=True,
    help="reset: a fresh optimizer state (momentum) every round, as FedAvg/FedProx/FedNova clients; "
    "keep: one state for the whole run.",
)
@click.option(
    "--lr-schedule",
    default="constant",
    show_default=True,
    help="Learning rate per global round: constant, cosine or exp (from --lr in round 1 to --lr-min in the last).",
)
@click.option("--lr-min", default=1e-4, show_default=True, type=float, help="Last round's learning rate of a decay.")
@click.option(
    "--augment",
    default="auto",
    show_default=True,
    help="standard: random crop (4-pixel padding) + horizontal flip per training sample; none; "
    "auto: standard for CIFAR-10/100, Tiny-ImageNet and small-image folders, none for digits/MNIST.",
)
@click.option(
    "--eval-every",
    default=1,
    show_default=True,
    type=int,
    help="Evaluate every N rounds (and always at the end of each task). Evaluation draws from the clients' "
    "random streams, so another N is another sample of the training, as another seed is (docs/report.md).",
)
@click.option(
    "--client-test",
    default="test",
    show_default=True,
    help="How a client's accuracy (client_accuracy, a_loc, a_sel, a_glo) weighs its seen classes: test, every "
    "test sample of them once (the test split's class mix); train, each class's accuracy weighted by the "
    "client's share of training samples of that class (its own class mix; docs/report.md).",
)
@click.option(
    "--utility-lambda",
    default=0.5,
    show_default=True,
    type=float,
    help="lambda of the continual utility U = lambda*stability + (1-lambda)*plasticity.",
)
@click.option(
    "--link-mbps",
    default=100.0,
    show_default=True,
    type=float,
    help="Link speed in Mbit/s for the communication seconds of the efficiency E (bytes x 8 / speed).",
)
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:<index>.")
@click.option(
    "--deterministic",
    is_flag=True,
    help="Deterministic algorithms only (torch.use_deterministic_algorithms; on CUDA also cuDNN's "
    "deterministic kernels and CUBLAS_WORKSPACE_CONFIG): the same results.json twice on a GPU, slower.",
)
@click.option(
    "--cuda-graphs",
    is_flag=True,
    help="Replay each client's backbone (forward and backward) from a CUDA graph while it trains: fewer "
    "kernel launches for small models at small batches; CUDA only; with --deterministic the same results "
    "as without (fedaval/cuda_graphs.py).",
)
@click.option(
    "--precision",
    default="fp32",
    show_default=True,
    help="Local training's forward and loss: fp32, or bf16 (autocast to bfloat16: faster on GPUs with "
    "bf16 tensor cores, results not the fp32 ones; evaluation stays fp32; fedaval/training.py).",
)
@click.option(
    "--channels-last",
    is_flag=True,
    help="Keep the models' 4-D weights and the training minibatches in channels-last memory order: faster "
    "convolutions on GPUs with tensor cores; results not bit for bit the default's (fedaval/training.py).",
)
@click.option(
    "--compile",
    default="off",
    show_default=True,
    help="torch.compile each client's training forward of the backbone: off, inductor (fused generated "
    "kernels; results not bit for bit the eager ones; with --cuda-graphs only --cuda-graph-scope step) or "
    "aot_eager (the same capture run by eager kernels, for checking); fedaval/training.py.",
)
@click.option(
    "--client-streams",
    default=1,
    show_default=True,
    type=int,
    help="Issue a round's clients on this many CUDA streams, so the GPU may run several clients' kernels at "
    "once; the same results as one stream with --deterministic; CUDA and --backend local only "
    "(fedaval/cuda_streams.py).",
)
@click.option(
    "--stack-clients",
    is_flag=True,
    help="Train a round's clients in lockstep, each step of all of them one computation (torch.func.vmap): "
    "one step's kernel launches for all clients; each client's data order and random draws its own, "
    "results equal to sequential ones up to the last bits; --backend local, SGD, and only where no plugin "
    "acts inside a step (fedaval/stacked.py).",
)
@click.option(
    "--cuda-graph-scope",
    default="features",
    show_default=True,
    help="What --cuda-graphs captures: features (the backbone, forward and backward) or step (the whole "
    "training step with the SGD update: fewer launches still; only where no plugin acts inside a step).",
)
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=int,
    help="Seed of the partition, client sampling, initialisation and data order, in [0, 2**32 - 1].",
)
@click.option(
    "--seeds",
    default=None,
    metavar="S1,S2,...",
    help="Run once per seed into sibling folders OUT-s<seed>, e.g. --seeds 42,1999,2024.",
)
@click.option("--out", default=None, help="Run folder (default: runs/<time>-<plugins>-<scenario>-<dataset>-s<seed>).")
@click.option(
    "--checkpoint-every",
    default="auto",
    show_default=True,
    metavar="N|auto",
    help="Checkpoint every N rounds (and after the last); 0: never; auto: at stage ends and at most once a minute.",
)
@click.option("--keep-checkpoints", default=2, show_default=True, type=int, help="Checkpoints kept (the newest).")
@click.option(
    "--checkpoint-writer",
    default="auto",
    show_default=True,
    help="auto: after a checkpoint whose pickling kept training waiting 0.2 s or more (many live clients), "
    "the later ones are written by a forked copy of the process (Linux, CPU, --backend local); thread: "
    "always pickled in the process and written by a thread. The files are the same.",
)
@click.option(
    "--on-client-failure",
    default="drop",
    show_default=True,
    help="drop: leave a failing client out of the round's fusion; fail: stop the run.",
)
@click.option(
    "--data-path",
    default="auto",
    show_default=True,
    help="device: build minibatches from one copy of the dataset kept on --device (the same batches "
    "as loader, faster); loader: Avalanche's DataLoader; auto: device when the dataset fits.",
)
@click.option(
    "--offload-clients",
    default="auto",
    show_default=True,
    help="Where clients not sampled next round keep their state: none (live), cpu (a pickle in memory), "
    "disk (files in the run folder); auto: cpu when --clients-per-round samples fewer than all and "
    "all clients live would need more than half the free memory, else none.",
)
@click.option(
    "--host-memory",
    default="keep",
    show_default=True,
    help="keep: freed host memory stays with the process for the next tensor (glibc's mallopt), instead of "
    "being unmapped and page-faulted back every minibatch (13% less time on the CIFAR-10 cnn, "
    "docs/performance.md; resident memory stays at its peak); release: the C library's own policy. "
    "Results are the same.",
)
@click.option(
    "--backend",
    default="local",
    show_default=True,
    help="local: clients run in this process; ray: on a Ray cluster (pip install 'fedaval[ray]').",
)
@click.option(
    "--client-gpus",
    default=0.0,
    show_default=True,
    type=float,
    help="--backend ray: the share of one GPU each client's work asks for (e.g. 0.25).",
)
@click.option(
    "--ray-address", default=None, help="--backend ray: address of a running Ray cluster (default: start one)."
)
@click.option(
    "--resume",
    "resume_dir",
    default=None,
    metavar="RUN_DIR",
    help="Continue the run in RUN_DIR from its newest checkpoint (takes no other run option).",
)
@click.option(
    "--time-limit",
    default=None,
    type=float,
    metavar="SECONDS",
    help="A wall-clock limit counted from the command's start (a batch job's): the run stops between two "
    "rounds once the time left is under its longest round so far, with the last round checkpointed; "
    "--resume goes on from there. Exit status 75. With --seeds the limit covers them all.",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
def train(config_path, plugins, options, out, quiet, seeds, resume_dir, time_limit, **kwargs) -> None:
    """Train a federation and write a run folder (results.json, config.json, checkpoints/, tb/)."""
    import math
    import time

    from fedaval.plugin_manager import split_plugin_specs

    start = time.monotonic()
    if time_limit is not None and not (math.isfinite(time_limit) and time_limit > 0):
        raise FedavalUsageError(f"--time-limit {time_limit:g}: must be a number of seconds above 0")
    ctx = click.get_current_context()
    if resume_dir is not None:
        given = [
            param.opts[0]
            for param in ctx.command.params
            if param.name not in ("resume_dir", "quiet", "time_limit")
            and ctx.get_parameter_source(param.name) == click.core.ParameterSource.COMMANDLINE
        ]
        if given:
            raise FedavalUsageError(
                f"--resume takes no other run option (the run's config.json holds them); got {', '.join(given)}"
            )
        from fedaval.api import resume_training

        with sigterm_as_interrupt():
            resume_training(resume_dir, show_progress=not quiet, echo=click.echo, time_limit=limit(time_limit, start))
        return
    kwargs["plugins"] = split_plugin_specs(plugins)
    if not kwargs["plugins"] and ctx.get_parameter_source("plugins") == click.core.ParameterSource.COMMANDLINE:
        raise FedavalUsageError(
            f"--plugins {','.join(plugins)!r} names no plugin; give one or more, e.g. --plugins fedavg"
        )
    file_tables = config_file.file_options(ctx)
    file_values = ctx.default_map or {}
    for name, cli_names in (("plugins", kwargs["plugins"]), ("scenario", [kwargs["scenario"]])):
        if name in file_values and ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
            file_names = split_plugin_specs(file_values[name]) if name == "plugins" else [file_values[name]]
            file_tables, dropped = config_file.tables_for_replaced(file_tables, file_names, cli_names)
            for owner in dropped:
                click.echo(f"note: --{name} replaces the config's {owner!r}; its [options.{owner}] table is not used")
    kwargs["plugin_options"] = config_file.merge_options(file_tables, parse_assignments(options))
    kwargs["out"] = out
    from_cli = {
        name: ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE for name in ("seed", "seeds")
    }
    from fedaval.api import check_settings

    # every seed's settings and run folder are checked before the first run starts (torch not imported yet)
    runs = config_file.settings_per_seed(kwargs, seeds, from_cli["seed"], from_cli["seeds"])
    for settings in runs:
        check_settings(settings)
    from fedaval.api import run_training

    with sigterm_as_interrupt():
        command_limit = limit(time_limit, start)  # one limit for every seed's run
        for i, settings in enumerate(runs):
            try:
                run_training(settings, show_progress=not quiet, echo=click.echo, time_limit=command_limit)
            except RunStopped as exc:
                later = [str(s["seed"]) for s in runs[i + 1 :]]
                raise RunStopped(f"{exc}; not started: seed {', '.join(later)}" if later else str(exc)) from None


def limit(seconds: float | None, start: float):
    """``--time-limit`` as a :class:`fedaval.coordinator.TimeLimit` (imports torch)."""
    if seconds is None:
        return None
    from fedaval.coordinator import TimeLimit

    return TimeLimit(seconds, start)


@cli.command("plugins")
def list_plugins() -> None:
    """List installed method plugins, the hooks each implements and its options."""
    from fedaval.plugin_manager import describe, hook_names, installed_plugins

    for name, ep in sorted(installed_plugins().items()):
        try:
            obj = ep.load()
        except Exception as exc:  # a broken third-party plugin must not hide the others
            click.echo(f"{name}  (cannot be loaded: {exc})")
            continue
        click.echo(f"{name}  {describe(obj)}")
        click.echo(f"    from: {ep.value}")
        click.echo(f"    hooks: {', '.join(hook_names(obj)) or '(none)'}")
        _echo_options(name, obj)
    _list_avalanche_plugins()


def _echo_options(prefix: str, obj: type) -> None:
    """``-o <prefix>.<option>=<default>  (<type>) <help>``, a line per option of plugin class ``obj``."""
    from fedaval.options import describe_options

    for opt, typ, default, help_text in describe_options(getattr(obj, "Options", None)):
        click.echo(f"    -o {prefix}.{opt}={default}  ({typ}) {help_text}")


def _list_avalanche_plugins() -> None:
    """The ``avalanche:<Class>`` plugins checked to work federated, with
    their options (docs/methods.md says how each was checked and why the
    others are refused)."""
    from fedaval.plugin_manager import describe
    from fedaval.plugins.avalanche_bridge import CHECKED, REFUSED, avalanche_plugin_class

    for class_name in CHECKED:
        try:
            obj = avalanche_plugin_class(class_name)
        except Exception as exc:  # Avalanche missing or changed: the others still listed
            click.echo(f"avalanche:{class_name}  (cannot be loaded: {exc})")
            continue
        click.echo(f"avalanche:{class_name}  {describe(obj)}")
        _echo_options("avalanche", obj)
    click.echo(f"refused (docs/methods.md says why): {', '.join(f'avalanche:{name}' for name in sorted(REFUSED))}")


@cli.command("scenarios")
def list_scenarios() -> None:
    """List the settings and their options."""
    from fedaval.options import describe_options
    from fedaval.scenarios import SCENARIOS

    for name, spec in SCENARIOS.items():
        click.echo(f"{name}  ({spec.paper}) {spec.description}")
        for opt, typ, default, help_text in describe_options(spec.Options):
            click.echo(f"    -o {name}.{opt}={default}  ({typ}) {help_text}")


@cli.command("report")
@click.argument("run_dirs", nargs=-1, required=True, metavar="RUN_DIR...")
@click.option("--out-dir", default=".", show_default=True, help="Where report.md, report.csv and the PNG figures go.")
@click.option("--no-figures", is_flag=True, help="Only the tables.")
@click.option(
    "--include-incomplete",
    is_flag=True,
    help="Report runs that stopped before their last round, marked with their rounds (default: refuse them).",
)
@click.option(
    "--paper",
    "paper",
    default=None,
    type=click.Path(dir_okay=False, exists=True),
    help="A config with a [paper] table (configs/repro-*.toml): the paper's numbers beside the measured ones.",
)
def report(run_dirs, out_dir, no_figures, include_incomplete, paper) -> None:
    """Compare runs: a table (mean ± std over seeds) and figures."""
    from fedaval.report import write_report

    result = write_report(run_dirs, out_dir, figures=not no_figures, include_incomplete=include_incomplete, paper=paper)
    click.echo(result.table)
    click.echo("runs of each row:\n" + result.grouping)
    click.echo("wrote " + ", ".join(str(p) for p in result.files))


@cli.command("attack")
@click.argument("run_dir", metavar="RUN_DIR")
@click.option("--round", "round_", required=True, type=int, help="The round whose uploads are attacked (1-based).")
@click.option("--clients", default=None, metavar="K1,K2,...", help="Client ids to attack (default: every one sampled).")
@click.option("--images", default=None, type=int, help="Images per weight upload / classes per prototype upload (1).")
@click.option("--iterations", default=None, type=int, help="Optimisation steps per reconstruction (200).")
def attack(run_dir, round_, clients, images, iterations) -> None:
    """An honest-but-curious server reconstructs clients' images from their
    round-R uploads (replayed from the checkpoint of round R-1); prints the
    privacy block (MSE, PSNR, SSIM, FedProK's P) as JSON; grids go to
    RUN_DIR/privacy/."""
    import json

    from fedaval.attack import attack_finished_run

    try:
        ids = [int(k) for k in clients.split(",") if k.strip()] if clients else None
    except ValueError:
        raise FedavalUsageError(f"bad value --clients {clients!r}; expected comma-separated client ids") from None
    block = attack_finished_run(run_dir, round_, ids, images=images, iterations=iterations)
    click.echo(json.dumps(block, indent=2))


def main() -> None:
    cli(prog_name="fedaval")


if __name__ == "__main__":  # pragma: no cover
    main()
