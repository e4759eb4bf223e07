"""Finding, loading and registering plugins.

Built-in methods and third-party ones take one path: an entry point in the
``fedaval.plugins`` group (``--plugins gldp``), or an import path
(``--plugins mypkg.mymethod:Plugin``). A third form, ``prefix:argument``,
builds a plugin class from an argument through a factory of
:data:`SPEC_FACTORIES` (``--plugins avalanche:MASPlugin``). A plugin manager is made per run by
:func:`get_plugin_manager`; nothing is registered at import time.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any

import pluggy

from fedaval import ENTRY_POINT_GROUP, PROJECT_NAME, hookspecs
from fedaval.errors import FedavalUsageError, choice_error
from fedaval.options import build_options
from fedaval.plugin import CORE_LOSS_TERMS

DEFAULT_PLUGINS = ("fedavg",)
"""Registered in every run, whatever ``--plugins`` says. Their hooks are
``trylast`` defaults that a method overrides."""


SPEC_FACTORIES = {"avalanche": "fedaval.plugins.avalanche_bridge:avalanche_plugin_class"}
"""Spec prefixes that make a plugin class from an argument: ``avalanche:X``
calls ``avalanche_plugin_class("X")``, which wraps Avalanche's training
plugin ``X`` (one instance per client). Checked before the
``package.module:Attribute`` form; the class's ``name`` is its option prefix."""


def get_plugin_manager() -> pluggy.PluginManager:
    """A fresh plugin manager with fedaval's hook specs and nothing registered."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def installed_plugins() -> dict[str, Any]:
    """Entry points of group ``fedaval.plugins`` by name (nothing imported)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def split_plugin_specs(values: tuple[str, ...] | list[str]) -> list[str]:
    """``("gldp,fedprox", "x")`` -> ``["gldp", "fedprox", "x"]``, order kept, no duplicates."""
    names: list[str] = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if part and part not in names:
                names.append(part)
    return names


def resolve_plugin(spec: str) -> tuple[str, Any]:
    """Find the plugin class (or module) that ``spec`` names.

    ``spec`` is an entry-point name, ``prefix:argument`` with a prefix of
    :data:`SPEC_FACTORIES`, or ``package.module:Attribute``. Returns
    ``(name, object)``; the name is the one users prefix options with."""
    prefix, _, argument = spec.partition(":")
    if argument and prefix in SPEC_FACTORIES:
        factory_module, _, factory_name = SPEC_FACTORIES[prefix].partition(":")
        obj = getattr(importlib.import_module(factory_module), factory_name)(argument)
        return plugin_name(obj, default=prefix), obj
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise FedavalUsageError(f"cannot import plugin module {module_name!r} from {spec!r}: {exc}") from None
        try:
            obj = getattr(module, attr)
        except AttributeError:
            raise FedavalUsageError(f"plugin {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
        name = plugin_name(obj, default=attr.lower())
        taken = installed_plugins().get(name)
        if taken is not None and taken.value != spec and not _variant_of(obj, taken.load()):
            raise FedavalUsageError(
                f"plugin {spec!r} calls itself {name!r}, the name of the installed plugin {taken.value}; "
                "give it another name (results and options would be filed under the other's), or subclass it"
            )
        return name, obj
    installed = installed_plugins()
    if spec not in installed:
        raise choice_error(
            "plugin", spec, sorted(installed) + [f"{p}:<name>" for p in SPEC_FACTORIES] + ["package.module:Class"]
        )
    return spec, installed[spec].load()


def _variant_of(obj: Any, installed: Any) -> bool:
    """``obj`` is the installed plugin, or a subclass of it (a variant that
    keeps its name and options on purpose, as a test's probe of GLFC does)."""
    return obj is installed or (inspect.isclass(obj) and inspect.isclass(installed) and issubclass(obj, installed))


def plugin_name(obj: Any, default: str) -> str:
    """A plugin's option prefix: its ``name`` attribute, else ``default``."""
    return getattr(obj, "name", None) or default


def instantiate(name: str, obj: Any, option_values: dict[str, Any]) -> Any:
    """Make the object to register: a class is instantiated with its validated
    ``Options`` (if it declares any); a module is registered as it is."""
    if isinstance(obj, ModuleType):
        if option_values:
            raise FedavalUsageError(f"plugin {name!r} takes no options; got {', '.join(option_values)}")
        return obj
    if inspect.isclass(obj):
        options_cls = getattr(obj, "Options", None)
        if options_cls is None:
            if option_values:
                raise FedavalUsageError(f"plugin {name!r} takes no options; got {', '.join(option_values)}")
            return obj()
        if not dataclasses.is_dataclass(options_cls):
            raise FedavalUsageError(f"plugin {name!r}: its Options is not a dataclass; decorate it with @dataclass")
        return obj(build_options(options_cls, option_values, owner=name))  # type: ignore[call-arg,arg-type]
    return obj  # an already-built plugin object


@dataclass
class LoadedPlugins:
    """What :func:`load_plugins` registered, in order."""

    names: list[str] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)


