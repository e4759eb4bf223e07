"""User-facing errors: one line, naming the bad value and what is allowed."""

import errno


class FedavalUsageError(Exception):
    """Bad input from a user. The CLI prints the message on one line and exits 2."""


class RunFailure(Exception):
    """A run stopped by a failure it cannot go on from (a failing client under
    ``--on-client-failure fail``, every sampled client failing, a non-finite
    global model). The CLI prints the message on one line and exits with
    ``exit_code`` (1; 2 for a full disk, bad input in the standard's sense);
    the results and checkpoints written so far stay."""

    exit_code = 1


class PluginError(RunFailure):
    """A plugin's hook returned what the core cannot use (a tensor of the
    wrong shape, a value of the wrong type). The message names the hook and
    the plugins implementing it; like any :class:`RunFailure` it is one
    line, exit 1, and what was written stays."""


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (its whitespace runs made single
    spaces), or its type's name when it has none: for a one-line error
    quoting what a library raised."""
    return " ".join(str(exc).split()) or type(exc).__name__


def implementers(pm, hook: str) -> str:
    """``'a', 'b'``: the plugins implementing ``hook`` (wrappers excluded), for
    a :class:`PluginError`'s message."""
    impls = getattr(pm.hook, hook).get_hookimpls()
    return ", ".join(repr(i.plugin_name) for i in impls if not i.hookwrapper and not getattr(i, "wrapper", False))


class RunInterrupted(Exception):
    """A run stopped by Ctrl-C or SIGTERM. The message names the round
    reached and the ``--resume`` command; the CLI prints it on one line and
    exits 130. The results and checkpoints written so far stay."""


class RunStopped(Exception):
    """A run stopped at its ``--time-limit``: between two rounds, with the
    last finished round's checkpoint saved. The message names the round and
    the ``--resume`` command; the CLI prints it on one line and exits 75
    (``EX_TEMPFAIL``: the run is not finished, try again)."""


def choice_error(what: str, value: object, allowed) -> FedavalUsageError:
    """Build the standard 'unknown X' error listing the allowed values."""
    allowed_text = ", ".join(str(a) for a in allowed) or "(none)"
    return FedavalUsageError(f"unknown {what} {value!r}; allowed: {allowed_text}")


class DiskFull(RunFailure):
    """No space left (or quota reached, or a file-size limit hit) while writing the run folder."""

    exit_code = 2


#: The write errors that mean "no room": space, quota, a file-size limit (``ulimit -f``).
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
