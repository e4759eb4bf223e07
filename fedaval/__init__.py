"""fedaval: federated continual learning on top of Avalanche.

Avalanche does the continual learning inside each client; fedaval adds the
federation. Every method, the default FedAvg included, is a pluggy plugin.
Importing this package does not import torch, so ``fedaval --help`` and
``fedaval plugins`` stay fast.
"""

import pluggy

__version__ = "0.1.0"

PROJECT_NAME = "fedaval"
ENTRY_POINT_GROUP = "fedaval.plugins"

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marker for hook implementations: ``@hookimpl def fedaval_client_loss(...)``."""

__all__ = ["hookimpl", "ENTRY_POINT_GROUP", "PROJECT_NAME", "__version__"]
