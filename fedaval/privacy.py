"""results.json's ``privacy`` block: what the privacy plugins report.

A plugin object with a ``privacy_results(run)`` method (the ``dp`` defence,
the ``attack`` measurement) contributes ``{plugin name: its dict}``; the
coordinator writes the block after every round, and only when some plugin
has one, so a run without privacy plugins keeps its results.json as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedaval.run import Run


def privacy_results(run: Run) -> dict[str, Any] | None:
    """``{plugin name: plugin.privacy_results(run)}`` over the run's plugins
    that have the method, in load order; ``None`` when none has."""
    block = {}
    for name in run.plugins.names:
        report = getattr(run.plugins.objects[name], "privacy_results", None)
        if callable(report):
            block[name] = report(run)
    return block or None
