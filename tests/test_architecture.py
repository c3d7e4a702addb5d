"""The import directions of DESIGN.md, read from every module's source (imports inside functions too):
data flows down the pipeline, and no stage imports one that runs after it."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"passes": "autopar.passes", "solver": "autopar.solver", "codegen": "autopar.codegen",
          "runtime": "autopar.runtime"}
# The face's data types, which every stage may use; they and the modules that present them (the
# summary, explain, diff and HTML report) import no stage.
DATA = ("autopar.cluster", "autopar.errors", "autopar.plan", "autopar.layout")
PRESENTATION = ("autopar.report", "autopar.inspection")
ALLOWED = {
    "autopar.solver": ("autopar.solver", "autopar.errors"),
    "autopar.passes": ("autopar.passes", "autopar.solver") + DATA,
    "autopar.codegen": ("autopar.codegen", "autopar.passes", "autopar.runtime") + DATA,
    "autopar.runtime": ("autopar.runtime",) + DATA,
    **{m: DATA + PRESENTATION for m in DATA + PRESENTATION},
}


def _modules():
    for folder, package in STAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            yield package + "".join("." + p for p in parts if p != "__init__"), path
    for path in sorted((ROOT / "autopar").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        yield ".".join(p for p in parts if p != "__init__"), path


def _imports(module: str, path: Path):
    """Every project module ``path`` imports, with its line, wherever the import statement is."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names = [f"{base}.{a.name}" for a in node.names]    # a module, or a name inside one
        else:
            continue
        for name in names:
            if name == "autopar" or name.startswith("autopar."):
                yield name, node.lineno


def _rule(module: str):
    owner = max((k for k in ALLOWED if module == k or module.startswith(k + ".")), key=len, default=None)
    return ALLOWED.get(owner)


def _within(name: str, allowed) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


def _violations():
    out = []
    for module, path in _modules():
        allowed = _rule(module)
        if allowed is None:
            continue
        for name, line in _imports(module, path):
            if not _within(name, allowed):
                out.append(f"{path.relative_to(ROOT)}:{line} {module} imports {name}")
    return out


def test_every_module_imports_only_down_the_pipeline():
    assert _violations() == []


def test_the_check_sees_imports_inside_functions_and_relative_ones(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("import torch\nfrom . import collectives\n"
                   "def f():\n    from autopar.passes.capture import capture\n    return capture\n")
    found = dict(_imports("autopar.runtime.x", bad))
    assert found == {"autopar.runtime.collectives": 2, "autopar.passes.capture.capture": 4}
    assert [n for n in found if not _within(n, _rule("autopar.runtime.x"))] == ["autopar.passes.capture.capture"]


@pytest.mark.parametrize("stage", sorted(STAGES.values()))
def test_every_stage_has_modules_under_the_rule(stage):
    assert any(m.startswith(stage) for m, _ in _modules())
