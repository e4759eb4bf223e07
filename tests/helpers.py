"""Helpers shared by test modules (import as ``from helpers import ...``)."""

from __future__ import annotations

import os

from fedaval import hookimpl

# The device of the tests' tiny runs: the CPU, or FEDAVAL_TEST_DEVICE (e.g.
# ``cuda``) to run the suite's runs on a GPU (docs/performance.md, "On a GPU"),
# with deterministic algorithms there, since tests compare runs for equality.
TEST_DEVICE = os.environ.get("FEDAVAL_TEST_DEVICE", "cpu")


def strip_timing(obj):
    """results.json without wall-clock figures (``seconds*``, ``efficiency*``)
    and the run folder: what two
    runs with the same seed must agree on."""
    if isinstance(obj, dict):
        return {
            k: strip_timing(v) for k, v in obj.items() if not k.startswith(("seconds", "efficiency")) and k != "out"
        }
    if isinstance(obj, list):
        return [strip_timing(v) for v in obj]
    return obj


# options of the Avalanche plugins that keep iterators over their memories between rounds, for tiny runs
AGEM = {"patterns_per_experience": "20", "sample_size": "20"}
MIR = {"batch_size_mem": "10", "mem_size": "40", "subsample": "20"}
RAR = {"batch_size_mem": "10", "mem_size": "40", "use_adversarial_replay": "false"}  # its attack: slow, not at issue


def tiny_run_config(out, **overrides):
    """A RunConfig for a fast digits run into ``out`` (2 clients, 2 tasks, 2
    rounds each): what the ``tiny_config`` fixture makes, for module-scoped use."""
    from fedaval.config import RunConfig

    settings = dict(
        dataset="digits",
        scenario="fcil-sync",
        scenario_options={"clients": 2, "tasks": 2},
        rounds_per_task=2,
        local_epochs=1,
        lr=0.01,
        momentum=0.0,
        batch_size=32,
        device=TEST_DEVICE,
        deterministic=TEST_DEVICE != "cpu",
        seed=0,
        out=str(out),
        checkpoint_every=1,  # resume tests stop and resume at chosen rounds; `auto` has its own tests
    )
    settings.update(overrides)
    return RunConfig(**settings)


def one_line_error(args, code=2):
    """Run ``fedaval ARGS``; check it exits with ``code`` printing one line; return the line."""
    from click.testing import CliRunner

    from fedaval.cli import cli

    result = CliRunner().invoke(cli, args)
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


class Raises:
    """A plugin whose client 1 raises in its local training of round 2."""

    name = "raises"

    @hookimpl
    def fedaval_client_epoch_start(self, run, client, epoch):
        if client.id == 1 and run.round == 2:
            raise RuntimeError("disk full on client 1")


class FakeStream:
    """A CUDA stream stood in on the CPU: named, and logging its waits as ``("wait", waiter, waited)``."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait", self.name, other.name))

    def __repr__(self) -> str:
        return self.name


def stand_in_cuda_streams(monkeypatch) -> tuple[list, list]:
    """torch.cuda's stream calls stood in: ``torch.cuda.Stream()`` makes :class:`FakeStream` s0, s1, ...,
    ``torch.cuda.stream(s)`` makes ``s`` current, ``torch.cuda.current_stream()`` returns it (``default``
    outside). Returns the log of waits and the stack of current streams (``current[-1]``)."""
    from contextlib import contextmanager

    import torch

    log: list = []
    current = [FakeStream(log, "default")]
    made = iter(range(1000))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(log, f"s{next(made)}"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])

    @contextmanager
    def on(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "stream", on)
    return log, current


class StandInCapture:
    """Stands in for a CUDA graph capture (``fedaval.cuda_graphs.cuda_capture``,
    ``fedaval.stacked.capture``) on the CPU. As a real capture, it leaves
    the tensors that ``kept()`` lists and the random stream as they were
    (it runs the step once, for its outputs' tensors, then puts them back);
    a "replay" runs the step eagerly and copies its outputs into the same
    static tensors every time."""

    def __init__(self, kept=None):
        self.kept = kept or (lambda: [])
        self.captures = 0
        self.replays = 0

    def __call__(self, step):
        import torch

        tensors = self.kept()
        saved = [t.detach().clone() for t in tensors]
        rng = torch.get_rng_state()
        statics = tuple(out.detach().clone() for out in step())
        with torch.no_grad():
            for t, value in zip(tensors, saved):
                t.copy_(value)
        torch.set_rng_state(rng)
        self.captures += 1

        def replay():
            self.replays += 1
            outputs = step()
            with torch.no_grad():
                for static, out in zip(statics, outputs):
                    static.copy_(out)

        return replay, statics
