"""Avalanche's own continual-learning plugins, attached to every client.

Each client gets one fresh instance of an Avalanche training plugin (through
``fedaval_client_avalanche_plugins``), next to FedAvg's averaging. Because
:class:`fedaval.strategy.FederatedStrategy` runs Avalanche's
``before_training_exp`` only in a client's first round of a task and
``after_training_exp`` only in its last, each plugin sees one experience per
*task*, exactly as in centralised continual learning:

* **FedEWC** (``EWCPlugin``): importances and the anchor weights are computed
  once per task, at the client's last round of the task, on the client's
  *local* model before it uploads (the reading chosen: Avalanche's plugin
  unchanged but for how its penalty is added up, in a few batched operations:
  :mod:`fedaval.plugins.ewc_penalty`), keyed by the client's own experience
  counter (tasks it trained).
* **FedLwF** (``LwFPlugin``): the teacher is snapshotted once per task, same
  moment: the client's local model at the end of its last round of the task
  (Avalanche's plugin, the old classes' outputs picked with an index kept on
  the device: :mod:`fedaval.plugins.lwf_distillation`).
* **FedReplay** (``ReplayPlugin``): *random* experience replay, not FediCaRL
  (no herding selection, no nearest-mean-of-exemplars classifier, no
  distillation; FediCaRL proper comes with the FCIL baselines). The memory
  (``mem_size``, 500 by default, the size of FedProK's FediCaRL baseline) is
  filled with random samples balanced over tasks (Avalanche's
  ``ExperienceBalancedBuffer``) and updated once per task; its
  ``ReplayDataLoader`` is built at the task's first round and kept by the core
  for every later round of the task.

Other Avalanche training plugins take the generic path::

    fedaval train --plugins avalanche:MASPlugin -o avalanche.lambda_reg=2

``avalanche:ClassName`` is resolved by :func:`avalanche_plugin_class` (see
``SPEC_FACTORIES`` in :mod:`fedaval.plugin_manager`): the class is looked up
in ``avalanche.training.plugins`` and its constructor's keyword arguments
become the options of a plugin named ``avalanche``, typed from the
constructor's annotations or defaults. Arguments that cannot be given on a
command line (objects, lists) keep their defaults. Not every class works
federated: those checked to (:data:`CHECKED`) run, five of them as fedaval's
subclasses (:data:`VARIANTS`); those that cannot (:data:`REFUSED`: no
validation stream, a model of another kind, an object argument...) are a
one-line error at load saying what fedaval lacks; any other (a newer
Avalanche's) runs with a warning.

Nothing here imports torch or Avalanche at import time (``fedaval plugins``).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from typing import Any, ClassVar, Literal, Optional, Union

from fedaval import hookimpl
from fedaval.errors import FedavalUsageError, one_line
from fedaval.options import CHECK_TEXT, at_least_one, non_negative, option, positive, unit_interval
from fedaval.plugin import Plugin
from fedaval.stash import StashKey

AVALANCHE_PLUGINS_MODULE = "avalanche.training.plugins"


class AvalancheBridge(Plugin):
    """Attach one fresh ``avalanche_class`` instance to every client.

    Subclasses set ``avalanche_class`` (a name in ``avalanche.training.plugins``)
    and may override :meth:`avalanche_kwargs` (default: every option, by name).
    :meth:`instance` is a client's Avalanche plugin (kept in ``client.stash``)."""

    avalanche_class: ClassVar[str] = ""

    @property
    def stash_key(self) -> StashKey[Any]:
        return StashKey(f"{self.name}.{self.avalanche_class}")

    def instance(self, client) -> Any:
        """``client``'s instance of the Avalanche plugin."""
        return client.stash[self.stash_key]

    def avalanche_kwargs(self) -> dict[str, Any]:
        return dataclasses.asdict(self.options) if self.options is not None else {}

    def plugin_class(self) -> type:
        """The class each client gets an instance of: ``avalanche_class``."""
        return load_avalanche_class(self.avalanche_class)

    @hookimpl
    def fedaval_client_avalanche_plugins(self, run, client):
        cls = self.plugin_class()
        plugin = cls(**self.avalanche_kwargs())
        client.stash[self.stash_key] = plugin
        return [plugin]


