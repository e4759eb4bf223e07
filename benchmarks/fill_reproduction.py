"""Fill the measured cells of docs/reproduction.md from the committed
reports (every report.csv in benchmarks/results/reproduction/<config>/ and
its subfolders, written by ``fedaval report RUNS --paper configs/<config>.toml``
through benchmarks/reproduce.py); rows without runs
keep "not run yet". tests/test_reproduction.py checks the result.

    python benchmarks/fill_reproduction.py
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedaval.report import REPRODUCTION_COLUMNS, committed_reports, reproduction_cell  # noqa: E402


def main() -> None:
    path = ROOT / "docs" / "reproduction.md"
    out, config, header, report, metric = [], None, None, {}, None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            config, header = None, None
        found = re.search(r"Config: `configs/([^`]+)`", line)
        if found:
            config = found.group(1)
            report = committed_reports(ROOT / "benchmarks" / "results" / "reproduction" / config.removesuffix(".toml"))
            metric = tomllib.loads((ROOT / "configs" / config).read_text())["paper"]["metric"]
        if not line.startswith("|") or config is None:
            header = None if not line.startswith("|") else header
            out.append(line)
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set(line) <= set("|-: ") and cells[0] in report:
            row = report[cells[0]]
            for i, title in enumerate(header):
                if title.startswith("measured"):
                    key = REPRODUCTION_COLUMNS.get(title, metric)
                    mean, std = (float(row[f"{key}_{s}"]) if row.get(f"{key}_{s}") else None for s in ("mean", "std"))
                    cells[i] = reproduction_cell(mean, std, int(row["runs"]))
            line = "| " + " | ".join(cells) + " |"
        out.append(line)
    path.write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
