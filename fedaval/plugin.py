"""Base class for method plugins (optional: any object with hooks will do)."""

from __future__ import annotations

from typing import Any, ClassVar

CORE_LOSS_TERMS = ("classification", "total")
"""Loss terms the core logs itself (``loss/classification``, ``loss/total``):
a plugin's term of either name would be summed into them unnoticed."""


class Plugin:
    """A method: its options, its state, and its hook implementations.

    Subclasses set ``name`` (the ``--plugins`` and ``-o name.key`` prefix),
    ``description`` (one line, shown by ``fedaval plugins``) and, if they take
    options, a dataclass ``Options``. State kept on the instance is saved by
    :meth:`state_dict` (every attribute except ``options``), so checkpoints
    need no per-plugin code unless a plugin holds something unpicklable (leave
    it out in an overriding ``state_dict``, and rebuild it in ``fedaval_setup``).

    ``state_dict`` returns the attributes themselves, not copies: a checkpoint
    pickles them in one go with the clients, so a tensor or object a plugin
    shares with a client is still shared after resuming.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Options: ClassVar[type | None] = None
    loss_terms: ClassVar[tuple[str, ...]] = ()
    """Names of the local-loss terms the plugin returns, if it declares them:
    checked at load time against the core's (``classification``, ``total``)
    and the other plugins' (undeclared names are checked at first use)."""

    def __init__(self, options: Any = None):
        if options is None and self.Options is not None:
            options = self.Options()
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "options"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
