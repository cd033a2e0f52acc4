"""The package's import graph: no circles between modules, and every arrow points down the layers.

Layers, bottom to top. A module may import modules of its own layer or of a lower one, never of a higher
one; within a layer, no import circle. Every `import` and `from ... import` counts, including lazy ones
inside functions and under `if TYPE_CHECKING:`. A module is placed by the longest prefix listed here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tenx import rundir

ROOT = Path(__file__).resolve().parents[1] / "tenx"

LAYERS: list[list[str]] = [
    ["tenx.errors", "tenx.config", "tenx.utils", "tenx.rundir", "tenx.__init__"],
    ["tenx.data", "tenx.model", "tenx.hardware"],
    ["tenx.checkpoint", "tenx.parallel", "tenx.monitor"],
    ["tenx.train"],
    ["tenx.launch", "tenx.eval", "tenx.triage", "tenx.export", "tenx.compress"],
    ["tenx.scaling", "tenx.plan", "tenx.quickstart"],
    # The entry points: the `tenx` command, and the commands that start runs (tenx/commands/: `tenx train`,
    # whose runs tenx.scaling's self-extrapolation watches, `tenx quickstart`, the supervisor's warm spare).
    ["tenx.cli", "tenx.__main__", "tenx.commands"],
]

# File and folder names of a run directory: only tenx/rundir.py spells them (every string constant it
# defines), but for three that are also words of another kind: a manifest field, the incidents command, and
# the ensemble manifest's field that lists the members.
ALSO_OTHER_WORDS = {rundir.RUN_ID, rundir.INCIDENTS, rundir.MEMBERS}
RUN_FILES = tuple(
    sorted(
        v for k, v in vars(rundir).items() if k.isupper() and isinstance(v, str) and v not in ALSO_OTHER_WORDS
    )
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


def _subcommands(parser, path=("tenx",)):
    """(path, parser) of every subcommand of `parser`, nested ones too, their deferred flags added."""
    import argparse

    parser.format_help()  # adds a subcommand's deferred flags and, for a group, its subcommands
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _subcommands(sub, (*path, name))


def test_every_subcommand_is_registered_by_the_one_helper():
    """Every subcommand, nested ones too, comes from tenx.utils.cli.subcommand, which alone calls
    `.add_parser(`; each is a deferring Parser (so building the CLI imports no component)."""
    from tenx.cli import build_parser
    from tenx.utils.cli import Parser

    found = dict(_subcommands(build_parser()))
    assert {("tenx", "data", "prepare"), ("tenx", "plan", "shapes"), ("tenx", "plan", "choose")} <= set(found)
    assert len(found) >= 25
    helped = {p for p, sub in found.items() if isinstance(sub, Parser) and sub.made_by_subcommand}
    stray = sorted(" ".join(p) for p in set(found) - helped)
    assert not stray, f"subcommands not registered with tenx.utils.cli.subcommand: {stray}"
    callers = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_parser":
                callers.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert callers == [c for c in callers if c.startswith("tenx/utils/cli.py:")] and len(callers) == 1, (
        "register subcommands with tenx.utils.cli.subcommand, not add_parser:\n" + "\n".join(callers)
    )


def test_building_the_cli_imports_no_component():
    """`tenx status` does not import torch for the flags of `tenx plan shapes` or `tenx train`."""
    import subprocess
    import sys

    code = (
        "import sys; from tenx.cli import build_parser; "
        "args = build_parser().parse_args(['status', 'RUN']); "
        "heavy = [m for m in ('torch', 'numpy', 'tenx.plan.shapes') if m in sys.modules]; "
        "print(args.func.__module__, heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["tenx.monitor.cli", "[]"], out


COMMAND_CODE_KEPT = {
    "tenx/config.py": "makes the flags of a config dataclass (add_config_arguments), which every cli.py calls",
    "tenx/utils/cpus.py": "the --threads flag's type, next to the thread counts it parses",
}
"""Modules outside a cli.py that hold command code, and why."""


def _command_code(tree: ast.AST) -> list[str]:
    """What makes a module command code: an argparse import, a `register(subparsers)`, a `cmd_*` handler, or
    a call that adds a flag or a subcommand to a parser."""
    adds = {"add_argument", "add_argument_group", "add_mutually_exclusive_group", "add_subparsers"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
            found.append(f"{node.lineno}: import argparse")
        elif isinstance(node, ast.ImportFrom) and node.module == "argparse":
            found.append(f"{node.lineno}: from argparse import")
        elif isinstance(node, ast.FunctionDef) and (node.name == "register" or node.name.startswith("cmd_")):
            found.append(f"{node.lineno}: def {node.name}")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in adds:
            found.append(f"{node.lineno}: .{node.func.attr}(")
    return found


def test_command_code_lives_in_cli_modules():
    """A subcommand's registration, flags and handler live in its package's cli.py (or a `*_cli.py` beside
    it); the domain modules keep the work they call."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        where = path.relative_to(ROOT.parent).as_posix()
        if path.stem == "cli" or path.stem.endswith("_cli") or where in COMMAND_CODE_KEPT:
            continue
        found += [f"{where}:{line}" for line in _command_code(ast.parse(path.read_text()))]
    assert not found, "move command code into the package's cli.py:\n" + "\n".join(found)
    kept = [w for w in COMMAND_CODE_KEPT if _command_code(ast.parse((ROOT.parent / w).read_text()))]
    assert sorted(kept) == sorted(COMMAND_CODE_KEPT), "COMMAND_CODE_KEPT names a module without command code"
    samples = [
        "import argparse",
        "def register(subparsers):\n    pass",
        "def cmd_shapes(args):\n    pass",
        "def flags(p):\n    p.add_argument('--n')",
    ]
    assert all(_command_code(ast.parse(s)) for s in samples)