def load_plugins(
    pm: pluggy.PluginManager,
    specs: list[str],
    option_values: dict[str, dict[str, Any]],
    extra: Sequence[Any] = (),
) -> LoadedPlugins:
    """Register the default plugins, then ``specs`` in order, then ``extra``
    (already-built objects, used by tests and the core).

    ``option_values`` maps a plugin name to its raw options; options for a
    plugin that is not loaded are an error, reported by the caller once the
    scenario's options are taken out."""
    loaded = LoadedPlugins()
    resolved: dict[str, Any] = {}
    for spec in list(DEFAULT_PLUGINS) + [s for s in specs if s not in DEFAULT_PLUGINS]:
        name, obj = resolve_plugin(spec)
        if name in resolved:  # before any options are checked: they would be checked against the first one's
            once = f"; one {name}:<Class> plugin per run" if name in SPEC_FACTORIES else ""
            raise FedavalUsageError(f"plugin name {name!r} is loaded twice (from {spec!r}){once}")
        resolved[name] = obj
    for name, obj in resolved.items():
        instance = instantiate(name, obj, option_values.get(name, {}))
        register(pm, instance, name)
        loaded.names.append(name)
        loaded.objects[name] = instance
    for instance in extra:
        name = plugin_name(instance, default=type(instance).__name__.lower())
        register(pm, instance, name)
        loaded.names.append(name)
        loaded.objects[name] = instance
    check_hook_names(pm)
    check_competing_hooks(pm)
    check_loss_terms(loaded)
    return loaded


def register(pm: pluggy.PluginManager, plugin: Any, name: str) -> None:
    """``pm.register``, with pluggy's refusal of a hook implementation (an
    argument the hook does not have, a misspelt ``clinet``) as a one-line
    error naming the plugin."""
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        lines = str(exc).splitlines()  # pluggy: "Plugin 'x' for hook 'h'", the definition, the reason
        hook = lines[0].rsplit(" ", 1)[-1]
        reason = lines[-1] if len(lines) > 1 else lines[0]
        raise FedavalUsageError(f"plugin {name!r}, hook {hook}: {reason}; see fedaval/hookspecs.py") from None


def check_loss_terms(loaded: LoadedPlugins) -> None:
    """Refuse declared local-loss term names (a plugin's ``loss_terms``) that
    the core's terms or another plugin already use: they would be summed into
    one logged figure."""
    owner: dict[str, str] = {term: "the core" for term in CORE_LOSS_TERMS}
    for name in loaded.names:
        for term in getattr(loaded.objects[name], "loss_terms", None) or ():
            if term in owner:
                raise FedavalUsageError(
                    f"plugin {name!r} declares the local-loss term {term!r}, which {owner[term]} "
                    f"{'uses' if owner[term] == 'the core' else 'also declares'}; each term needs its own name"
                )
            owner[term] = f"plugin {name!r}"


def check_competing_hooks(pm: pluggy.PluginManager) -> None:
    """Refuse two plugins competing for one ``firstresult`` hook.

    Of a ``firstresult`` hook's implementations only the first that returns a
    value is used, so two methods both implementing one (two fusion rules, two
    sets of shared keys, two models) would silently lose one. Implementations
    registered ``trylast`` are defaults (FedAvg's, the core's) that a method
    overrides, and wrappers only observe, so neither counts. Checked over
    every hook spec with ``firstresult=True``, whatever its name."""
    for name in sorted(vars(pm.hook)):
        caller = getattr(pm.hook, name)
        spec = getattr(caller, "spec", None)
        if spec is None or not spec.opts.get("firstresult"):
            continue
        competing = [
            impl.plugin_name
            for impl in caller.get_hookimpls()
            if not impl.trylast and not impl.hookwrapper and not getattr(impl, "wrapper", False)
        ]
        if len(competing) > 1:
            names = [repr(p) for p in competing]  # in load order
            raise FedavalUsageError(
                f"plugins {', '.join(names[:-1])} and {names[-1]} both implement {name}, which uses only one result; "
                "load one of them (a plugin meant as an overridable default marks it @hookimpl(trylast=True))"
            )


def spec_names() -> list[str]:
    """Every hook spec's name."""
    return sorted(name for name in dir(hookspecs) if name.startswith("fedaval_") and callable(getattr(hookspecs, name)))


def check_hook_names(pm: pluggy.PluginManager) -> None:
    """Strict registration, as pytest and tox do it: a hook implementation
    whose name matches no spec is a one-line error naming it, its plugin and
    the closest spec (otherwise a misspelt ``fedaval_client_los`` would be
    registered silently and the run would train without it). Also catches a
    ``fedaval_`` method that names a spec but lacks ``@hookimpl``."""
    specs = spec_names()
    for name, plugin in pm.list_name_plugin():
        callers = pm.get_hookcallers(plugin) or []
        for caller in callers:
            if caller.spec is None and caller.name.startswith(f"{PROJECT_NAME}_"):
                raise FedavalUsageError(
                    f"plugin {name!r} implements {caller.name!r}, which is no fedaval hook{_closest(caller.name, specs)}"
                )
        marked = {
            impl.function.__name__ for caller in callers for impl in caller.get_hookimpls() if impl.plugin is plugin
        }
        for attr in dir(plugin):
            if attr in specs and attr not in marked and callable(getattr(plugin, attr, None)):
                raise FedavalUsageError(
                    f"plugin {name!r} has a method {attr!r} without @hookimpl, so it would never be called; "
                    "mark it with fedaval.hookimpl"
                )


def _closest(name: str, specs: list[str]) -> str:
    close = difflib.get_close_matches(name, specs, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else "; see fedaval/hookspecs.py"


def hook_names(obj: Any) -> list[str]:
    """The fedaval hooks an object (or class) implements, sorted: methods named
    ``fedaval_*`` and those marked ``@hookimpl(specname=...)`` (by spec name)."""
    names = set()
    for attr in dir(obj):
        value = getattr(obj, attr, None)
        if not callable(value):
            continue
        opts = getattr(value, f"{PROJECT_NAME}_impl", None)
        if isinstance(opts, dict) and opts.get("specname"):
            names.add(opts["specname"])
        elif attr.startswith("fedaval_"):
            names.add(attr)
    return sorted(names)


def describe(obj: Any) -> str:
    """First line of a plugin's description or docstring."""
    text = getattr(obj, "description", None) or inspect.getdoc(obj) or ""
    return text.strip().splitlines()[0] if text.strip() else ""
