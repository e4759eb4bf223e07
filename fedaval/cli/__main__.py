"""``python -m fedaval.cli``: the same as the ``fedaval`` command."""

from fedaval.cli import main

main()