STEP_PATTERN = re.compile(r"(^|[/.^(\s])step_($|[*(\[\\{%])")
"""The checkpoint directory's name as a regex, a glob or a format (step_(\\d{8}), step_*, step_{...})."""


def test_only_rundir_spells_or_matches_the_step_directory_pattern():
    """Others call rundir.step_of, step_dir_name or RunDir.checkpoint, or glob with rundir.STEP_GLOB."""
    assert STEP_PATTERN.search(rundir.STEP_DIR.pattern) and STEP_PATTERN.search(f".{rundir.STEP_GLOB}.tmp-*")
    assert not STEP_PATTERN.search("step_time_s") and not STEP_PATTERN.search("step_00000020")
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "rundir.py":
            continue
        where = path.relative_to(ROOT.parent)
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and STEP_PATTERN.search(node.value)
            ):
                found.append(f"{where}:{node.lineno} spells {node.value[:60]!r}")
            name = getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "name", None)
            if name in ("STEP_DIR", "_STEP_DIR"):
                found.append(f"{where}:{node.lineno} matches rundir.STEP_DIR itself")
    assert not found, "use tenx.rundir.step_of / step_dir_name / STEP_GLOB:\n" + "\n".join(found)


JSONL_KEPT = {
    "tenx/data/prepare/sources.py": "a user's corpus: streamed, its own error rules (see the comment there)",
    "tenx/data/prepare/stream.py": "prepare's ids.txt: JSON strings, not objects, counted against rows.bin",
    "tenx/data/prepare/engine.py": "the same ids.txt, read in step with rows.bin",
}


