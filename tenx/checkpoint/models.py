"""Load a trained model (one, or an ensemble of members) from a run directory or a checkpoint: for evaluation,
sampling, compression, export, and a distillation teacher."""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from tenx import checkpoint as ckpt
from tenx import config as cfglib
from tenx import rundir
from tenx.errors import CheckpointError, ConfigError
from tenx.hardware import pick_device, tune_cpu_allocator
from tenx.model.config import ModelConfig
from tenx.model.ensemble import Ensemble
from tenx.model.flops import count_params
from tenx.model.transformer import Transformer
from tenx.utils.io import atomic_write_json, read_regular_file


@dataclass
class LoadedModel:
    """A model restored from a checkpoint, with what is needed to use it."""

    model: Transformer | Ensemble
    checkpoint: Path
    meta: dict[str, Any]
    run_dir: Path | None

    @property
    def data_dir(self) -> Path:
        """The prepared data directory the model was trained on (absolute, so any working directory works)."""
        recorded = self.meta.get("data_dir") or self.meta.get("config", {}).get("data", {}).get("dir")
        if type(recorded) is not str or not recorded:
            raise CheckpointError(f"checkpoint {self.checkpoint}: {ckpt.MANIFEST} records no data directory")
        return Path(recorded)


def resolve_checkpoint(target: str | Path) -> tuple[Path, Path | None]:
    """(checkpoint dir, run dir or None) for a run directory (newest verified checkpoint) or a checkpoint."""
    target = Path(target)
    if (target / ckpt.MANIFEST).exists() or rundir.step_of(target) is not None:
        run_dir = target.parent.parent if target.parent.name == rundir.CHECKPOINTS else None
        return target, run_dir
    if not target.exists():
        raise CheckpointError(f"{target} does not exist; give a run directory or a checkpoint directory")
    path, skipped = ckpt.latest_verified(rundir.RunDir(target).checkpoints)
    if path is None:
        detail = f" ({'; '.join(skipped)})" if skipped else ""
        raise CheckpointError(f"run directory {target} has no checkpoint that verifies{detail}")
    for note in skipped:  # never a silent fallback: say which checkpoint is used instead, and why
        print(f"tenx: skipping a newer checkpoint: {note}", file=sys.stderr)
    if skipped:
        print(f"tenx: using {path} instead (the newest that verifies)", file=sys.stderr)
    return path, target


def load_model(target: str | Path, device: str = "auto") -> LoadedModel:
    """Rebuild the model recorded in the checkpoint and load its weights (no optimizer state).

    The checkpoint is verified first, and the model its manifest records must fit in the tensors its DCP
    metadata lists, so a forged manifest cannot make this allocate more than the checkpoint holds.
    A directory with an ensemble manifest (`ensemble.json`) loads every member it lists, each verified the
    same way, as one `Ensemble` (the average of the members' probabilities).
    """
    if Path(target).is_dir() and rundir.RunDir(target).ensemble.exists():
        return load_ensemble(target, device)
    path, run_dir, meta, model_cfg = verified_model(target)
    dev = pick_device(device, "--device")
    if dev.type == "cpu":
        tune_cpu_allocator()
    try:
        model = Transformer(model_cfg).to(dev)
    except (RuntimeError, ValueError, OverflowError) as e:  # values validate() does not range-check
        raise CheckpointError(
            f"checkpoint {path}: the model its manifest records cannot be built ({type(e).__name__}: {e})"
        ) from None
    tensors = {"model": get_model_state_dict(model)}
    meta = ckpt.load_checkpoint(path, tensors, verify=False, require=_EVAL_FIELDS)  # verified above
    set_model_state_dict(model, tensors["model"])
    model.eval()
    return LoadedModel(model, path, meta, run_dir)


def verified_model(target: str | Path) -> tuple[Path, Path | None, dict[str, Any], ModelConfig]:
    """(checkpoint, run dir or None, manifest, model config) of a run directory's newest verified checkpoint
    or of a checkpoint directory: every file hashed once, the config valid, and the model it records no
    larger than the tensors its DCP metadata lists. No weight is loaded."""
    path, run_dir = resolve_checkpoint(target)
    if path == Path(target):  # a checkpoint directory: not verified yet (latest_verified verified the other)
        meta = ckpt.verify_checkpoint(path, require=_EVAL_FIELDS)
    else:
        meta = ckpt.read_checkpoint_meta(path, require=_EVAL_FIELDS)
    model_cfg = _model_config(path, meta["model"])
    stored = ckpt.read_dcp_metadata(path, meta).state_dict_metadata
    held = sum(math.prod(e.size) for k, e in stored.items() if k.startswith("model.") and hasattr(e, "size"))
    params = count_params(model_cfg).total
    if params > held:  # held counts a tied weight twice: fewer parameters than it holds is not an error here
        raise CheckpointError(
            f"checkpoint {path}: its manifest records a model of {params:,} parameters, but it holds only "
            f"{held:,} model values"
        )
    return path, run_dir, meta, model_cfg


_EVAL_FIELDS = ("model", "tokens")

MAX_MEMBERS = 64
"""The most members an ensemble manifest may list (each one is a whole model in memory)."""


