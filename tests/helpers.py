"""Helpers shared by test modules (import as ``from helpers import ...``)."""

from __future__ import annotations


def strip_timing(obj):
    """results.json without wall-clock figures and the run folder: what two
    runs with the same seed must agree on."""
    if isinstance(obj, dict):
        return {k: strip_timing(v) for k, v in obj.items() if not k.startswith("seconds") and k != "out"}
    if isinstance(obj, list):
        return [strip_timing(v) for v in obj]
    return obj