# ---------------------------------------------------------------------------
# the three named hybrids
# ---------------------------------------------------------------------------


class FedEWC(AvalancheBridge):
    """FedAvg + Avalanche's EWCPlugin on every client, its penalty computed
    with batched operations (:class:`fedaval.plugins.ewc_penalty.FusedEWCPlugin`:
    the same sum, far fewer kernel launches a minibatch)."""

    name = "fedewc"
    description = "FedEWC: FedAvg + Avalanche's EWC on every client (importances once per task)"
    avalanche_class = "EWCPlugin"

    def plugin_class(self) -> type:
        from fedaval.plugins.ewc_penalty import FusedEWCPlugin

        return FusedEWCPlugin

    @dataclasses.dataclass
    class Options:
        ewc_lambda: float = option(1.0, "weight of the EWC penalty", non_negative)
        mode: Literal["separate", "online"] = option("separate", "one penalty per past task, or one decayed penalty")
        decay_factor: float | None = option(
            None,
            "importance decay in [0, 1], required by mode=online",
            lambda v: None if v is None else unit_interval(v),
        )

    def __init__(self, options: Any = None):
        super().__init__(options)
        online = self.options.mode == "online"
        if online != (self.options.decay_factor is not None):
            raise FedavalUsageError(
                f"bad value fedewc.decay_factor={self.options.decay_factor!r}; set it exactly when fedewc.mode=online"
            )


class FedLwF(AvalancheBridge):
    """FedAvg + Avalanche's LwFPlugin on every client, its old classes'
    outputs picked with an index kept on the device
    (:class:`fedaval.plugins.lwf_distillation.DeviceIndexLwFPlugin`: the same
    values, no wait for a GPU a minibatch)."""

    name = "fedlwf"
    description = "FedLwF: FedAvg + Avalanche's LwF distillation on every client (teacher once per task)"
    avalanche_class = "LwFPlugin"

    def plugin_class(self) -> type:
        from fedaval.plugins.lwf_distillation import DeviceIndexLwFPlugin

        return DeviceIndexLwFPlugin

    @dataclasses.dataclass
    class Options:
        alpha: float = option(1.0, "weight of the distillation loss", non_negative)
        temperature: float = option(2.0, "softmax temperature", positive)


class FedReplay(AvalancheBridge):
    """FedAvg + random experience replay (Avalanche's ReplayPlugin, a fixed
    memory per client) on every client; not FediCaRL."""

    name = "fedreplay"
    description = "FedReplay: FedAvg + random experience replay (Avalanche ReplayPlugin, 500 per client); not FediCaRL"
    avalanche_class = "ReplayPlugin"

    @dataclasses.dataclass
    class Options:
        mem_size: int = option(500, "exemplars kept per client (FedProK's paper: 500)", positive)
        batch_size_mem: int | None = option(
            None, "memory minibatch size (None: Avalanche's default)", lambda v: None if v is None else at_least_one(v)
        )
        task_balanced_dataloader: bool = option(False, "balance memory minibatches over past tasks")


# ---------------------------------------------------------------------------
# the generic path: avalanche:ClassName
# ---------------------------------------------------------------------------

CHECKED: tuple[str, ...] = (
    "AGEMPlugin",
    "EWCPlugin",
    "FromScratchTrainingPlugin",
    "GDumbPlugin",
    "GEMPlugin",
    "LwFPlugin",
    "MASPlugin",
    "MIRPlugin",
    "RARPlugin",
    "RWalkPlugin",
    "ReplayPlugin",
    "SynapticIntelligencePlugin",
)
"""The classes of Avalanche 0.6.0 checked to work federated: each changes a
run's results, resumes from a checkpoint to the uninterrupted run's results,
and gives the same results offloaded (docs/methods.md, the generic path, says
how each was checked). A class in neither this list nor :data:`REFUSED` (a
newer Avalanche's) runs with a warning."""

