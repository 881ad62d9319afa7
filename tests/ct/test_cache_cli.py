"""`milgp-cache` answers --help and argument errors without loading the data stack."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [["--help"], ["rsna", "--images", "x"]])
def test_help_and_usage_errors_do_not_import_torch(argv: list[str], tmp_path: Path) -> None:
    """Importing torch took 1.9 s of the 2.0 s `milgp-cache --help` needed; if this fails, a module
    the parser imports pulls torch in again."""
    code = ("import sys\nfrom milgp.ct.cache_cli import main\ntry:\n"
            f"    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print('IMPORTED', sorted(m for m in ('torch', 'pydicom') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTED []" in proc.stdout
    assert "usage: milgp-cache" in proc.stdout + proc.stderr
