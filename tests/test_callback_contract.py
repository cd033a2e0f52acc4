"""The trainer's contract with its callbacks: `TrainerView` (tenx/train/hooks.py) is all they read.

A built Trainer has every name of the view, of the declared type; and no callback of tenx reads a trainer
attribute the view does not declare, or replaces one.
"""

from __future__ import annotations

import ast
import types
import typing
from pathlib import Path
from typing import Any

import torch

from tenx.checkpoint import AsyncCheckpointer
from tenx.data.loader import TokenLoader, TokenStream
from tenx.model.config import ModelConfig
from tenx.model.transformer import Transformer
from tenx.monitor.events import EventLog
from tenx.parallel.replicas import Replicas
from tenx.rundir import RunDir
from tenx.train.hooks import TrainerView
from tenx.train.parts import Part, TrainerParts
from tenx.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1] / "tenx"
VIEW_TYPES = {
    "torch": torch,
    "AsyncCheckpointer": AsyncCheckpointer,
    "TokenLoader": TokenLoader,
    "TokenStream": TokenStream,
    "ModelConfig": ModelConfig,
    "Transformer": Transformer,
    "EventLog": EventLog,
    "Replicas": Replicas,
    "RunDir": RunDir,
}


def _view_attributes() -> set[str]:
    return set(TrainerView.__annotations__)


def _view_methods() -> set[str]:
    return {n for n, v in vars(TrainerView).items() if callable(v) and not n.startswith("_")}


def _holds(value: Any, hint: Any) -> bool:
    """Whether `value` is of type `hint` as far as isinstance can tell (generics by their origin)."""
    if hint is Any:
        return True
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_holds(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    return isinstance(value, typing.get_origin(hint) or hint)


def test_a_built_trainer_has_every_name_of_the_view_with_its_type(tiny_config, tiny_data, tmp_path):
    trainer = Trainer(tiny_config(tiny_data, "train.steps=2"), tmp_path / "run")
    hints = typing.get_type_hints(TrainerView, localns=VIEW_TYPES)
    assert {"step", "rank", "loader", "data_skips", "raw_model", "events"} <= set(hints)
    wrong = {
        n: type(getattr(trainer, n)).__name__ for n, h in hints.items() if not _holds(getattr(trainer, n), h)
    }
    assert not wrong, f"Trainer attributes not of the type TrainerView declares: {wrong}"
    for name in _view_methods():
        assert callable(getattr(trainer, name)), name
    assert trainer.autocast() is not None and trainer.agree(7) == 7

    # every name the trainer reads from its parts resolves, to a value of its declared type, and writes through
    parts = {n: p for n, p in vars(TrainerParts).items() if isinstance(p, Part)}
    assert len(parts) >= 30
    for name, part in parts.items():
        (hint,) = typing.get_args(part.__orig_class__)
        assert _holds(getattr(trainer, name), hint), (name, hint, getattr(trainer, name))
    assert trainer.data_skips is trainer.parts.data.skips and trainer.run_dir == tmp_path / "run"
    optimizer = torch.optim.SGD(trainer.raw_model.parameters(), lr=0.1)
    trainer.optimizer = optimizer
    assert trainer.parts.trained.optimizer is optimizer


def _callback_modules() -> list[Path]:
    """Every module of tenx that defines a Callback, and hooks.py itself."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                getattr(b, "id", None) == "Callback" or getattr(b, "attr", None) == "Callback"
                for b in node.bases
            ):
                found.append(path)
                break
    return found + [ROOT / "train" / "hooks.py"]


def test_callbacks_read_only_what_the_view_declares():
    modules = _callback_modules()
    names = {p.relative_to(ROOT).as_posix() for p in modules}
    assert {
        "train/callbacks/record.py",
        "train/callbacks/faults.py",
        "scaling/self_extrapolation.py",
    } <= names
    declared = _view_attributes() | _view_methods()
    undeclared, untyped, replaced = [], [], []
    for path in modules:
        where = path.relative_to(ROOT.parent)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "trainer":
                if node.attr not in declared:
                    undeclared.append(f"{where}:{node.lineno} trainer.{node.attr}")
                if isinstance(node.ctx, ast.Store):
                    replaced.append(f"{where}:{node.lineno} trainer.{node.attr}")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr"):
                if node.args and getattr(node.args[0], "id", None) == "trainer":
                    undeclared.append(f"{where}:{node.lineno} {ast.unparse(node.func)}(trainer, ...)")
            elif isinstance(node, ast.arg) and node.arg == "trainer":
                annotation = ast.unparse(node.annotation) if node.annotation else ""
                if annotation != "TrainerView":
                    untyped.append(f"{where}:{node.lineno} {annotation or 'no annotation'}")
    assert not undeclared, "callbacks read trainer attributes TrainerView does not declare:\n" + "\n".join(
        undeclared
    )
    assert not replaced, "callbacks replace trainer attributes:\n" + "\n".join(replaced)
    assert not untyped, "`trainer` parameters not typed TrainerView:\n" + "\n".join(untyped)
