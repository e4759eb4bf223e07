"""Open registries: the scenarios, datasets and models a run can name.

Built-ins and third-party additions take one path: a plugin implements
``fedaval_register_scenarios``, ``fedaval_register_datasets`` or
``fedaval_register_models`` and calls the ``register`` callback it is given
(llm's ``register_models(register)``). The core plugin registers the built-ins
this way. :func:`collect` builds a run's registry once its plugins are loaded;
a name registered twice is a one-line error naming both plugins.

What is registered:

* a scenario: a :class:`fedaval.scenarios.ScenarioSpec` under its ``name``;
* a dataset: ``name -> loader(root: Path | None, download: bool) -> ImageData``;
* a model: ``name -> factory(input_shape, num_classes) -> nn.Module`` (a
  :class:`fedaval.models.SplitModel`, or a model :func:`fedaval.models.split_model`
  can split).
"""

from __future__ import annotations

from typing import Any

import pluggy

from fedaval.errors import FedavalUsageError, choice_error

KINDS = ("scenarios", "datasets", "models")


def collect(pm: pluggy.PluginManager, kind: str) -> dict[str, Any]:
    """``name -> thing`` from every plugin's ``fedaval_register_<kind>``, in
    registration order. Each implementation is called on its own so that a
    name registered twice can be blamed on both plugins."""
    caller = getattr(pm.hook, f"fedaval_register_{kind}")
    found: dict[str, Any] = {}
    owners: dict[str, str] = {}
    for impl in caller.get_hookimpls():  # in registration order
        added: list[tuple[str, Any]] = []
        impl.function(lambda name, thing: added.append((name, thing)))  # noqa: B023 - called at once
        for name, thing in added:
            if name in found:
                raise FedavalUsageError(
                    f"{kind[:-1]} {name!r} is registered by both plugin {owners[name]!r} and plugin {impl.plugin_name!r}"
                )
            found[name] = thing
            owners[name] = impl.plugin_name
    return found


def lookup(registry: dict[str, Any], kind: str, name: str, extra: tuple[str, ...] = ()) -> Any:
    """``registry[name]``, or the standard one-line 'unknown ...' error listing what is allowed."""
    if name not in registry:
        raise choice_error(kind, name, list(extra) + sorted(registry))
    return registry[name]
