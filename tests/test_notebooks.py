"""The notebooks under ``notebooks/`` are stored executed (outputs in the file) and run top to bottom.

Each notebook is executed with nbclient in a fresh ``python3`` kernel that runs *this* interpreter
(the project's virtual environment), with the working directory and every file it writes in a
temporary directory (``MILGP_NOTEBOOK_OUTPUT``), so executing them never touches the repository.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = ["01_quickstart.ipynb", "02_gpytorch_likelihoods.ipynb", "03_finetune_ct.ipynb"]
CELL_TIMEOUT_S = 600


def _repo_snapshot() -> set[str]:
    """Files under ``notebooks/`` (tracked or not, ignored included): what a run must not change."""
    return {str(p.relative_to(ROOT)) for p in NOTEBOOK_DIR.rglob("*") if p.is_file()}


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_exists_and_is_valid(name: str) -> None:
    path = NOTEBOOK_DIR / name
    assert path.is_file(), f"{path} is missing"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert nb.cells[0].cell_type == "markdown", "a notebook opens with a markdown cell saying what it shows"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_stored_notebook_is_executed(name: str) -> None:
    """A reader sees the results without running anything: every code cell was executed, top to
    bottom in one kernel, without errors, and the figures are in the file (the notebooks were
    stored without outputs)."""
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert [cell.get("execution_count") for cell in code] == list(range(1, len(code) + 1)), f"{name}: execute it top to bottom and save"
    outputs = [o for cell in code for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"], f"{name} is stored with an error"
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{name} is stored without its figures"


@pytest.fixture
def kernel_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``python3`` kernelspec that runs this interpreter, found first via ``JUPYTER_PATH``,
    and the environment the kernel inherits: output folder, one thread per op (tiny problems on a
    shared CPU are faster without thread oversubscription)."""
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (milgp venv)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("MILGP_NOTEBOOK_OUTPUT", str(out))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONWARNINGS", "ignore::FutureWarning,ignore:IProgress not found")
    monkeypatch.setenv("TQDM_DISABLE", "1")
    return out


def test_kernelspec_uses_this_interpreter(kernel_env: Path) -> None:
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    assert spec.argv[0] == sys.executable


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name: str, kernel_env: Path, tmp_path: Path) -> None:
    path = NOTEBOOK_DIR / name
    stored_bytes = path.read_bytes()
    nb = nbformat.read(path, as_version=4)
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    before = _repo_snapshot()
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError naming the failing cell
    seconds = time.perf_counter() - start
    print(f"{name}: executed in {seconds:.1f} s")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors
    assert _repo_snapshot() == before, "executing the notebook wrote into notebooks/"
    assert path.read_bytes() == stored_bytes  # nbclient executes the in-memory copy
