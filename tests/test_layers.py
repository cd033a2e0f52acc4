"""The package's import graph: no circles between modules, and every arrow points down the layers.

Layers, bottom to top. A module may import modules of its own layer or of a lower one, never of a higher
one; within a layer, no import circle. Every `import` and `from ... import` counts, including lazy ones
inside functions and under `if TYPE_CHECKING:`. A module is placed by the longest prefix listed here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tenx"

LAYERS: list[list[str]] = [
    ["tenx.errors", "tenx.config", "tenx.utils", "tenx.rundir", "tenx.__init__"],
    ["tenx.data", "tenx.model", "tenx.hardware"],
    ["tenx.checkpoint", "tenx.parallel", "tenx.monitor"],
    ["tenx.train"],
    ["tenx.launch", "tenx.eval", "tenx.triage", "tenx.export", "tenx.compress"],
    ["tenx.scaling", "tenx.plan", "tenx.quickstart"],
    # The warm spare runs a `tenx` command line: it is an entry point, like __main__.
    ["tenx.cli", "tenx.cli_parsing", "tenx.__main__", "tenx.launch.worker"],
]

# File and folder names of a run directory: only tenx/rundir.py spells them.
RUN_FILES = (
    "config.toml",
    "run.json",
    "metrics.jsonl",
    "events.jsonl",
    "ledger.jsonl",
    "data_skips.json",
    "eval.json",
    "loss_curve.png",
    "prediction.json",
    "prediction.png",
    "extrapolation",
    "checkpoints",
    "tensorboard",
    "stacks-pid",
)


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1 and parts != ["tenx", "__init__"]:
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, name: str) -> set[str]:
    """Every tenx module `path` imports (absolute or relative, at any depth of the code)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("tenx")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not module.startswith("tenx"):
                continue
            found.add(module)
            for alias in node.names:  # `from tenx.train import checkpoint` imports a module
                found.add(f"{module}.{alias.name}")
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        graph[name] = {m for m in _imports(path, name) if m in files and m != name}
    return graph


def _layer(module: str) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    assert best is not None, f"{module} is in no layer: add it to LAYERS in tests/test_layers.py"
    return best


def test_every_arrow_points_down_the_layers():
    graph = _graph()
    upward = sorted(
        f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
        for a, targets in graph.items()
        for b in targets
        if _layer(b) > _layer(a)
    )
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_import_circles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_model_code_never_imports_training_code():
    graph = _graph()
    bad = sorted(
        f"{a} imports {b}"
        for a, t in graph.items()
        if a.startswith("tenx.model")
        for b in t
        if not b.startswith(("tenx.model", "tenx.errors", "tenx.config", "tenx.utils"))
    )
    assert not bad, "\n".join(bad)


def test_only_rundir_names_the_files_of_a_run():
    spelled = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "rundir.py" and path.parent == ROOT:
            continue
        tree = ast.parse(path.read_text())
        helps = {id(k.value) for k in ast.walk(tree) if isinstance(k, ast.keyword) and k.arg == "help"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in helps:
                for name in RUN_FILES:
                    if node.value == name or node.value.startswith(name) and name == "stacks-pid":
                        spelled.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} spells {name!r}")
    assert not spelled, "use tenx.rundir (RunDir or its constants) instead:\n" + "\n".join(spelled)


def test_no_file_over_600_lines_and_a_short_trainer():
    sizes = {p.relative_to(ROOT.parent): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert sizes[Path("tenx/train/trainer.py")] <= 400
    assert not {str(p): n for p, n in sizes.items() if n > 600}