_NEEDS_EVAL_CLASSIFIER = (
    "it needs a model with an eval_classifier (NCMClassifier or FeCAMClassifier); fedaval's have none"
)

REFUSED: dict[str, str] = {
    "BiCPlugin": "it replaces its experiences' datasets, which fedaval's training experiences do not allow",
    "CoPEPlugin": (
        "it replaces the model's classifier, which renames the shared weights, and its loss, "
        "which fedaval's client criterion overrides"
    ),
    "CWRStarPlugin": "it needs the model object as a constructor argument, which a command line cannot give",
    "CurrentDataFeCAMUpdate": _NEEDS_EVAL_CLASSIFIER,
    "CurrentDataNCMUpdate": _NEEDS_EVAL_CLASSIFIER,
    "EarlyStoppingPlugin": (
        "fedaval has no validation stream (it would stop on test accuracy and upload an earlier round's weights)"
    ),
    "FeCAMOracle": _NEEDS_EVAL_CLASSIFIER,
    "FeatureDistillationPlugin": (
        "it needs Avalanche's FeatureExtractorModel (it sets model.features, fedaval's backbone, to None)"
    ),
    "GSS_greedyPlugin": "its input_size is a list, which a command line cannot give",
    "GenerativeReplayPlugin": "it needs a generator strategy object, which a command line cannot give",
    "LFLPlugin": "it needs an avalanche.models.BaseModel (get_features); fedaval's models are not",
    "LRSchedulerPlugin": "fedaval sets every round's learning rate; use --lr-schedule",
    "MemoryFeCAMUpdate": _NEEDS_EVAL_CLASSIFIER,
    "MemoryNCMUpdate": _NEEDS_EVAL_CLASSIFIER,
    "NCMOracle": _NEEDS_EVAL_CLASSIFIER,
    "TrainGeneratorAfterExpPlugin": (
        "it only trains a GenerativeReplayPlugin's generator, which fedaval cannot run (one generic plugin per run)"
    ),
}
"""Classes that cannot work in fedaval, with what fedaval lacks for them:
``--plugins avalanche:<one of these>`` is a one-line error at load."""

VARIANTS: dict[str, str] = {
    "AGEMPlugin": "fedaval.plugins.avalanche_fixes:RoundAGEMPlugin",
    "MIRPlugin": "fedaval.plugins.avalanche_fixes:RoundMIRPlugin",
    "RARPlugin": "fedaval.plugins.avalanche_fixes:RoundRARPlugin",
    "RWalkPlugin": "fedaval.plugins.avalanche_fixes:FiniteRWalkPlugin",
    "SynapticIntelligencePlugin": "fedaval.plugins.avalanche_fixes:CopyingSynapticIntelligencePlugin",
}
"""Classes each client gets fedaval's subclass of instead
(:mod:`fedaval.plugins.avalanche_fixes` says why): Avalanche's plugin with
what a federated run, or Avalanche's own bug, needs changed."""


def available_avalanche_plugins() -> list[str]:
    """Training plugin classes in ``avalanche.training.plugins`` (the evaluator excluded)."""
    import importlib

    from avalanche.core import BasePlugin

    module = importlib.import_module(AVALANCHE_PLUGINS_MODULE)
    return sorted(
        name
        for name, obj in vars(module).items()
        if inspect.isclass(obj)
        and issubclass(obj, BasePlugin)
        and name != "EvaluationPlugin"
        and obj.__module__.startswith("avalanche.training.plugins")
        and not name.startswith("_")
    )


