"""The Trainer's state management: save, load, resume, roll back, heal from a peer, provenance.

`TrainerState` holds the methods; the Trainer (tenx/train/trainer.py) inherits them, so they run on the
Trainer's parts. Everything needed to continue a run bit for bit goes into a checkpoint: DCP tensors
(model, optimizer state, torch RNG) and a JSON manifest (counters, loader position, Python and NumPy RNG,
callback and guard state, the resolved config). Every load, whatever its source, ends with the
`post_state_loaded` event.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import tenx
from tenx import checkpoint as ckpt
from tenx import config as cfglib
from tenx.errors import CheckpointError, DataError, TenxError
from tenx.hardware import hardware_summary
from tenx.parallel.distributed import broadcast_object
from tenx.rundir import step_of
from tenx.train.config import RunConfig
from tenx.train.distill import check_same_teacher
from tenx.train.hooks import Callback
from tenx.train.parts import TrainerParts, memory_tier_dir
from tenx.train.rng import numpy_rng_state, python_rng_state, set_numpy_rng_state, set_python_rng_state
from tenx.utils.cpus import env_threads
from tenx.utils.io import atomic_write_json, atomic_write_text

# The manifest fields a resume reads (loader.* are the ones TokenLoader.load_state_dict needs).
_RESUME_FIELDS = (
    "model",
    "tokens",
    "optim_param_groups",
    "python_rng",
    "numpy_rng",
    "callbacks",
    "loader.epoch",
    "loader.cursor",
    "loader.seed",
    "loader.num_windows",
)


def git_commit() -> str | None:
    """The commit of the tenx source tree, when it is a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(tenx.__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


class TrainerState(TrainerParts):
    """Save, load, resume, rollback and healing for the Trainer (mixed into it; see the module doc).

    Its contract with the Trainer: the parts, under the names of TrainerParts; the counters and flags
    below, which the Trainer's `__init__` starts (`_start_counters`) and these methods read and replace;
    and `_emit`.
    """

    cfg: RunConfig
    callbacks: list[Callback]
    """Their state goes into every checkpoint, under each one's `name`."""
    step: int
    tokens_seen: int
    rollbacks: int
    resumed_from: Path | None
    """The checkpoint the state was last loaded from."""
    _rollback_due: bool
    """The guard saw max_bad_steps bad steps in a row: the loop calls `rollback` at the step's end."""

    def _start_counters(self) -> None:
        """The counters and flags above as a run that has taken no step yet has them."""
        self.step = 0
        self.tokens_seen = 0
        self.resumed_from = None
        self.rollbacks = 0
        self._rollback_due = False

    def _emit(self, event: str, *args: Any) -> None:
        raise NotImplementedError  # the Trainer dispatches hook events to its callbacks

    def state_replaced(self, source: str) -> None:
        """Send every callback `post_state_loaded(source)` (TrainerView)."""
        self._emit("post_state_loaded", source)

    def rollback(self) -> Path:
        """Reload the newest verified checkpoint before the current streak of bad steps; skip their data."""
        streak = list(self.guard.streak)
        first_bad = streak[0]["step"]
        skip = [streak[0]["position"][0], streak[-1]["position"][1]]
        self._rollback_due = False
        self.rollbacks += 1
        if self.rollbacks > self.cfg.guard.max_rollbacks:
            raise TenxError(
                f"guard: {len(streak)} bad steps in a row from step {first_bad}, and already "
                f"{self.cfg.guard.max_rollbacks} rollbacks (guard.max_rollbacks); the run is unstable: "
                "lower optim.lr, check the data named in events.jsonl, or raise guard.max_rollbacks"
            )
        self.checkpointer.wait()
        # a forged checkpoint (UnsafeCheckpointError) stops the run; a damaged one is skipped for an older one
        target, skipped = ckpt.latest_verified(self.rundir.checkpoints, before_step=first_bad)
        for note in skipped:
            print(f"tenx: guard: skipping checkpoint that does not verify: {note}")
        if target is None:
            raise TenxError(
                f"guard: {len(streak)} bad steps in a row from step {first_bad} and no verified checkpoint "
                "before them to roll back to; save checkpoints more often (checkpoint.every)"
            )
        from_step = self.step
        self.data_skips.append(skip)
        atomic_write_json(self.rundir.data_skips, {"skips": self.data_skips})
        self.load_checkpoint(target, source="rollback")
        self.events.emit(
            "rollback",
            from_step,
            to_step=self.step,
            checkpoint=str(target),
            bad_steps=[b["step"] for b in streak],
            skipped_positions=skip,
            rollbacks=self.rollbacks,
        )
        if self.ledger is not None:
            self.ledger.rollback(from_step, self.step)
        print(
            f"tenx: guard: {len(streak)} bad steps from step {first_bad}; rolled back to step {self.step} "
            f"and skipped the data they read (loader positions {skip[0]}..{skip[1]})"
        )
        return target

    def clear_memory_tier(self) -> None:
        """Free the in-memory tier (a fresh start, or training finished)."""
        if self.memory_checkpointer is not None:
            self.memory_checkpointer.wait()
        # only what tenx wrote there: checkpoint.memory_dir may name a directory that holds the user's files
        root = memory_tier_dir(self.cfg, self.rundir)
        if not root.is_dir() or root.is_symlink():
            return
        ckpt.clean_interrupted_saves(root)
        for _, path in ckpt.list_checkpoints(root):
            shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):
            root.rmdir()  # only when nothing else is left in it

    def _state_tensors(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Every tensor of the training state (for DCP), and the optimizer's plain-data param groups (JSON).

        Keeping non-tensor state out of DCP means loading it never needs a pickle.
        """
        optim = get_optimizer_state_dict(self.model, self.optimizer)
        tensors: dict[str, Any] = {
            "model": get_model_state_dict(self.model),
            "optim": {"state": optim["state"]},
            "rng": {"torch": torch.get_rng_state()},
        }
        if self.device.type == "cuda":
            tensors["rng"]["cuda"] = torch.cuda.get_rng_state(self.device)
        return tensors, list(optim["param_groups"])  # type: ignore[arg-type]

    def save_checkpoint(self, tier: str = "disk") -> float:
        """Save everything needed to continue this run bit for bit; returns the seconds the loop was blocked.

        With `checkpoint.async_save` the loop blocks only while the state is copied in memory; the files
        are written, hashed and published in the background (`self.checkpointer`).
        """
        t0 = time.perf_counter()
        tensors, param_groups = self._state_tensors()
        meta_step = self.step
        meta = {
            "optim_param_groups": param_groups,
            "data_dir": str(Path(self.cfg.data.dir).resolve()),
            "tokens": self.tokens_seen,
            "loader": self.loader.state_dict(),
            "python_rng": python_rng_state(),
            "numpy_rng": numpy_rng_state(),
            "callbacks": {cb.name: cb.state_dict() for cb in self.callbacks},
            "guard": self.guard.state_dict(),
            "config": cfglib.to_dict(self.cfg),
            "model": cfglib.to_dict(self.model_cfg),
            "data_tokenizer": self.data_manifest["tokenizer"],
            "tenx_version": tenx.__version__,
            "run_id": self.run_id(),
            "world_size": self.world_size,
            "strategy": self.strategy,
            "threads": torch.get_num_threads(),  # part of the numerics: a count orders float reductions
            **({"replicas": self.replicas.state_dict()} if self.replicas is not None else {}),
            **({"teacher": self.teacher.identity} if self.teacher is not None else {}),
        }
        checkpointer = self.memory_checkpointer if tier == "memory" else self.checkpointer
        assert checkpointer is not None, "checkpoint.memory_every is 0: there is no in-memory tier"
        checkpointer.save(
            self.step,
            tensors,
            meta,
            before_publish=(lambda tmp: self._emit("post_checkpoint_saved", tmp, meta_step))
            if tier == "disk"
            else None,
        )
        blocked = time.perf_counter() - t0  # state dicts and metadata included, not just the snapshot
        if self.ledger is not None:
            self.ledger.checkpoint(self.step, blocked)
        return blocked

    def load_checkpoint(self, path: str | Path, source: str = "resume") -> None:
        """Restore model, optimizer, loader, RNGs, counters and callback state from a checkpoint.

        The manifest's fields are type-checked when read (checkpoint.validate_manifest); a value that is
        well-typed but still cannot be applied (an RNG state of the wrong length, a param group that does
        not fit this optimizer) is a CheckpointError naming the checkpoint, not a traceback.
        """
        # Rank 0 verifies first, so a forged checkpoint is named as such whatever model it claims to hold.
        read = ckpt.verify_checkpoint if self.rank == 0 else ckpt.read_checkpoint_meta
        saved = read(path, require=("model",))
        check_same_teacher(Path(path), saved.get("teacher"), self.teacher)  # the objective it trained on
        saved_model = saved["model"]
        ours = cfglib.to_dict(self.model_cfg)
        if isinstance(saved_model, dict):  # a field added since the checkpoint was written: its default then
            defaults = cfglib.to_dict(type(self.model_cfg)())
            added = (ours.keys() - saved_model.keys()) & defaults.keys()  # (None defaults are not listed)
            saved_model = {**{k: defaults[k] for k in added}, **saved_model}
        if saved_model != ours:
            diff = ", ".join(
                f"{k}: {saved_model.get(k)!r} in the checkpoint, {ours.get(k)!r} here"
                for k in sorted(set(saved_model) | set(ours))
                if saved_model.get(k) != ours.get(k)
            )
            raise CheckpointError(f"checkpoint {path} holds a different model ({diff})")
        tensors, _ = self._state_tensors()
        meta = ckpt.load_checkpoint(
            path,
            tensors,
            process_group=self.checkpoint_group,
            verify=False,  # verified above
            require=_RESUME_FIELDS,
        )
        try:
            self._restore_state(tensors, meta)
        except DataError as e:  # the loader's position was saved for other data
            raise CheckpointError(f"checkpoint {path}: {e}") from None
        except (KeyError, IndexError, TypeError, ValueError, OverflowError, RuntimeError) as e:
            raise CheckpointError(
                f"checkpoint {path}: its training state cannot be restored ({type(e).__name__}: {e})"
            ) from None
        self.resumed_from = Path(path)
        self._resume_threads(meta.get("threads"), source)
        self._emit("post_state_loaded", source)

    def _resume_threads(self, saved: Any, source: str) -> None:
        """Take the torch thread count the checkpoint was written with: it orders float reductions, so it
        is part of the run's numerics, and a count chosen anew from this moment's load would make the resumed
        run differ from the uninterrupted one. A count the user gives (train.threads, OMP_NUM_THREADS) or a
        run that follows the load (train.follow_load) keeps its own, and a difference is said."""
        now = torch.get_num_threads()
        if not isinstance(saved, int) or saved < 1 or saved == now or source != "resume":
            return
        given = self.cfg.train.threads is not None or env_threads() is not None
        if given or self.cfg.train.follow_load:
            why = "train.follow_load" if not given else "a count given (train.threads or OMP_NUM_THREADS)"
            self.events.emit("threads-differ", self.step, saved=saved, threads=now, why=why)
            if self.rank == 0:
                print(
                    f"tenx: resuming on {now} torch threads where the run used {saved} ({why}): steps from "
                    "here are no longer bit for bit those of an uninterrupted run",
                    file=sys.stderr,
                )
            return
        torch.set_num_threads(saved)
        self.events.emit("threads-restored", self.step, saved=saved, chosen=now)
        if self.rank == 0:
            print(
                f"tenx: resuming on the {saved} torch threads the run used (the count is part of its numerics; "
                f"this moment's load gave {now}; --set train.threads=N to choose)",
                file=sys.stderr,
            )

    def _restore_state(self, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
        self._apply_state(
            tensors["model"],
            {"state": tensors["optim"]["state"], "param_groups": meta["optim_param_groups"]},
            meta,
        )
        torch.set_rng_state(tensors["rng"]["torch"])
        if "cuda" in tensors["rng"]:
            torch.cuda.set_rng_state(tensors["rng"]["cuda"], self.device)
        set_python_rng_state(meta["python_rng"])
        set_numpy_rng_state(meta["numpy_rng"])
        self._rollback_due = False
        for cb in self.callbacks:
            cb.load_state_dict(meta["callbacks"].get(cb.name, {}))
        if self.replicas is not None and "replicas" in meta:
            self.replicas.load_state_dict(meta["replicas"])

    def _apply_state(self, model: Any, optim: Any, counters: dict[str, Any]) -> None:
        """Model, optimizer, step and token counters, loader position (plus this run's data skips) and guard:
        what a checkpoint and a peer's state have in common."""
        set_model_state_dict(self.model, model)
        set_optimizer_state_dict(self.model, self.optimizer, optim)
        self.step, self.tokens_seen = int(counters["step"]), int(counters["tokens"])
        self.loader.load_state_dict(counters["loader"])
        for start, end in self.data_skips:  # skips recorded after this state was saved
            self.loader.add_skip(start, end)
        self.guard.load_state_dict(counters.get("guard", {}))

    # ----- healing from a live peer group (torchft) ----------------------------------------------------
    def replica_state_dict(self) -> dict[str, Any]:
        """Everything a healing replica group needs from a live peer: weights, optimizer, counters, data position."""
        return {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optimizer),
            "trainer": {
                "step": self.step,
                "tokens": self.tokens_seen,
                "loader": self.loader.state_dict(),
                "guard": self.guard.state_dict(),
            },
        }

    def load_replica_state_dict(self, state: dict[str, Any]) -> None:
        """Take a peer group's state (see replica_state_dict); the loader position is global, so it is ours too."""
        self._apply_state(state["model"], state["optim"], state["trainer"])
        self._emit("post_state_loaded", "heal")

    def resume(self, how: str) -> Path | None:
        """`auto`: the newest checkpoint of this run that verifies (none: start fresh); else a path.

        Several ranks: rank 0 chooses (and verifies) and every rank loads its own shards of that one.
        """
        if how == "auto":
            path = self._newest_checkpoint() if self.rank == 0 else None
            chosen = broadcast_object(str(path) if path else None, self.world_size, self.checkpoint_group)
            path = Path(chosen) if chosen else None
            if path is None:
                return None
        else:
            path = Path(how)
        self.load_checkpoint(path)
        return path

    def _newest_checkpoint(self) -> Path | None:
        """The newest checkpoint that verifies, of either tier; notes the ones that do not."""
        path, skipped = ckpt.latest_verified(self.rundir.checkpoints)
        if self.memory_checkpointer is not None:
            memory, skipped_memory = ckpt.latest_verified(memory_tier_dir(self.cfg, self.rundir))
            skipped += skipped_memory
            if memory is not None and ckpt.read_checkpoint_meta(memory).get("run_id") != self.run_id():
                skipped.append(f"checkpoint {memory} belongs to an earlier run in this directory")
                memory = None
            if memory is not None and (path is None or (step_of(memory) or 0) > (step_of(path) or 0)):
                path = memory
        for note in skipped:
            print(f"tenx: skipping checkpoint that does not verify: {note}")
        return path

    def run_id(self) -> str:
        """This run directory's identity (made on first use), so no other run's in-memory snapshot is loaded."""
        path = self.rundir.run_id
        if not path.exists():
            self.rundir.root.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, uuid.uuid4().hex)
        return path.read_text().strip()

    def write_provenance(self) -> None:
        """Record the resolved config, version, commit and hardware in the run directory."""
        self.rundir.root.mkdir(parents=True, exist_ok=True)
        teacher_flops = self.teacher.record["forward_flops_per_token"] if self.teacher is not None else 0
        atomic_write_text(self.rundir.config, cfglib.dumps_toml(self.cfg))
        atomic_write_json(
            self.rundir.provenance,
            {
                "tenx_version": tenx.__version__,
                "git_commit": git_commit(),
                "hardware": hardware_summary(self.device),
                "precision": str(self.amp_dtype).replace("torch.", ""),
                "model": cfglib.to_dict(self.model_cfg),
                "params": {"total": self.params.total, "non_embedding": self.params.non_embedding},
                "flops_per_token": self.flops_per_token,
                # with a teacher, the run's compute per token adds its forward (MFU counts the student's alone)
                "run_flops_per_token": self.flops_per_token + teacher_flops,
                "teacher": self.teacher.record if self.teacher is not None else None,
                "peak_flops": self.peak_flops,
                "tokens_per_step": self.tokens_per_step,
                "total_steps": self.total_steps,
                "data": {
                    "dir": str(Path(self.cfg.data.dir).resolve()),
                    "tokenizer": self.data_manifest["tokenizer"],
                    "train_tokens": len(self.train_stream),
                },
                "world_size": self.world_size,
                "strategy": self.strategy,
                "data_parallel": self.data_parallel,
                "grad_accum": self.grad_accum,
                "resumed_from": str(self.resumed_from) if self.resumed_from else None,
                **{key: value for cb in self.callbacks for key, value in cb.provenance().items()},
            },
        )
