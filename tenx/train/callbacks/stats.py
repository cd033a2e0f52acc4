"""Statistics inside the model every `monitor.stats_every` steps (names and maths: tenx/monitor/internals.py).

On a stats step the callback reads the gradients and parameters from `pre_optim_step`, the optimizer's
change from `on_step_end`, and runs one probe forward without gradients, in the training precision, on a
fixed micro-batch of the validation split (the training split when there is none). The probe sees each
block's output and asks each attention layer for its largest logit; being a separate eager call of the
model, it leaves the training forward, its compiled graph and its memory untouched, and draws no random
numbers, so a run with statistics trains exactly as one without. The probe's input is the same at every
stats step, so a growing statistic shows a change of the model, not of the data. On validation data its
logits also give the loss per data source (tenx/monitor/source_loss.py).

Other steps pay nothing: no hook is registered and no flag is set outside stats steps. A stats step
pays for the probe, a copy of the parameters (for ||Δθ||) and one all-gather of a few numbers per layer
across ranks: 0.45 of a step on the quickstart config, 0.5% of the step time at the default interval of
100 (bench/monitor_overhead.py).

A rank's step time runs from the end of the previous step (where the loop's end-of-step check last
brought the ranks together) to its last gradient being computed, before the data-parallel gradient
reduction waits for the other ranks (post-accumulate-grad hooks, on stats steps only). So a straggler
shows a longer time than its peers, where the trainer's `step_time_s` shows every rank the slowest one's.
It covers the rank's data loading, forward and backward and the callbacks after this one (rank 0 writes
the metrics). Under FSDP, whose sharded parameters have no such hook and whose forward gathers
parameters from every rank, it runs to the optimizer step and includes those waits. So does DDP's
broadcast of the model's buffers at the start of each forward (the llama family's RoPE tables, while the
wrapper is built with DDP's default `broadcast_buffers=True`): the ranks meet there too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from tenx.data.loader import TokenStream, sequential_windows, spread_windows
from tenx.model.transformer import Transformer
from tenx.monitor.internals import (
    activation_moments,
    group_sums,
    layer_index,
    logit_stats,
    peak_memory_gib,
    rank_key,
    rms_and_max,
    squared_norms,
    stat_key,
    update_ratio,
)
from tenx.monitor.source_loss import LOSS_SOURCE, loss_by_source, probe_sources
from tenx.train.hooks import Callback, TrainerView

_PER_RANK = ("step_time_s", "memory_gib")


def _local(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The part of `t` this rank holds, and whether other ranks hold the rest (an FSDP DTensor shard)."""
    to_local = getattr(t, "to_local", None)
    return (to_local(), True) if callable(to_local) else (t, False)


class _Clock:
    """One rank's time from its creation to the latest `mark()`: wall clock, or CUDA events on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start = self._now()
        self.last: Any = None

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self) -> None:
        self.last = self._now()

    def seconds(self) -> float:
        """Start to the latest mark (to now when nothing was marked)."""
        end = self.last if self.last is not None else self._now()
        if self.cuda:
            end.synchronize()
            return self.start.elapsed_time(end) / 1000
        return end - self.start


class ModelProbe:
    """The statistics' probe: one forward without gradients on a fixed micro-batch of `rows` windows of the
    validation split (of the training split when there is none). Replay (tenx.triage.replay) runs it on
    the steps where the run did, since it is part of what those steps executed."""

    def __init__(
        self,
        train_stream: TokenStream,
        val_stream: TokenStream | None,
        seq_len: int,
        rows: int,
        device: torch.device,
    ) -> None:
        stream = val_stream if val_stream is not None else train_stream
        inputs, targets = next(iter(sequential_windows(stream, seq_len, rows, 1)))
        self.inputs = inputs.to(device)
        self.sources: tuple[list[str], torch.Tensor, torch.Tensor] | None = None
        """On validation data with data sources (tenx.monitor.source_loss): their names, the targets and
        each target's source."""
        if val_stream is not None:  # the loss per data source, of validation tokens only
            windows = spread_windows(len(stream), seq_len, rows)  # the windows of the probe's rows
            names, index = probe_sources(stream, windows, seq_len)
            if names:
                self.sources = (names, targets.to(device), torch.from_numpy(index).to(device))

    @torch.no_grad()
    def figures(
        self, model: Transformer, autocast: Callable[[], AbstractContextManager[Any]]
    ) -> torch.Tensor:
        """The output logits' statistics, then each block's activation moments and largest attention logit
        (4 figures a block), then the loss of each data source: one vector on the model's device."""
        moments: dict[int, torch.Tensor] = {}

        def observe(i: int, x_BTD: torch.Tensor) -> None:
            moments[i] = activation_moments(x_BTD)

        attentions: list[Any] = [block.attn for block in model.blocks]  # Attention modules
        for attn in attentions:
            attn.record_logit_max = True
        try:
            with autocast():
                logits = model(self.inputs, on_block_output=observe)
            by_source = []
            if self.sources is not None:
                names, targets, index = self.sources
                by_source.append(loss_by_source(logits, targets, index, len(names)))
            return torch.cat(
                [
                    logit_stats(logits),
                    *(
                        torch.stack([moments[i][0], moments[i][1], moments[i][2], a.logit_max])
                        for i, a in enumerate(attentions)
                    ),
                    *by_source,
                ]
            )
        finally:
            for attn in attentions:
                attn.record_logit_max, attn.logit_max = False, None