def ensemble_members(target: str | Path) -> list[Path]:
    """The member run directories an ensemble manifest lists (relative paths are taken from its directory),
    checked: a JSON object whose "members" is a list of 1 to MAX_MEMBERS distinct directories, none of them
    an ensemble itself. Errors name the manifest and the entry."""
    manifest = rundir.RunDir(target).ensemble
    try:
        data = json.loads(read_regular_file(manifest, limit=1 << 20))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"ensemble manifest {manifest}: not valid JSON ({e})") from None
    members = data.get("members") if isinstance(data, dict) else None
    if not isinstance(members, list) or not 1 <= len(members) <= MAX_MEMBERS:
        raise CheckpointError(
            f"ensemble manifest {manifest}: field 'members' must be a list of 1 to {MAX_MEMBERS} run "
            "directories"
        )
    paths: list[Path] = []
    for i, entry in enumerate(members):
        if type(entry) is not str or not entry:
            raise CheckpointError(f"ensemble manifest {manifest}: members[{i}] is not a path ({entry!r})")
        path = Path(target) / entry  # an absolute entry stays absolute
        if not path.is_dir():
            raise CheckpointError(f"ensemble manifest {manifest}: members[{i}] {path} is not a directory")
        if rundir.RunDir(path).ensemble.exists():
            raise CheckpointError(
                f"ensemble manifest {manifest}: members[{i}] {path} is an ensemble itself; list its members"
            )
        if any(path.resolve() == p.resolve() for p in paths):
            raise CheckpointError(f"ensemble manifest {manifest}: members[{i}] {path} is listed twice")
        paths.append(path)
    return paths


def ensemble_member(target: str | Path, member: int | None, flag: str = "--member") -> Path:
    """`target`, or with `member` the run directory of that member of the ensemble in `target`. For what takes
    one model (export): an ensemble without `member` is refused with what to give instead, and so is
    `member` of a single run."""
    is_ensemble = Path(target).is_dir() and rundir.RunDir(target).ensemble.exists()
    if member is None and not is_ensemble:
        return Path(target)
    if not is_ensemble:
        raise CheckpointError(f"{flag} {member}: {target} is not an ensemble (it has no {rundir.ENSEMBLE})")
    members = ensemble_members(target)
    if member is None:
        raise CheckpointError(
            f"{target} is an ensemble of {len(members)} members, not one model: pick one with {flag} K "
            f"(0 to {len(members) - 1}), or give a member's run directory ({members[0]})"
        )
    if not 0 <= member < len(members):
        raise CheckpointError(f"{flag} {member}: {target} has members 0 to {len(members) - 1}")
    return members[member]


def load_ensemble(target: str | Path, device: str = "auto") -> LoadedModel:
    """Every member of the ensemble in `target` (each loaded and verified as `load_model` does), as one
    `Ensemble`; the returned checkpoint and metadata are member 0's, with "members" (their checkpoints)
    added to the metadata."""
    loaded = [load_model(p, device) for p in ensemble_members(target)]
    data_dirs = {str(m.data_dir) for m in loaded}
    if len(data_dirs) != 1:
        raise CheckpointError(
            f"ensemble {target}: its members trained on different data directories ({sorted(data_dirs)}); "
            "an ensemble's members must share the tokenizer and the data"
        )
    try:
        model = Ensemble([cast(Transformer, m.model) for m in loaded])  # ensemble_members refuses nesting
    except ValueError as e:
        raise CheckpointError(f"ensemble {target}: {e}") from None
    meta = dict(loaded[0].meta, members=[str(m.checkpoint) for m in loaded])
    return LoadedModel(model, loaded[0].checkpoint, meta, Path(target))


def assemble_ensemble(runs: list[str | Path], out: str | Path) -> Path:
    """Write `out`/ensemble.json listing the finished `runs` (run or checkpoint directories) as one ensemble;
    returns its path. Each member is verified (every file hashed once, no weight loaded) and must share the
    first's tokenizer, vocabulary and seq_len (the error names the run). A member inside `out` is written
    relative to it, any other absolute. An existing manifest (or anything else at its path) is never
    replaced."""
    out = Path(out)
    manifest = rundir.RunDir(out).ensemble
    if os.path.lexists(manifest):
        raise CheckpointError(f"{manifest} exists; choose another --out (an ensemble is never overwritten)")
    if not 1 <= len(runs) <= MAX_MEMBERS:
        raise CheckpointError(f"an ensemble lists 1 to {MAX_MEMBERS} runs, got {len(runs)}")
    entries: list[str] = []
    first: tuple[Path, dict[str, Any]] | None = None
    for run in map(Path, runs):
        if run.is_dir() and rundir.RunDir(run).ensemble.exists():
            raise CheckpointError(f"{run} is an ensemble itself; list its members instead")
        path, _, meta, cfg = verified_model(run)
        shape = {
            "tokenizer": (meta.get("data_tokenizer") or {}).get("xxhash"),
            "vocab_size": cfg.vocab_size,
            "seq_len": cfg.seq_len,
        }
        if first is None:
            first = (run, shape)
        for key, value in shape.items():
            if value != first[1][key]:
                raise CheckpointError(
                    f"{run}: its {key} ({value}) is not {first[0]}'s ({first[1][key]}); an ensemble's members "
                    "share the tokenizer, the vocabulary and seq_len"
                )
        member = run.resolve()
        entry = member.relative_to(out.resolve()) if member.is_relative_to(out.resolve()) else member
        if str(entry) in entries or str(entry) == ".":
            raise CheckpointError(f"{run} is listed twice (or is --out itself)")
        entries.append(str(entry))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(manifest, {"members": entries})
    return manifest


def _model_config(path: Path, recorded: dict[str, Any]) -> ModelConfig:
    """The manifest's model config, complete (every derived field filled in) and valid."""
    try:
        cfg = cfglib.from_dict(ModelConfig, recorded, "model")
        cfg.validate()
        if cfg.resolved(cfg.vocab_size) != cfg:
            raise ConfigError(
                "it is not a resolved config (every derived field filled in, vocabulary padded)"
            )
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {path}: {ckpt.MANIFEST} field 'model' is invalid: {e}") from None
    return cfg
