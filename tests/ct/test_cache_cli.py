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


@pytest.mark.parametrize("window", ["40,nan", "40,inf", "inf,80", "nan,80"])
def test_non_finite_window_is_an_argument_error(window: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A NaN or infinite window centre or width must be refused while the arguments are parsed,
    naming the window, with nothing written. Before, it was accepted: every image cached as zeros
    and params.json held NaN/Infinity (not JSON)."""
    from milgp.ct.cache_cli import main

    out = tmp_path / "cache"
    with pytest.raises(SystemExit) as exc:
        main(["rsna", "--images", str(tmp_path), "--labels", str(tmp_path / "l.csv"), "--out", str(out), "--windows", window])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--windows" in last and repr(window) in last and "finite" in last
    assert not out.exists()


@pytest.mark.parametrize("window", [(40.0, float("nan")), (float("inf"), 80.0), (40.0, float("inf"))])
def test_cache_params_refuse_non_finite_windows(window: tuple[float, float]) -> None:
    """CacheParams is what params.json records: it must never hold NaN or Infinity."""
    from milgp.ct.cache_params import CacheParams

    with pytest.raises(ValueError, match="finite"):
        CacheParams(windows=(window,))


@pytest.mark.parametrize("command", ["rsna", "synthetic"])
def test_negative_seed_is_an_argument_error(command: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--seed -1 must be refused while the arguments are parsed, naming --seed, before any work.
    Before, the whole cache was built and then 'expected non-negative integer' named no option."""
    from milgp.ct.cache_cli import main

    out = tmp_path / "out"
    inputs = ["--images", str(tmp_path), "--labels", str(tmp_path / "l.csv"), "--splits", "0.5,0.25,0.25"] if command == "rsna" else []
    with pytest.raises(SystemExit) as exc:
        main([command, *inputs, "--out", str(out), "--seed", "-1"])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--seed" in last and ">= 0" in last
    assert not out.exists()
