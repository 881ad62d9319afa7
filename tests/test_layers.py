"""The layers of ``milgp``: each subpackage imports only subpackages below it, the CT path sits beside
the GP library, and nothing under ``milgp/`` imports Lightning.

If a test here fails, a module has reached up or sideways: a cycle between layers (a likelihood
importing the variational machinery that imports likelihoods), the GP library depending on the CT
DICOM path, or the library depending on Lightning, which ``lightning_modules/`` is there to hold.
"""
from __future__ import annotations

import ast
from pathlib import Path

import milgp

PACKAGE = Path(milgp.__file__).parent

ALLOWED: dict[str, set[str]] = {
    "linalg": set(),
    "metrics": set(),
    "data": set(),
    "inducing": set(),
    "plots": {"metrics"},
    "likelihoods": {"data", "linalg"},
    "models": {"data", "likelihoods", "linalg"},
    "prediction": {"data", "likelihoods", "linalg", "metrics", "models"},
    "variational": {"data", "likelihoods", "linalg", "models", "prediction"},
    "sampling": {"data", "likelihoods", "linalg", "models"},
    "estimators": {"data", "inducing", "likelihoods", "linalg", "metrics", "models", "prediction", "sampling", "variational"},
    "baselines": {"data", "estimators", "metrics"},
    "ct": {"data"},
}
"""For every top-level part of ``milgp`` (a subpackage or a module), the parts it may import."""


def _imports(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


def _part(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def test_every_part_of_the_package_has_a_layer() -> None:
    parts = {_part(p) for p in _sources()}
    assert parts <= set(ALLOWED), f"parts without a layer in this test: {sorted(parts - set(ALLOWED))}"


def test_no_module_imports_a_part_above_or_beside_its_own() -> None:
    offences = []
    for path in _sources():
        part = _part(path)
        for module in _imports(path):
            if module.startswith("milgp."):
                target = module.split(".")[1]
                if target != part and target not in ALLOWED[part]:
                    offences.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    assert not offences, "\n".join(offences)


def test_the_library_never_imports_lightning() -> None:
    offences = [
        f"{path.relative_to(PACKAGE.parent)} imports {module}"
        for path in _sources()
        for module in _imports(path)
        if module.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_modules")
    ]
    assert not offences, "\n".join(offences)
