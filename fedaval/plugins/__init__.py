"""Built-in method plugins.

Each is registered through the ``fedaval.plugins`` entry-point group in
``pyproject.toml``, exactly as a third-party package would register its own;
this package holds only their code. ``fedaval plugins`` lists what is installed.
"""