def usable_avalanche_plugins() -> list[str]:
    """The classes ``avalanche:<name>`` accepts: every training plugin but the :data:`REFUSED`."""
    return [name for name in available_avalanche_plugins() if name not in REFUSED]


def load_avalanche_class(class_name: str) -> type:
    """The class ``class_name`` of ``avalanche.training.plugins``, or a one-line
    error for an unknown or a :data:`REFUSED` class."""
    import importlib

    if class_name in REFUSED:
        raise FedavalUsageError(f"avalanche:{class_name} cannot run in fedaval: {REFUSED[class_name]}")
    module = importlib.import_module(AVALANCHE_PLUGINS_MODULE)
    if class_name not in available_avalanche_plugins():
        raise FedavalUsageError(
            f"unknown Avalanche plugin {class_name!r}; allowed: {', '.join(usable_avalanche_plugins())}"
        )
    return getattr(module, class_name)


def variant_class(class_name: str) -> type:
    """The class a client gets for ``avalanche:<class_name>``: fedaval's
    subclass from :data:`VARIANTS`, else Avalanche's class."""
    if class_name not in VARIANTS:
        return load_avalanche_class(class_name)
    import importlib

    module_name, _, attr = VARIANTS[class_name].partition(":")
    return getattr(importlib.import_module(module_name), attr)


_SCALARS = (bool, int, float, str)
_NUMBER = Union[int, float]

NUMERIC_NAMES = frozenset({"ewc_lambda", "decay_factor", "lambda_e", "si_lambda", "alpha", "temperature"})
"""Unannotated constructor arguments without a usable default that are
numbers (``EWCPlugin(ewc_lambda, decay_factor=None)``); any other such
argument is taken for an object (a model, a scheduler), which a command line
cannot give."""


def is_count(name: str) -> bool:
    """Whether an argument named ``name`` is a size or a count of samples
    (``mem_size``, ``batch_size_mem``, ``patterns_per_experience``): an
    int, at least 1."""
    return name.endswith("_size") or name.startswith("batch_size") or name in ("patterns_per_experience", "subsample")


class _Required:
    """Default of a constructor argument that has none: must be given."""

    def __repr__(self) -> str:
        return "(required)"


REQUIRED = _Required()


def _required_check(value: Any) -> str | None:
    return "required by the Avalanche plugin's constructor" if value is REQUIRED else None


def _count_check(value: Any) -> str | None:
    if value is REQUIRED:
        return _required_check(value)
    return None if value is None else at_least_one(value)


CHECK_TEXT[_count_check] = ">= 1"  # what `fedaval plugins` shows beside a count


def option_type(parameter: inspect.Parameter) -> Any | None:
    """The option type of one constructor argument, or ``None`` when it cannot
    be given on a command line (an object, a list).

    From the annotation when it is a scalar type (``int``, ``Optional[float]``,
    ``Literal[...]``); else from the default's type, an int default read as
    "a number" (``LwFPlugin(alpha=1)`` means a float) unless the name is a
    count (:func:`is_count`); else (no annotation, no usable default) a
    number for the names of :data:`NUMERIC_NAMES` (``ewc_lambda``), a string
    for names ending in ``_name`` (``cwr_layer_name``), and nothing settable
    otherwise (an object). A required argument is never ``None``: ``-o
    avalanche.ewc_lambda=none`` is refused."""
    annotation = parameter.annotation
    if isinstance(annotation, str):
        annotation = {"int": int, "float": float, "bool": bool, "str": str}.get(annotation, inspect.Parameter.empty)
    origin = typing.get_origin(annotation)
    required = parameter.default is inspect.Parameter.empty
    if annotation in _SCALARS or origin is Literal:
        return annotation
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(annotation)
        scalars = [a for a in args if a in _SCALARS]
        if scalars and all(a in _SCALARS or a is type(None) for a in args):
            return Union[tuple(scalars)] if required else annotation
        if scalars:  # Union[float, Sequence[float]]: the scalar part
            scalar = Union[tuple(scalars)] if len(scalars) > 1 else scalars[0]
            return scalar if required else Optional[scalar]
    default = parameter.default
    if required or default is None:
        if annotation is not inspect.Parameter.empty:
            return None  # Optional[SomeObject], Optional[Sequence[str]]: not for a command line
        if parameter.name in NUMERIC_NAMES:
            return _NUMBER if required else Optional[_NUMBER]
        if parameter.name.endswith("_name"):
            return str if required else Optional[str]
        return None
    if type(default) is int and annotation is inspect.Parameter.empty and not is_count(parameter.name):
        return _NUMBER
    if type(default) in _SCALARS:
        return type(default)
    return None


