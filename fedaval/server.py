"""The server: the global model, its fusion, and its evaluation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedaval.errors import PluginError, RunFailure, implementers
from fedaval.payload import Upload, check_finite, copy_into, merge_entries
from fedaval.strategy import FederatedStrategy

if TYPE_CHECKING:
    from fedaval.run import Run


class Server:
    """Holds the global model and what the next broadcast carries.

    ``test_stream[t]`` holds the test samples of the classes stage ``t``'s
    tasks bring to the federation for the first time, over all its clients
    whether sampled or not (``None`` when stage ``t`` brings none): the global
    model is tested on every class of the tasks so far, as the papers do."""

    def __init__(self, run: Run, model: nn.Module, task_classes: list[list[int]]):
        from fedaval.evaluation import PredictionRecorder, make_evaluator
        from fedaval.streams import make_test_stream

        self.run = run
        self.model = model
        self.shared_keys: list[str] = list(run.hook.fedaval_shared_keys(run=run, model=model))
        self.extras: dict[str, Any] = {}
        self.test_stream = make_test_stream(run.data, task_classes)
        self.tasks_started: list[int] = []
        self.predictions = PredictionRecorder()
        self.strategy = FederatedStrategy(
            run=run,
            client=None,
            model=model,
            optimizer=torch.optim.SGD(
                model.parameters(), lr=0.0
            ),  # never steps: the server model is fused, not trained
            eval_mb_size=256,
            device=run.device,
            plugins=[self.predictions],
            evaluator=make_evaluator(run, "global"),
            eval_every=-1,
        )
        self.model.to(run.device)

    def global_weights(self) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        return {key: state[key] for key in self.shared_keys}

    def download(self) -> dict[str, Any]:
        """The broadcast every sampled client receives: the shared weights and
        whatever the plugins' ``fedaval_server_fuse`` returned last round."""
        return {"weights": self.global_weights(), **self.extras}

    def begin_task(self, task: int) -> None:
        """Announce stage ``task`` to the global evaluator.

        Avalanche's forgetting and BWT metrics learn which experience is the
        current one from ``before_training_exp``; the global model is never
        trained by an Avalanche strategy, so the server announces it."""
        self.tasks_started.append(task)
        # A stage that brings no new class has no test experience, yet it is the current one now:
        # the metrics are told its id all the same, or the previous stage's experience would stay
        # "current" and its reference accuracy for forgetting be overwritten by later evaluations.
        experience = self.test_stream[task] or StageWithoutTestData(task)
        self.strategy.experience = experience
        self.strategy.evaluator.before_training_exp(self.strategy)
        self.strategy.experience = None

    def fuse(self, uploads: list[Upload], round: int) -> None:
        """Weights first (``fedaval_server_fuse_weights``), then everything else."""
        hook = self.run.hook
        if uploads:
            new = hook.fedaval_server_fuse_weights(run=self.run, uploads=uploads, global_weights=self.global_weights())
            if new:
                try:
                    check_finite(new, "fused weights")
                except FloatingPointError as exc:  # the global model never becomes non-finite
                    raise RunFailure(
                        f"round {round}: {exc}; the global model keeps the previous round's weights"
                    ) from exc
                state = self.model.state_dict()
                check_fused(self.run, new, state)
                copy_into([state[key] for key in new], list(new.values()))
        self.extras = merge_entries(
            hook.fedaval_server_fuse(run=self.run, uploads=uploads, round=round),
            "download",
            self.run.pm,
            "fedaval_server_fuse",
        )
        if "weights" in self.extras:
            raise PluginError(
                "fedaval_server_fuse may not return 'weights'; implement fedaval_server_fuse_weights "
                f"(fedaval_server_fuse is implemented by {implementers(self.run.pm, 'fedaval_server_fuse')})"
            )

    def evaluate(self) -> dict[str, Any]:
        exps = [self.test_stream[t] for t in self.tasks_started if self.test_stream[t] is not None]
        return self.strategy.eval(exps) if exps else {}


class StageWithoutTestData:
    """What the global evaluator is told is the current experience at a stage
    that brings no class new to the federation (:meth:`Server.begin_task`):
    its id, and itself as its logging view."""

    def __init__(self, task: int):
        self.current_experience = task

    def logging(self) -> StageWithoutTestData:
        return self


def check_fused(run: Run, new: dict[str, Any], state: dict[str, Any]) -> None:
    """A :class:`~fedaval.errors.PluginError` for fused weights the global
    model has no key for, or of another shape: copied in, a one-element
    tensor would be broadcast over a whole weight, silently."""

    for key, value in new.items():
        known = state.get(key)
        shape = tuple(getattr(value, "shape", ()))
        if known is None or not isinstance(value, torch.Tensor) or shape != tuple(known.shape):
            expected = "no such key" if known is None else f"the global model's is {tuple(known.shape)}"
            raise PluginError(
                f"fedaval_server_fuse_weights returned {key!r} as {type(value).__name__} {shape}; {expected} "
                f"(implemented by {implementers(run.pm, 'fedaval_server_fuse_weights')})"
            )
