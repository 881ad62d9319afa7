"""The README's command-line walk-through (data → fit → test → predict new DICOM → resume), run as written."""
from __future__ import annotations

import csv
import json
import re
import shlex
from pathlib import Path

import pytest

from lightning_modules import cli
from lightning_modules import predict as predict_cli
from milgp.ct import cache_cli

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- walkthrough: tests/lightning_modules/test_walkthrough.py runs these commands -->"
TOOLS = {"milgp-cache": cache_cli.main, "milgp-train": cli.main, "milgp-predict": predict_cli.main}


def walkthrough_commands() -> list[list[str]]:
    """The commands of the README block after the walk-through marker (comments dropped)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text[text.index(MARKER):], re.S).group(1)
    joined = block.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.slow
def test_readme_walkthrough_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command of the README walk-through runs, in a fresh folder holding only the configs,
    and leaves what the README says: a fit and its checkpoints, a test report, predictions for the
    new DICOM scans, and a resumed fit whose log continues the first one."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    commands = walkthrough_commands()
    assert [c[0] for c in commands].count("milgp-predict") == 1 and any("last" in c for c in commands if c[0] == "milgp-train")
    for command in commands:
        assert TOOLS[command[0]](command[1:]) == 0, command
    runs = {Path(c[c.index("--trainer.default_root_dir") + 1]) for c in commands if "--trainer.default_root_dir" in c}
    gp = next(r for r in runs if (r / "test").is_dir())
    assert json.loads((gp / "test" / "version_0" / "metrics.json").read_text())["metrics"]["bag_auc"] is not None
    with open(gp / "predict" / "version_0" / "predictions.csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) >= 1
    with open(gp / "fit" / "version_1" / "metrics.csv", newline="") as fh:
        epochs = {int(r["epoch"]) for r in csv.DictReader(fh)}
    assert 0 in epochs and max(epochs) >= 1
