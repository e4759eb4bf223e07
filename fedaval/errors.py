"""User-facing errors: one line, naming the bad value and what is allowed."""


class FedavalUsageError(Exception):
    """Bad input from a user. The CLI prints the message on one line and exits 2."""


def choice_error(what: str, value: object, allowed) -> FedavalUsageError:
    """Build the standard 'unknown X' error listing the allowed values."""
    allowed_text = ", ".join(str(a) for a in allowed) or "(none)"
    return FedavalUsageError(f"unknown {what} {value!r}; allowed: {allowed_text}")