def _json_lines_read(tree: ast.AST) -> list[int]:
    """Lines where json.loads parses a line of a file: the variable of a loop over a file's lines (an open
    file, .splitlines(), .readlines(), .split("\\n")), or a .readline()."""
    handles = {
        item.optional_vars.id
        for node in ast.walk(tree)
        if isinstance(node, ast.With)
        for item in node.items
        if isinstance(item.optional_vars, ast.Name)
    }

    def file_lines(expr: ast.AST) -> bool:
        for n in ast.walk(expr):
            if isinstance(n, ast.Name) and n.id in handles:
                return True
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                if n.func.attr in ("splitlines", "readlines", "readline"):
                    return True
                if n.func.attr == "split" and any(
                    isinstance(a, ast.Constant) and a.value in ("\n", b"\n") for a in n.args
                ):
                    return True
        return False

    def root(expr: ast.AST) -> str | None:
        while isinstance(expr, (ast.Call, ast.Attribute, ast.Subscript)):
            expr = expr.func if isinstance(expr, ast.Call) else expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    def is_loads(n: ast.AST) -> bool:
        return (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "loads"
            and getattr(n.func.value, "id", None) == "json"
            and bool(n.args)
        )

    found = []
    loops: list[tuple[ast.AST, ast.AST, list[ast.AST]]] = []  # (target, iterable, body)
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor)):
            loops.append((node.target, node.iter, node.body))
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            parts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            loops += [(g.target, g.iter, parts) for g in node.generators]
        elif is_loads(node) and file_lines(node.args[0]):
            found.append(node.lineno)  # json.loads(f.readline())
    for target, iterable, body in loops:
        if not file_lines(iterable):
            continue
        names = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        for stmt in body:
            found += [n.lineno for n in ast.walk(stmt) if is_loads(n) and root(n.args[0]) in names]
    return sorted(set(found))


def test_one_jsonl_reader():
    """JSON lines are read by tenx.utils.io (jsonl_records, read_jsonl, JsonlTail), with its one rule for
    a line a crash cut short; elsewhere only where JSONL_KEPT says why."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        where = path.relative_to(ROOT.parent).as_posix()
        if where == "tenx/utils/io.py" or where in JSONL_KEPT:
            continue
        found += [f"{where}:{line}" for line in _json_lines_read(ast.parse(path.read_text()))]
    assert not found, "read JSON lines with tenx.utils.io.read_jsonl / jsonl_records:\n" + "\n".join(found)
    kept = [w for w in JSONL_KEPT if _json_lines_read(ast.parse((ROOT.parent / w).read_text()))]
    assert sorted(kept) == sorted(JSONL_KEPT), "JSONL_KEPT names a module that no longer reads JSON lines"
    samples = [  # what the check finds (the readers it replaced)
        "for line in path.read_text().splitlines():\n    rows.append(json.loads(line))",
        "with open(p) as f:\n    rows = [json.loads(line.decode()) for i, line in enumerate(f)]",
        "seq = json.loads(ids.readline())",
    ]
    assert [_json_lines_read(ast.parse(s)) for s in samples] == [[2], [2], [1]]


# Public names defined in more than one module because they mean the same thing in each: every package's
# `register(subparsers)` (tenx/cli.py lists them) and the `main` of the two entry points.
SAME_MEANING = {"register", "main"}


def test_no_public_name_means_two_things():
    """A public function or class is defined in one module only (SAME_MEANING: a role shared by design)."""
    defined: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                defined.setdefault(node.name, []).append(str(path.relative_to(ROOT.parent)))
    twice = {name: where for name, where in defined.items() if len(where) > 1 and name not in SAME_MEANING}
    assert not twice, "one name, one idea: rename by role or share one definition:\n" + "\n".join(
        f"{name}: {', '.join(where)}" for name, where in sorted(twice.items())
    )


def test_module_names_say_their_role():
    """No two modules share a file name (`watch`, `stats`, `laws`, `store`, `run` each once) outside the
    per-package roles: each room's cli, config and manifest (of its own files), and train/callbacks/, whose
    modules are named after the concern they attach to the loop."""
    roles = {"__init__", "cli", "config", "manifest"}
    callbacks = ROOT / "train" / "callbacks"
    names: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path.stem in roles or path.parent == callbacks:
            continue
        names.setdefault(path.stem, []).append(str(path.relative_to(ROOT.parent)))
    assert not {k: v for k, v in names.items() if len(v) > 1}, names
