"""The README's plugin example works as written."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from click.testing import CliRunner

from fedaval.cli import cli

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_plugin_example_runs(tmp_path, monkeypatch):
    text = README.read_text()
    code = re.search(r"```python\n# mymethod.py\n(.*?)```", text, re.S).group(1)
    (tmp_path / "mymethod.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    result = CliRunner().invoke(
        cli,
        [
            "train",
            "--plugins",
            "mymethod:Prox",
            "-o",
            "prox.mu=0.1",
            "-o",
            "fcil-sync.clients=2",
            "-o",
            "fcil-sync.tasks=2",
            "--rounds-per-task",
            "2",
            "--quiet",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
    )
    sys.modules.pop("mymethod", None)
    assert result.exit_code == 0, result.output
    rounds = json.loads((out / "results.json").read_text())["rounds"]
    # round 1 starts at the received weights (term 0 at the first step), later the term is positive
    assert all("loss/prox" in r["losses"] for r in rounds)
    assert rounds[-1]["losses"]["loss/prox"] > 0