def constructor_options(cls: type) -> type:
    """A dataclass of the keyword arguments of ``cls.__init__`` that a command
    line can set, with their defaults (``REQUIRED`` where there is none).
    Counts (:func:`is_count`) must be at least 1. A required argument that a
    command line cannot set (an object) is a one-line error: the class cannot
    be built here."""
    fields = []
    for name, parameter in inspect.signature(cls.__init__).parameters.items():  # type: ignore[misc]
        if name == "self" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        tp = option_type(parameter)
        required = parameter.default is inspect.Parameter.empty
        if tp is None:
            if required:
                raise FedavalUsageError(
                    f"avalanche:{cls.__name__} cannot run in fedaval: its constructor needs {name!r}, "
                    "an object a command line cannot give"
                )
            continue
        check = _count_check if is_count(name) and tp in (int, Optional[int]) else _required_check
        fields.append(
            (
                name,
                tp,
                dataclasses.field(
                    default=REQUIRED if required else parameter.default,
                    metadata={"help": f"{cls.__name__}({name}=...)", "check": check},
                ),
            )
        )
    return dataclasses.make_dataclass(f"{cls.__name__}Options", fields)


class GenericBridge(AvalancheBridge):
    """``avalanche:<avalanche_class>``: the class (or its fedaval variant,
    :data:`VARIANTS`) on every client, its options the constructor's
    arguments. One instance is built when the plugin is loaded, so what the
    constructor refuses (``EWCPlugin(mode="foo")``) is a one-line error before
    the run starts, and a class that fedaval has not checked
    (:data:`CHECKED`) is named in a warning."""

    def __init__(self, options: Any = None):
        super().__init__(options)
        kwargs = self.avalanche_kwargs()
        try:
            self.plugin_class()(**kwargs)
        except (AssertionError, ValueError, TypeError) as exc:
            defaults = type(self.options)()
            given = [f"{k}={v!r}" for k, v in kwargs.items() if v != getattr(defaults, k)]
            raise FedavalUsageError(
                f"avalanche:{self.avalanche_class} refuses its options ({', '.join(given) or 'the defaults'}): "
                f"{one_line(exc)}"
            ) from None
        if self.avalanche_class not in CHECKED:
            import logging

            logging.getLogger("fedaval").warning(
                "avalanche:%s has not been checked under federation (checked: %s); check its results",
                self.avalanche_class,
                ", ".join(CHECKED),
            )

    def plugin_class(self) -> type:
        return variant_class(self.avalanche_class)


def avalanche_plugin_class(class_name: str) -> type:
    """A fedaval plugin class (named ``avalanche``) attaching a fresh
    ``avalanche.training.plugins.<class_name>`` to every client, its options
    being the constructor's keyword arguments. Used for ``--plugins
    avalanche:<class_name>``; a :data:`REFUSED` class is a one-line error."""
    cls = load_avalanche_class(class_name)
    return type(
        f"Avalanche{class_name}",
        (GenericBridge,),
        {
            "name": "avalanche",
            "description": f"Avalanche's {class_name} on every client (generic bridge)",
            "avalanche_class": class_name,
            "Options": constructor_options(cls),
            "__module__": __name__,
        },
    )
