"""The ``fedaval`` command. Thin: it parses, then calls the library.

``fedaval --help``, ``fedaval plugins`` and ``fedaval scenarios`` do not
import torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from fedaval.errors import FedavalUsageError


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


class FedavalGroup(click.Group):
    """Prints a :class:`FedavalUsageError` as one line and exits with status 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except FedavalUsageError as exc:
            click.echo(f"fedaval: error: {exc}", err=True)
            ctx.exit(2)


@click.group(cls=FedavalGroup)
@click.version_option(package_name="fedaval")
def cli() -> None:
    """Federated continual learning on Avalanche. Methods are plugins."""


@cli.command()
@click.option("--plugins", "-p", "plugins", multiple=True, default=("fedavg",), show_default=True,
              help="Method plugins by name or package.module:Class; repeat or comma-separate.")
@click.option("--option", "-o", "options", multiple=True, metavar="NAME.KEY=VALUE",
              help="A plugin's or the scenario's option, e.g. -o gldp.lam=0.5 -o sthfl.clients=20.")
@click.option("--scenario", default="fcil-sync", show_default=True, help="Setting; see `fedaval scenarios`.")
@click.option("--dataset", default="digits", show_default=True,
              help="digits, mnist, fashion-mnist, cifar10, cifar100, tiny-imagenet or imagefolder.")
@click.option("--data-root", default=None, help="Folder holding the dataset (torchvision layout, or train/ and test/).")
@click.option("--download", is_flag=True, help="Download a torchvision dataset into --data-root if missing.")
@click.option("--model", default="auto", show_default=True, help="auto, mlp, cnn or resnet18.")
@click.option("--rounds-per-task", default=3, show_default=True, type=int, help="Federated rounds per task.")
@click.option("--local-epochs", default=1, show_default=True, type=int, help="Local epochs per round.")
@click.option("--clients-per-round", default=0, show_default=True, type=int, help="Clients sampled per round (0: all).")
@click.option("--batch-size", default=32, show_default=True, type=int)
@click.option("--lr", default=0.01, show_default=True, type=float)
@click.option("--momentum", default=0.0, show_default=True, type=float)
@click.option("--weight-decay", default=1e-4, show_default=True, type=float)
@click.option("--eval-every", default=1, show_default=True, type=int,
              help="Evaluate every N rounds (and always at the end of each task).")
@click.option("--utility-lambda", default=0.5, show_default=True, type=float,
              help="lambda of the continual utility U = lambda*stability + (1-lambda)*plasticity.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:<index>.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--out", default=None, help="Run folder (default: runs/<time>-<plugins>-<scenario>-<dataset>-s<seed>).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def train(plugins, options, out, quiet, **kwargs) -> None:
    """Train a federation and write a run folder (results.json, config.json, tb/)."""
    from fedaval.plugin_manager import split_plugin_specs

    kwargs["plugins"] = split_plugin_specs(plugins)
    kwargs["plugin_options"] = parse_assignments(options)
    kwargs["out"] = out
    from fedaval.api import run_training

    run_training(kwargs, show_progress=not quiet, echo=click.echo)


@cli.command("plugins")
def list_plugins() -> None:
    """List installed method plugins, the hooks each implements and its options."""
    from fedaval.options import describe_options
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
        for opt, typ, default, help_text in describe_options(getattr(obj, "Options", None)):
            click.echo(f"    -o {name}.{opt}={default}  ({typ}) {help_text}")


@cli.command("scenarios")
def list_scenarios() -> None:
    """List the settings and their options."""
    from fedaval.options import describe_options
    from fedaval.scenarios import SCENARIOS

    for name, spec in SCENARIOS.items():
        click.echo(f"{name}  ({spec.paper}) {spec.description}")
        for opt, typ, default, help_text in describe_options(spec.Options):
            click.echo(f"    -o {name}.{opt}={default}  ({typ}) {help_text}")


def main() -> None:
    cli(prog_name="fedaval")


if __name__ == "__main__":  # pragma: no cover
    main()