class ModelStats(Callback):
    """Adds the `stats/...` figures of tenx.monitor.internals to the metrics of every `every`-th step."""

    name = "stats"

    def __init__(self, every: int) -> None:
        self.every = every
        self._active = False
        self._hooks: list[Any] = []
        self._clock: _Clock | None = None
        self._probe: ModelProbe | None = None
        self._layers: list[str] = []
        """The model's layers (block indices, then embed / head / norm), in the order of tenx.monitor.internals."""
        self._index: list[int] = []
        """Each parameter's position in `_layers`."""
        self._shard_mask: list[bool] = []
        """Whether each parameter is an FSDP DTensor (each rank holds a shard)."""
        self._step_time = 0.0
        self._memory = 0.0
        self._sharded: dict[str, torch.Tensor] = {}
        """Squared norms per layer over the parameter shards this rank holds (summed over ranks later)."""
        self._replicated: dict[str, torch.Tensor] = {}
        """Squared norms per layer over parameters every rank holds whole."""
        self._before: list[torch.Tensor] = []
        self._model_stats: dict[str, Any] = {}

    # -- hook events -------------------------------------------------------------------------------
    def on_train_start(self, trainer: TrainerView) -> None:
        self._arm(trainer)

    def on_step_start(self, trainer: TrainerView) -> None:
        if self._active:  # the last attempt was not committed: the step is taken again, timed afresh
            self._finish()
            self._arm(trainer)
        self._active = self._due(trainer.step + 1)
        if not self._active:
            return
        if trainer.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.device)
        clock = self._clock if self._clock is not None else _Clock(trainer.device)
        self._clock = clock
        for p in trainer.raw_model.parameters():
            if p.requires_grad and not _local(p)[1]:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda _: clock.mark()))

    def pre_optim_step(self, trainer: TrainerView) -> None:
        if not self._active:
            return
        assert self._clock is not None
        self._step_time = self._clock.seconds()
        self._remove_hooks()
        self._memory = peak_memory_gib(trainer.device)
        names, params = zip(*trainer.raw_model.named_parameters())
        if not self._layers:
            self._layers, self._index = layer_index(names)
            self._shard_mask = [_local(p)[1] for p in params]
        grads = [(i, _local(p.grad)[0]) for i, p in enumerate(params) if p.grad is not None]
        self._add_norms(trainer, "grad", [i for i, _ in grads], [g for _, g in grads])
        local_params = [_local(p)[0].detach() for p in params]
        self._add_norms(trainer, "param", range(len(params)), local_params)
        self._before = [p.clone() for p in local_params]
        self._model_stats = self._probe_forward(trainer)

    def on_step_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        if self._active:
            params = list(trainer.raw_model.parameters())
            deltas = [_local(p)[0].detach() - before for p, before in zip(params, self._before, strict=True)]
            self._add_norms(trainer, "update", range(len(params)), deltas)
            metrics.update(self._gather(trainer))
            metrics.update(self._model_stats)
            self._finish()
        self._arm(trainer)

    def post_state_loaded(self, trainer: TrainerView, source: str) -> None:
        self._finish()
        self._arm(trainer)

    def close(self, trainer: TrainerView) -> None:
        self._finish()

    def _due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def _arm(self, trainer: TrainerView) -> None:
        """Start this rank's clock when the next step is a stats step: from here, where the ranks last
        agreed (the loop's end-of-step checks), to the step's last gradient."""
        self._clock = _Clock(trainer.device) if self._due(trainer.step + 1) else None

    # -- the statistics ----------------------------------------------------------------------------
    def _add_norms(
        self, trainer: TrainerView, name: str, positions: Any, tensors: list[torch.Tensor]
    ) -> None:
        """Per-layer squared norms of this rank's part of `tensors` (of the parameters at `positions`):
        shards of FSDP parameters apart from parameters every rank holds whole."""
        groups = len(self._layers)
        for sharded, target in ((True, self._sharded), (False, self._replicated)):
            chosen = [
                (self._index[i], t) for i, t in zip(positions, tensors) if self._shard_mask[i] == sharded
            ]
            target[name] = (
                group_sums(squared_norms([t for _, t in chosen]), [g for g, _ in chosen], groups)
                if chosen
                else torch.zeros(groups, dtype=torch.float32, device=trainer.device)
            )

    def _gather(self, trainer: TrainerView) -> dict[str, float]:
        """Per-rank times and memory, and per-layer norms with the shards of every rank summed in."""
        norms = ("grad", "param", "update")
        local = torch.cat(
            [
                torch.tensor([self._step_time, self._memory], dtype=torch.float32, device=trainer.device),
                *(self._sharded[n].to(trainer.device) for n in norms),
            ]
        )
        if trainer.world_size > 1:
            parts = [torch.empty_like(local) for _ in range(trainer.world_size)]
            torch.distributed.all_gather(parts, local)
            gathered = torch.stack(parts)
        else:
            gathered = local[None]
        replicated = torch.cat([self._replicated[n].to(trainer.device) for n in norms])
        totals = (gathered[:, len(_PER_RANK) :].sum(dim=0) + replicated).view(len(norms), -1).tolist()
        grad_sq, param_sq, update_sq = totals
        out: dict[str, float] = {}
        for rank, row in enumerate(gathered[:, : len(_PER_RANK)].tolist()):
            for name, value in zip(_PER_RANK, row, strict=True):
                out[rank_key(name, rank)] = value
        for i, layer in enumerate(self._layers):
            out[stat_key("grad_norm", layer)] = grad_sq[i] ** 0.5
            out[stat_key("param_norm", layer)] = param_sq[i] ** 0.5
            out[stat_key("update_ratio", layer)] = update_ratio(update_sq[i], param_sq[i])
        return out

    def _probe_forward(self, trainer: TrainerView) -> dict[str, float]:
        """Block outputs, attention logits and output logits of one forward on the fixed probe batch."""
        model = trainer.raw_model
        if self._probe is None:
            self._probe = ModelProbe(
                trainer.train_stream,
                trainer.val_stream,
                trainer.model_cfg.seq_len,
                trainer.loader.micro_batch,
                trainer.device,
            )
        figures = self._probe.figures(model, trainer.autocast).tolist()
        if trainer.strategy == "fsdp":  # a forward without backward leaves the root's parameters gathered
            model.reshard()  # type: ignore[operator]
        out = {stat_key("logit_max"): figures[0], stat_key("logit_entropy"): figures[1]}
        layers = len(model.blocks)
        for i in range(layers):
            rms, peak = rms_and_max(figures[2 + 4 * i : 5 + 4 * i])
            out[stat_key("act_rms", i)] = rms
            out[stat_key("act_max", i)] = peak
            out[stat_key("attn_logit_max", i)] = figures[5 + 4 * i]
        if self._probe.sources is not None:
            for name, loss in zip(self._probe.sources[0], figures[2 + 4 * layers :], strict=True):
                out[stat_key(LOSS_SOURCE, name)] = loss
        return out

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _finish(self) -> None:
        """Forget the stats step's hooks, clock and copies."""
        self._remove_hooks()
        self._active = False
        self._clock = None
        self._before = []
        self._sharded, self._replicated = {}, {}
        self._model_stats = {}
