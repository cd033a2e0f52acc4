"""Distillation: the teacher a run learns from (`train.distill_from`), and what the run records of it.

The teacher (a run, a checkpoint, or an ensemble's members: tenx.checkpoint.models.load_model) is loaded
once when a run's parts are built, on the training device, frozen and in eval mode. On each micro-batch it
runs under no_grad on the same input tokens, inside the step's autocast, and hands the student's loss its
output layers' inputs (tenx.model.soft_targets.SoftTargets): the loss is then
(1 - w) * CE(data targets) + w * H(teacher, student) (tenx.model.transformer.linear_cross_entropy). Every
data-parallel rank holds its own copy of the teacher.

What identifies a teacher is the checkpoints it was loaded from and their manifests' digests: a checkpoint
of the run records them (a resume refuses another teacher), run.json records them with the teacher's
parameters and forward FLOPs per token (`teacher_forward_flops`), and `tenx replay` loads the teacher the
run recorded or refuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from tenx import checkpoint as ckpt
from tenx import rundir
from tenx.checkpoint.models import load_model
from tenx.errors import CheckpointError, ConfigError, TenxError
from tenx.model.config import ModelConfig
from tenx.model.ensemble import Ensemble
from tenx.model.flops import count_params, flops_per_token
from tenx.model.soft_targets import SoftTargets
from tenx.model.transformer import Transformer
from tenx.train.config import RunConfig
from tenx.utils.io import read_json_object


@dataclass
class Teacher:
    """A frozen teacher on the training device, the weight of its term, and what the run records of it."""

    model: Transformer | Ensemble
    weight: float
    record: dict[str, Any]
    """What run.json records: path, sources (the checkpoints loaded: each one's path and manifest digest),
    members, params, forward_flops_per_token (at the student's sequence length; an ensemble's: the sum of
    its members')."""

    @property
    def members(self) -> list[Transformer]:
        """The models whose probabilities the teacher averages (one, unless it is an ensemble)."""
        return _members(self.model)

    @property
    def identity(self) -> dict[str, Any]:
        """What a checkpoint records of the teacher, so that a resume can tell it is the same."""
        return {"path": self.record["path"], "sources": self.record["sources"]}

    def soft_targets(self, tokens_BT: torch.Tensor) -> SoftTargets:
        """The teacher on `tokens_BT`, without gradients: its members' output-layer inputs for each token."""
        with torch.no_grad():
            hidden = [m.features(tokens_BT).flatten(0, 1) for m in self.members]
        return SoftTargets(hidden, [m.lm_head.weight for m in self.members], self.weight)


def load_teacher(
    cfg: RunConfig, model_cfg: ModelConfig, tokenizer: Mapping[str, Any], device: torch.device
) -> Teacher | None:
    """The teacher `cfg.train.distill_from` names (None when empty), checked against the student's resolved
    `model_cfg` and the run's data tokenizer (the data manifest's entry); errors name train.distill_from."""
    source = cfg.train.distill_from
    if not source:
        return None
    where = f"train.distill_from={source!r}"
    try:
        loaded = load_model(source, str(device))
        paths = [Path(p) for p in loaded.meta.get("members", [loaded.checkpoint])]
        metas = [loaded.meta] if len(paths) == 1 else [ckpt.read_checkpoint_meta(p) for p in paths]
    except CheckpointError as e:  # its kind kept: a forged checkpoint stays an UnsafeCheckpointError
        raise type(e)(f"{where}: cannot load the teacher: {e}") from None
    model = loaded.model
    if model.cfg.vocab_size != model_cfg.vocab_size:
        raise ConfigError(
            f"{where}: the teacher's vocabulary has {model.cfg.vocab_size} entries, the student's "
            f"{model_cfg.vocab_size}: a teacher must predict the student's vocabulary"
        )
    if model.cfg.seq_len < model_cfg.seq_len:
        raise ConfigError(
            f"{where}: the teacher reads at most {model.cfg.seq_len} tokens (its model.seq_len), the student "
            f"{model_cfg.seq_len}"
        )
    for path, meta in zip(paths, metas, strict=True):
        trained = meta.get("data_tokenizer")
        trained = trained if isinstance(trained, dict) else {}
        for key in ("xxhash", "vocab_size"):
            if trained.get(key) != tokenizer.get(key):
                raise ConfigError(
                    f"{where}: checkpoint {path} was trained with a tokenizer whose {key} is "
                    f"{trained.get(key)!r}, the run's data ({cfg.data.dir}) has {tokenizer.get(key)!r}: a "
                    "teacher must have been trained on the same tokenizer"
                )
    model.requires_grad_(False)
    model.eval()
    members = _members(model)
    record = {
        "path": str(Path(source).resolve()),
        "sources": [
            {"path": str(p.resolve()), "manifest_xxhash": m.get("manifest_xxhash")}
            for p, m in zip(paths, metas, strict=True)
        ],
        "members": len(members),
        "params": sum(count_params(m.cfg).total for m in members),
        # forward = a third of training's forward + backward, at the student's windows' length
        "forward_flops_per_token": sum(flops_per_token(m.cfg, model_cfg.seq_len) // 3 for m in members),
    }
    return Teacher(model, cfg.train.distill_weight, record)


def _members(model: Transformer | Ensemble) -> list[Transformer]:
    return cast(list[Transformer], list(model.members)) if isinstance(model, Ensemble) else [model]


def _fingerprint(recorded: Any) -> list[Any] | None:
    """A recorded teacher's checkpoints, each as its manifest digest (its path where none was recorded);
    None for what is not a teacher record (untrusted input: a checkpoint's manifest, run.json)."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("sources"), list):
        return None
    return [
        c.get("manifest_xxhash") or c.get("path") if isinstance(c, dict) else c for c in recorded["sources"]
    ]


def _describe(recorded: Any) -> str:
    if not isinstance(recorded, dict):
        return "no teacher"
    return f"the teacher {str(recorded.get('path'))[:200]!r} (checkpoints {_fingerprint(recorded)})"


def check_same_teacher(checkpoint: Path, saved: Any, teacher: Teacher | None) -> None:
    """CheckpointError, naming train.distill_from, when the checkpoint was trained with another teacher than
    `teacher` (or with one where this run has none, or none where it has one)."""
    ours = teacher.identity if teacher is not None else None
    if _fingerprint(saved) == _fingerprint(ours):
        return
    raise CheckpointError(
        f"checkpoint {checkpoint} was trained with {_describe(saved)}, but train.distill_from now loads "
        f"{_describe(ours)}: resuming would change the run's objective midway; give train.distill_from the "
        "teacher the run was trained with"
    )


def replay_teacher(
    cfg: RunConfig,
    provenance: Mapping[str, Any],
    model_cfg: ModelConfig,
    tokenizer: Mapping[str, Any],
    device: torch.device,
) -> Teacher | None:
    """The teacher `tenx replay` re-executes a run's steps with: the one the run recorded (run.json), loaded
    again from train.distill_from; a TenxError when that now loads another one, or the run recorded none."""
    recorded = provenance.get("teacher")
    if not cfg.train.distill_from and recorded is None:
        return None
    teacher = load_teacher(cfg, model_cfg, tokenizer, device)
    now = teacher.record if teacher is not None else None
    if _fingerprint(recorded) != _fingerprint(now):
        raise TenxError(
            f"cannot replay the run: it trained with {_describe(recorded)} ({rundir.PROVENANCE}), but "
            f"train.distill_from now loads {_describe(now)}; restore the teacher it trained with"
        )
    return teacher


def teacher_forward_flops(run: str | Path | Mapping[str, Any]) -> float:
    """The forward FLOPs per training token a run spent in its teacher (0.0 without one; an ensemble: the
    sum of its members'): from a run directory's run.json, or from run.json's contents or its teacher record
    given as a mapping. A distilled run's compute is (run.json's flops_per_token + this) per token."""
    prov = run if isinstance(run, Mapping) else read_json_object(rundir.RunDir(run).provenance)
    record = prov if "forward_flops_per_token" in prov else prov.get("teacher")
    value = record.get("forward_flops_per_token") if isinstance(record, Mapping) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0
