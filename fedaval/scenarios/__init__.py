"""Federated continual-learning settings: per-client task streams from any dataset."""

from fedaval.scenarios.partition import ClientTasks, Partition
from fedaval.scenarios.registry import SCENARIOS, ScenarioSpec, get_scenario

__all__ = ["SCENARIOS", "ScenarioSpec", "get_scenario", "ClientTasks", "Partition"]
