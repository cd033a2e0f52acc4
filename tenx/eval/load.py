"""Load a trained model for evaluation or sampling from a run directory or a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from tenx import config as cfglib
from tenx.errors import CheckpointError
from tenx.model.config import ModelConfig
from tenx.model.transformer import Transformer
from tenx.plan.hardware import pick_device, tune_cpu_allocator
from tenx.train import checkpoint as ckpt


@dataclass
class LoadedModel:
    """A model restored from a checkpoint, with what is needed to use it."""

    model: Transformer
    checkpoint: Path
    meta: dict[str, Any]
    run_dir: Path | None

    @property
    def data_dir(self) -> Path:
        """The prepared data directory the model was trained on (absolute, so any working directory works)."""
        return Path(self.meta.get("data_dir") or self.meta["config"]["data"]["dir"])


def resolve_checkpoint(target: str | Path) -> tuple[Path, Path | None]:
    """(checkpoint dir, run dir or None) for a run directory (newest verified checkpoint) or a checkpoint."""
    target = Path(target)
    if (target / ckpt.MANIFEST).exists() or ckpt._STEP_DIR.match(target.name):
        run_dir = target.parent.parent if target.parent.name == "checkpoints" else None
        return target, run_dir
    if not target.exists():
        raise CheckpointError(f"{target} does not exist; give a run directory or a checkpoint directory")
    path, skipped = ckpt.latest_verified(target / "checkpoints")
    if path is None:
        detail = f" ({'; '.join(skipped)})" if skipped else ""
        raise CheckpointError(f"run directory {target} has no checkpoint that verifies{detail}")
    return path, target


def load_model(target: str | Path, device: str = "auto") -> LoadedModel:
    """Rebuild the model recorded in the checkpoint and load its weights (no optimizer state)."""
    path, run_dir = resolve_checkpoint(target)
    model_cfg = cfglib.from_dict(ModelConfig, ckpt.read_checkpoint_meta(path)["model"])
    dev = pick_device(device)
    if dev.type == "cpu":
        tune_cpu_allocator()
    model = Transformer(model_cfg).to(dev)
    tensors = {"model": get_model_state_dict(model)}
    meta = ckpt.load_checkpoint(path, tensors)  # verifies every file's checksum first
    set_model_state_dict(model, tensors["model"])
    model.eval()
    return LoadedModel(model, path, meta, run_dir)
