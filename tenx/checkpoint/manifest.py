"""The checkpoint manifest (tenx_checkpoint.json): its name and format, self-checksum and field checks.

The manifest is untrusted input: validate_manifest checks its self-checksum (when present: checkpoints
written before it existed still load) and the type and range of every field tenx reads, so a bad value is a
CheckpointError naming the checkpoint and the field, not a traceback later.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tenx.errors import CheckpointError, UnsafeCheckpointError
from tenx.rundir import step_of
from tenx.utils.io import bytes_xxhash

FORMAT = "tenx-ckpt/1"
MANIFEST = "tenx_checkpoint.json"
_METADATA = ".metadata"  # DCP's metadata file (a pickle)


def _short(value: Any, limit: int = 80) -> str:
    """A bounded repr of a value read from an untrusted file (for error messages)."""
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _is_plain_name(name: Any) -> bool:
    """A file name inside the checkpoint directory: no separator, not `.`/`..`, no NUL."""
    return (
        type(name) is str
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
        and len(name) <= 255
    )


def manifest_digest(manifest: dict[str, Any]) -> str:
    """xxhash of the manifest's canonical JSON without its own `manifest_xxhash` (its self-checksum)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_xxhash"}
    return bytes_xxhash(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


class _FieldError(Exception):
    def __init__(self, field: str, expected: str) -> None:
        super().__init__(field, expected)
        self.field, self.expected = field, expected


def _need(ok: bool, field: str, expected: str) -> None:
    if not ok:
        raise _FieldError(field, expected)


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def _is_int_list(value: Any) -> bool:
    return type(value) is list and all(type(v) is int for v in value)


def _is_span(value: Any) -> bool:
    return (
        type(value) is list and len(value) == 2 and all(_is_count(v) for v in value) and value[0] <= value[1]
    )


_COUNT = "a whole number >= 0"
_OPTIM_NUMBERS = ("lr", "eps", "weight_decay", "initial_lr", "momentum", "dampening")
_OPTIM_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay", "nesterov")


def _check_manifest_fields(meta: dict[str, Any]) -> None:
    """Raise _FieldError for the first field tenx reads whose type or range is wrong.

    `format`, `step` and `files` must be present; the trainer's fields are checked where present (the
    trainer and tenx eval say which they need, see require_fields).
    """
    _need(_is_count(meta.get("step")), "step", _COUNT)
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        raise _FieldError("files", "a non-empty object: file name -> {bytes, xxhash}")
    for name, info in files.items():
        if not _is_plain_name(name) or name == MANIFEST:
            raise UnsafeCheckpointError(
                f"lists {_short(name)}, which is not a file name inside the checkpoint"
            )
        _need(
            type(info) is dict and _is_count(info.get("bytes")) and type(info.get("xxhash")) is str,
            f"files.{name}",
            "{bytes: a whole number >= 0, xxhash: a string}",
        )
    _need(type(meta.get("manifest_xxhash", "")) is str, "manifest_xxhash", "a string")
    if "tokens" in meta:
        _need(_is_count(meta["tokens"]), "tokens", _COUNT)
    if "loader" in meta:
        loader = meta["loader"]
        _need(type(loader) is dict, "loader", "an object")
        for key in ("epoch", "cursor", "num_windows"):
            _need(_is_count(loader.get(key, 0)), f"loader.{key}", _COUNT)
        _need(type(loader.get("seed", 0)) is int, "loader.seed", "a whole number")
        _need(type(loader.get("sample", "")) is str, "loader.sample", "a string")
        skips = loader.get("skips", [])
        _need(
            type(skips) is list and all(_is_span(s) for s in skips), "loader.skips", "a list of [start, end]"
        )
    if "python_rng" in meta:
        rng = meta["python_rng"]
        _need(
            type(rng) is list
            and len(rng) == 3
            and type(rng[0]) is int
            and _is_int_list(rng[1])
            and (rng[2] is None or _is_number(rng[2])),
            "python_rng",
            "[version, [state ints], gauss or null]",
        )
    if "numpy_rng" in meta:
        rng = meta["numpy_rng"]
        _need(
            type(rng) is dict
            and type(rng.get("name")) is str
            and _is_int_list(rng.get("keys"))
            and type(rng.get("pos")) is int
            and type(rng.get("has_gauss")) is int
            and _is_number(rng.get("cached")),
            "numpy_rng",
            "{name, keys: [ints], pos, has_gauss, cached}",
        )
    if "callbacks" in meta:
        callbacks = meta["callbacks"]
        _need(
            type(callbacks) is dict and all(type(v) is dict for v in callbacks.values()),
            "callbacks",
            "an object of callback name -> object",
        )
    if "guard" in meta:
        guard = meta["guard"]
        _need(type(guard) is dict, "guard", "an object")
        for key in ("losses", "grad_norms"):
            values = guard.get(key, [])
            _need(
                type(values) is list and all(_is_number(v) for v in values),
                f"guard.{key}",
                "a list of numbers",
            )
        streak = guard.get("streak", [])
        _need(
            type(streak) is list
            and all(
                type(b) is dict and _is_count(b.get("step")) and _is_span(b.get("position")) for b in streak
            ),
            "guard.streak",
            "a list of {step, position: [start, end]}",
        )
    if "optim_param_groups" in meta:
        groups = meta["optim_param_groups"]
        _need(
            type(groups) is list and all(type(g) is dict for g in groups),
            "optim_param_groups",
            "a list of objects",
        )
        for i, group in enumerate(groups):
            where = f"optim_param_groups[{i}]"
            params = group.get("params")
            _need(
                type(params) is list and all(type(p) in (str, int) for p in params),
                f"{where}.params",
                "a list of parameter names",
            )
            for key in _OPTIM_NUMBERS:
                _need(_is_number(group.get(key, 0)), f"{where}.{key}", "a number")
            for key in _OPTIM_FLAGS:
                _need(type(group.get(key, False)) is bool, f"{where}.{key}", "true or false")
            for key in ("foreach", "fused"):
                _need(
                    group.get(key) is None or type(group[key]) is bool,
                    f"{where}.{key}",
                    "true, false or null",
                )
            betas = group.get("betas", [0.9, 0.999])
            _need(
                type(betas) is list and len(betas) == 2 and all(_is_number(b) for b in betas),
                f"{where}.betas",
                "[beta1, beta2]",
            )
    for key in ("model", "config", "data_tokenizer", "replicas", "teacher"):
        if key in meta:
            _need(type(meta[key]) is dict, key, "an object")
    for key in ("data_dir", "run_id", "tenx_version", "strategy"):
        if key in meta:
            _need(type(meta[key]) is str, key, "a string")
    for key in ("world_size", "threads"):
        if key in meta:
            _need(type(meta[key]) is int and meta[key] >= 1, key, "a whole number >= 1")


def validate_manifest(path: str | Path, meta: Any) -> dict[str, Any]:
    """Check a parsed manifest: its format, its self-checksum and the fields tenx reads; returns it.

    A checkpoint written before manifests carried `manifest_xxhash` is accepted without one.
    """
    path = Path(path)
    if type(meta) is not dict:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} holds a {type(meta).__name__}, not an object")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {_short(meta.get('format'))}, expected {FORMAT!r}")
    if "manifest_xxhash" in meta and meta["manifest_xxhash"] != manifest_digest(meta):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt (its own checksum does not match)")
    try:
        _check_manifest_fields(meta)
    except _FieldError as e:
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} field {e.field!r} must be {e.expected}"
        ) from None
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"checkpoint {path}: {MANIFEST} {e}; refusing to load it") from None
    named = step_of(path)
    if named is not None and named != meta["step"]:
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} says step {meta['step']}, its directory another"
        )
    return meta


def require_fields(path: str | Path, meta: dict[str, Any], fields: Iterable[str]) -> None:
    """CheckpointError naming the first of `fields` (dotted for nested ones) that the manifest lacks."""
    for field in fields:
        node: Any = meta
        for part in field.split("."):
            if type(node) is not dict or part not in node:
                raise CheckpointError(
                    f"checkpoint {path}: {MANIFEST} has no {field!r} (written by another program, or damaged)"
                )
            node = node[part]
