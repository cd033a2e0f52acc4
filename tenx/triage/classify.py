"""Verdicts with evidence, and the root causes behind many incidents (`tenx triage`).

Each incident gets one verdict, the evidence that decided it and a confidence:

| verdict | decided by |
|---|---|
| `data` | a shard failed its checksum; or the step reproduces on both paths and its batch is an outlier under the model (its loss is far above other batches' on the same state) |
| `hardware` | a replica's checksums differ from its peers' or its own (names the rank); or the step does not reproduce when replayed (transient: a machine or environment fault) |
| `library-op` | the step reproduces, and an operator on the trained path disagrees with float64 (names the op and the data property that triggers it); on weights that have already diverged, only when the counterfactual replay shows the reference path staying healthy, and the op is found where the two paths part |
| `ml` | the step reproduces identically and no operator is at fault: the anomaly is in the math (e.g. the learning rate); on diverged weights, when the reference path replayed from before the trouble diverges too (tenx.triage.counterfactual) |
| `race` | repeated replays of the step differ from each other |
| `external` | a signal from outside (a scheduler's SIGTERM) |
| `unknown` | no test applies (trends, off-prediction, a peer group's failure): the incident stays open |

Root causes ("single-bug theory"): incidents are joined when they share evidence: the same faulty operator
or the same triggering data property, the same innermost frames of a crash, the same rank, the same shard,
or (for `ml`) the same config. One cause may show several symptoms at many steps and in several runs.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tenx import rundir as rd
from tenx.errors import TenxError
from tenx.model.transformer import lm_loss
from tenx.rundir import RunDir
from tenx.triage.bisect import BisectReport, bisect_step
from tenx.triage.counterfactual import counterfactual, diverged_state, episode
from tenx.triage.incident_store import Incident, IncidentStore
from tenx.triage.outcome import StepOutcome, outcome_of_crash
from tenx.triage.replay import Replayer, replay
from tenx.utils.text import counted

OUTLIER_Z = 6.0
"""A batch whose loss is this many standard deviations above other batches' is anomalous data."""

_REPLAYED = ("crash", "non-finite", "spike", "loss-rise", "hang", "exit")


@dataclass
class Verdict:
    verdict: str
    confidence: float
    evidence: dict[str, Any]
    cause: dict[str, Any] | None


@dataclass
class Cause:
    """A root cause: the incidents it explains and what they share."""

    verdict: str
    incidents: list[int]
    symptoms: list[str]
    steps: list[int]
    runs: list[str]
    op: str | None = None
    property: str | None = None
    rank: int | None = None
    shard: str | None = None
    evidence: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "kind": self.verdict,
            "incidents": len(self.incidents),
            "symptoms": self.symptoms,
            "op": self.op,
            "rank": self.rank,
            "shard": self.shard,
        }


def _batch_zscore(run_dir: str, step: int, at_time: float, others: int = 16) -> float | None:
    """How far the step's batch's loss lies above `others` random batches', on the state before the step."""
    replayer = Replayer(run_dir)
    _, windows, _, _ = replayer.prepare(step, at_time, None)
    assert replayer.model is not None
    model = replayer.model.eval()
    rng = random.Random(f"tenx-triage:{step}")
    size = len(windows[0])
    n_windows = (len(replayer.stream) - 1) // replayer.seq_len

    def loss_of(ids: list[int]) -> float:
        inputs, targets = replayer.batch(ids)
        with torch.no_grad(), replayer.autocast():
            return float(lm_loss(model(inputs), targets)[1])

    mine = max(loss_of(ids) for ids in windows)
    baseline = []
    for _ in range(others):
        ids = [rng.randrange(n_windows) for _ in range(size)]
        if all(replayer.stream.window_ok(w * replayer.seq_len, replayer.seq_len + 1) for w in ids):
            baseline.append(loss_of(ids))
    if len(baseline) < 4:
        return None
    mean = sum(baseline) / len(baseline)
    std = max((sum((b - mean) ** 2 for b in baseline) / len(baseline)) ** 0.5, 1e-3 * abs(mean), 1e-6)
    return (mine - mean) / std


def _same_symptom(recorded: StepOutcome, replayed: StepOutcome) -> bool:
    """Both crashed alike, or the guard judged both the same way (a spike, a non-finite loss)."""
    if recorded.crashed or replayed.crashed:
        return recorded.matches(replayed)
    return recorded.skipped is not None and recorded.skipped == replayed.skipped


def _replayed_verdict(incident: Incident, repro_dir: Path, earlier: list[Incident]) -> Verdict:
    """Replay the incident's step (twice), then bisect it if it reproduces."""
    event = incident.event
    step = incident.step
    if incident.kind in ("hang", "exit"):
        step = (incident.step or 0) + (1 if incident.kind == "exit" else 0)
    if step is None or step < 1:
        return Verdict("unknown", 0.0, {"summary": "no step to replay"}, None)
    recorded: StepOutcome | None = outcome_of_crash(event) if incident.kind == "crash" else None
    at_time = float(incident.time)
    try:
        rep = replay(incident.run_dir, step, repeat=2, at_time=at_time, recorded=recorded)
    except TenxError as e:
        return Verdict("unknown", 0.0, {"summary": f"replay failed: {e}"}, None)
    evidence: dict[str, Any] = {"replay": rep.verdict, "replay_text": rep.text()}
    rank = incident.rank
    if rep.verdict == "differs-between-repeats":
        evidence["summary"] = f"replays of step {step} differ from each other: non-determinism"
        return Verdict("race", 0.8, evidence, {"verdict": "race", "frames": incident.frames[:3]})
    symptom_kept = (
        rep.verdict == "does-not-reproduce"
        and rep.recorded is not None
        and _same_symptom(rep.recorded, rep.outcomes[0])
    )
    if symptom_kept:  # the anomaly is deterministic; the bits differ because the state did (first_divergent)
        since = f" from step {rep.first_divergent} on" if rep.first_divergent else " before the step"
        evidence["replay_note"] = (
            f"the symptom reproduces but not bit for bit: the state differed{since} (see other incidents)"
        )
    elif incident.kind in ("hang", "exit") or rep.verdict == "does-not-reproduce":
        diverged = f"; step {rep.first_divergent} already differed" if rep.first_divergent else ""
        evidence["summary"] = (
            f"step {step} does not reproduce when replayed ({rep.outcomes[0].describe()}){diverged}: "
            f"transient, a machine or environment fault on rank {rank}"
        )
        return Verdict("hardware", 0.7, evidence, {"verdict": "hardware", "rank": rank})
    if rep.verdict != "reproduces" and not symptom_kept:
        evidence["summary"] = f"replay of step {step}: {rep.verdict}"
        return Verdict("unknown", 0.2, evidence, None)
    report = bisect_step(incident.run_dir, step, at_time=at_time, recorded=recorded, repro_dir=repro_dir)
    evidence["bisect_text"] = report.text()
    lead = "reproduces bit for bit" if not symptom_kept else "the symptom reproduces"
    diverged = diverged_state(incident.run_dir, report.reference)
    if report.first is not None and diverged is None:
        return _op_verdict(report, evidence, lead)
    z = _batch_zscore(incident.run_dir, step, at_time)
    evidence["batch_z"] = z
    if z is not None and z > OUTLIER_Z:
        shards = sorted({d.get("shard") for d in incident.data if isinstance(d, dict) and d.get("shard")})
        evidence["summary"] = (
            f"reproduces on both paths with no faulty op; its batch's loss is {z:.1f} standard deviations "
            f"above other batches' on the same model: the data ({', '.join(shards) or 'its windows'})"
        )
        return Verdict("data", 0.7, evidence, {"verdict": "data", "shard": shards[0] if shards else None})
    if diverged is not None:  # who diverged the weights: replay both paths from before the trouble
        evidence["diverged"] = diverged
        return _counterfactual_verdict(incident, step, at_time, recorded, report, evidence, earlier, lead)
    unjudged = (
        f" ({', '.join(sorted(report.ill_conditioned))} not judged: their inputs leave the exact result "
        "undetermined at their precision)"
        if report.ill_conditioned
        else ""
    )
    evidence["summary"] = (
        f"reproduces bit for bit and on the float64 path ({report.reference.describe()}); no operator "
        f"disagrees with float64{unjudged} and the batch is ordinary: the math itself (learning rate, "
        "init, schedule)"
    )
    return Verdict("ml", 0.75, evidence, {"verdict": "ml", "config": incident.config_hash})


def _op_verdict(report: BisectReport, evidence: dict[str, Any], lead: str) -> Verdict:
    """`library-op`: the step's first faulty operator, found on a state a healthy run produces."""
    first = report.first
    assert first is not None
    prop = first.property or {}
    evidence["op"] = first.op
    evidence["property"] = prop.get("text")
    evidence["trigger"] = {k: prop.get(k) for k in ("kind", "name", "length", "value")}
    evidence["summary"] = f"{lead}; {first.op} ({first.module}) {first.problem} against float64" + (
        f", triggered by {prop['text']}" if prop.get("text") else ""
    )
    evidence["repro"] = report.repro
    confidence = 0.95 if not report.reference.crashed else 0.8
    key = {
        "verdict": "library-op",
        "op": first.op,
        "property": prop.get("kind"),
        "argument": prop.get("argument"),
    }
    return Verdict("library-op", confidence, evidence, key)


def _counterfactual_verdict(
    incident: Incident,
    step: int,
    at_time: float,
    recorded: StepOutcome | None,
    report: BisectReport,
    evidence: dict[str, Any],
    earlier: list[Incident],
    lead: str,
) -> Verdict:
    """The verdict on a diverged state (tenx.triage.counterfactual): `ml` when the reference path diverges
    too; `library-op` naming the operator found where the paths part when only the fast path does."""
    seen = report.first
    try:
        trouble, _ = episode(incident.run_dir, step, at_time)
        shared = _same_episode(incident, trouble, earlier)
        if shared is not None:  # one counterfactual per episode of trouble: an earlier incident's
            evidence["counterfactual"] = shared.evidence["counterfactual"]
            evidence["follows"] = shared.evidence.get("follows", shared.id)
            for key in ("op", "property", "trigger", "repro", "parted_bisect"):
                if key in shared.evidence:
                    evidence[key] = shared.evidence[key]
            evidence["found"] = shared.evidence.get("found", "")
            evidence["summary"] = (
                f"{lead}; {evidence['found']} (as incident {evidence['follows']}: one replay per episode)"
            )
            confidence = float(shared.confidence or 0.5)
            return Verdict(str(shared.verdict), confidence, evidence, shared.cause)
        cf = counterfactual(incident.run_dir, step, at_time=at_time, recorded=recorded)
    except TenxError as e:
        evidence["summary"] = (
            f"{lead}; {evidence['diverged']}; the counterfactual replay could not be run ({e}): whether the "
            "math or a kernel diverged the weights is undecided"
        )
        return Verdict("unknown", 0.2, evidence, None)
    evidence["counterfactual"] = cf.summary()
    evidence["counterfactual_text"] = cf.text()
    where = f"step {cf.start}'s checkpoint" if cf.checkpoint else "the seeded initialisation"
    if cf.reference_diverged is not None:
        ref = cf.reference[cf.reference_diverged]
        evidence["found"] = (
            f"{evidence['diverged']}; replayed from {where} on the reference path (float64, math "
            f"kernels), the run diverges too (loss {ref:.4g} at step {cf.reference_diverged}, "
            f"{ref / cf.first:.3g}x the first): the math itself (learning rate, warmup, clipping, init)"
            + (f"; {seen.op} {seen.problem} against float64 only on those diverged inputs" if seen else "")
        )
        evidence["summary"] = f"{lead}; {evidence['found']}"
        if seen is not None and report.repro:  # the verdict explains the op's error: no reproduction of it
            _remove_repro(Path(report.repro))
        return Verdict("ml", 0.85, evidence, {"verdict": "ml", "config": incident.config_hash})
    peak = max(cf.reference.values())
    healthy = f"the reference path stays healthy (peak loss {peak:.4g}, {peak / cf.first:.3g}x the first)"
    for candidate in dict.fromkeys([cf.parted, cf.start + 1]):
        if candidate is None or candidate > step:
            continue
        found = _bisect_parting(incident, candidate, step, cf.times.get(candidate, at_time), recorded)
        if found is None:
            continue
        evidence["parted_bisect"] = found.text()
        verdict = _op_verdict(found, evidence, lead)
        op = found.first
        assert op is not None
        evidence["found"] = (
            f"{evidence['diverged']}; replayed from {where}, only the fast path diverges: {healthy}; the "
            f"paths part at step {cf.parted}, and at step {found.step} {op.op} ({op.module}) {op.problem} "
            "against float64"
        )
        evidence["summary"] = f"{lead}; {evidence['found']}"
        return Verdict("library-op", 0.9, evidence, verdict.cause)
    evidence["found"] = (
        f"{evidence['diverged']}; replayed from {where}, only the fast path diverges ({healthy}), "
        f"but no operator disagrees with float64 where the paths part (step {cf.parted}) nor at step "
        f"{cf.start + 1}: rounding amplified by an unstable optimisation, the math (learning rate, warmup)"
    )
    evidence["summary"] = f"{lead}; {evidence['found']}"
    return Verdict("ml", 0.5, evidence, {"verdict": "ml", "config": incident.config_hash})


def _bisect_parting(
    incident: Incident, at: int, step: int, at_time: float, recorded: StepOutcome | None
) -> BisectReport | None:
    """Bisect step `at` of the incident's timeline (`at_time`: its execution's record time, or the incident's
    for its own step); the report when it names an operator on a healthy state."""
    repro_dir = RunDir(incident.run_dir).incident_dir(incident.id)
    recorded = recorded if at == step else None
    report = bisect_step(incident.run_dir, at, at_time=at_time, recorded=recorded, repro_dir=repro_dir)
    if report.first is None or diverged_state(incident.run_dir, report.reference) is not None:
        return None
    return report


def _same_episode(incident: Incident, trouble: int, earlier: list[Incident]) -> Incident | None:
    """An earlier incident of the same run whose counterfactual covered the same episode of trouble."""
    for e in reversed(earlier):
        cf = e.evidence.get("counterfactual") if isinstance(e.evidence, dict) else None
        if e.run_dir == incident.run_dir and isinstance(cf, dict) and cf.get("trouble") == trouble:
            return e
    return None


def _remove_repro(script: Path) -> None:
    """Remove the reproduction bisect wrote (only its files) for an operator the verdict clears."""
    folder = script.parent
    for name in (rd.REPRO_SCRIPT, rd.REPRO_META, rd.REPRO_INPUTS):
        (folder / name).unlink(missing_ok=True)
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


_REPORTED = ("TenxError", "DataError", "CheckpointError", "ConfigError", "UnsafeCheckpointError")
"""Errors tenx raises itself to stop a run (the guard gave up, a consistency stop): consequences."""


def _consequence(incident: Incident, earlier: list[Incident]) -> Verdict | None:
    """A crash that is the consequence of an earlier incident of the same attempt takes its verdict.

    tenx stopping the run on purpose (the guard giving up after bad steps), a failure outside the step
    (in a hook after it), or a collective failing because a peer died are not causes of their own."""
    event = incident.event
    peer = any(s in str(incident.message or "") for s in ("Connection closed by peer", "Connection reset"))
    if incident.kind != "crash" or not (
        event.get("phase") == "after-step" or incident.exception in _REPORTED or peer
    ):
        return None
    before = [
        e
        for e in earlier
        if e.run_dir == incident.run_dir
        and e.attempt == incident.attempt
        and e.verdict
        and e.id < incident.id
    ]
    if not before:
        return None
    cause = before[-1]
    return Verdict(
        str(cause.verdict),
        float(cause.confidence or 0.0) * 0.9,
        {
            "summary": f"{incident.exception} after incident {cause.id} ({cause.kind} at step {cause.step}): "
            f"a consequence, not a cause of its own",
            "follows": cause.id,
            **{k: cause.evidence[k] for k in ("op", "property") if k in cause.evidence},
        },
        cause.cause,
    )


def triage_incident(incident: Incident, earlier: list[Incident] | None = None) -> Verdict:
    """The verdict for one incident (see the module doc); `earlier`: the run's incidents triaged before it."""
    event = incident.event
    kind = incident.kind
    follows = _consequence(incident, earlier or [])
    if follows is not None:
        return follows
    if kind == "corrupt-shard":
        shard = Path(str(event.get("shard", "?"))).name
        return Verdict(
            "data",
            0.95,
            {"summary": f"shard {shard} failed its checksum: {event.get('message', '')}"},
            {"verdict": "data", "shard": shard},
        )
    if kind == "replica-mismatch":
        ranks = event.get("ranks") or event.get("groups") or []
        undecided = bool(event.get("undecided"))
        rank = int(ranks[0]) if len(ranks) == 1 and not undecided else None
        summary = str(event.get("message", "replicas disagree"))
        return Verdict(
            "hardware",
            0.9 if rank is not None else 0.5,
            {"summary": summary, "check": event.get("check")},
            {"verdict": "hardware", "rank": rank},
        )
    if kind == "signal":
        return Verdict(
            "external", 1.0, {"summary": f"stopped by {event.get('signal')}"}, {"verdict": "external"}
        )
    if kind in _REPLAYED:
        repro_dir = RunDir(incident.run_dir).incident_dir(incident.id)
        return _replayed_verdict(incident, repro_dir, earlier or [])
    return Verdict("unknown", 0.0, {"summary": f"no test decides a {kind} incident"}, None)


def _links(incident: Incident) -> list[tuple[Any, ...]]:
    """The evidence an incident may share with others (its keys for grouping)."""
    cause = incident.cause or {}
    verdict = incident.verdict or "unknown"
    keys: list[tuple[Any, ...]] = []
    if verdict == "library-op":
        keys.append(("op", cause.get("op")))
        if cause.get("property"):
            keys.append(("property", cause.get("property"), cause.get("argument")))
    if incident.kind == "crash" and incident.frames:
        keys.append(("frames", tuple(incident.frames[:3])))
    if verdict == "hardware":
        keys.append(("rank", cause.get("rank"), incident.run_dir))
    if verdict == "data":
        keys.append(("shard", cause.get("shard")))
    if verdict == "ml":
        keys.append(("ml", cause.get("config"), incident.run_dir))
    if verdict == "race":
        keys.append(("race", tuple(cause.get("frames") or ())))
    if verdict == "external":
        keys.append(("external", incident.run_dir))
    if verdict == "unknown":
        keys.append(("unknown", incident.kind))
    return keys


def group_causes(incidents: list[Incident]) -> list[Cause]:
    """Join incidents that share evidence (union-find over `_links`) into root causes."""
    parent = list(range(len(incidents)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[tuple[Any, ...], int] = {}
    for i, incident in enumerate(incidents):
        for key in _links(incident):
            if key in owner:
                parent[find(i)] = find(owner[key])
            else:
                owner[key] = i
    groups: dict[int, list[Incident]] = {}
    for i, incident in enumerate(incidents):
        groups.setdefault(find(i), []).append(incident)
    causes = []
    for members in groups.values():
        votes = Counter(m.verdict or "unknown" for m in members if (m.verdict or "unknown") != "unknown")
        verdict = votes.most_common(1)[0][0] if votes else "unknown"
        decided = [m for m in members if m.verdict == verdict] or members
        first = decided[0].cause or {}
        evidence = [str(m.evidence.get("summary")) for m in decided if m.evidence.get("summary")]
        ops = [m.evidence.get("op") for m in decided if m.evidence.get("op")]
        props = [m.evidence.get("property") for m in decided if m.evidence.get("property")]
        triggers = [m.evidence["trigger"] for m in decided if isinstance(m.evidence.get("trigger"), dict)]
        runs = [t for t in triggers if t.get("kind") == "identical-run"]
        if runs and ops:
            values = sorted({str(t.get("value")) for t in runs})
            shortest = min(int(t.get("length") or 0) for t in runs)
            props = [
                f"runs of >= {shortest} identical values in `{runs[0].get('name')}` "
                f"({', '.join(values[:6])}{', ...' if len(values) > 6 else ''}); shorter runs do not trigger it"
            ]
        causes.append(
            Cause(
                verdict=verdict,
                incidents=[m.id for m in members],
                symptoms=sorted({m.kind for m in members}),
                steps=sorted({m.step for m in members if m.step is not None}),
                runs=sorted({Path(m.run_dir).name for m in members}),
                op=Counter(ops).most_common(1)[0][0] if ops else None,
                property=Counter(props).most_common(1)[0][0] if props else None,
                rank=first.get("rank") if verdict == "hardware" else None,
                shard=first.get("shard") if verdict == "data" else None,
                evidence=list(dict.fromkeys(evidence))[:3],
            )
        )
    return sorted(causes, key=lambda c: (-len(c.incidents), c.verdict))


def triage(
    run_dirs: list[str | Path],
    incident_id: int | None = None,
    *,
    again: bool = False,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[Incident], list[Cause], dict[int, float]]:
    """Triage the incidents of `run_dirs` (one, or every one not yet triaged); group all into causes.

    `progress` is told a line before each incident is triaged and after it is decided. Returns every
    incident (with its verdict), the root causes, and the seconds spent per incident."""
    seconds: dict[int, float] = {}
    incidents: list[Incident] = []
    for run_dir in run_dirs:
        with IncidentStore(run_dir) as store:
            store.ingest()
            todo = [store.get(incident_id)] if incident_id is not None else store.incidents()
            done = [i for i in store.incidents() if i.verdict is not None and not again]
            pending = [i for i in todo if i.verdict is None or again]
            for n, incident in enumerate(pending, 1):
                t0 = time.perf_counter()
                where = f"{Path(run_dir).name}: incident {incident.id} ({n}/{len(pending)})"
                if progress is not None:
                    progress(f"triage: {where}, {incident.kind} at step {incident.step} ...")
                v = triage_incident(incident, done)
                if progress is not None:
                    progress(f"triage: {where}: {v.verdict} ({time.perf_counter() - t0:.1f} s)")
                store.record_triage(
                    incident.id,
                    verdict=v.verdict,
                    confidence=v.confidence,
                    evidence=v.evidence,
                    cause=v.cause,
                )
                seconds[incident.id] = time.perf_counter() - t0
                done.append(store.get(incident.id))
            chosen = [store.get(incident_id)] if incident_id is not None else store.incidents()
            incidents += chosen
    return incidents, group_causes(incidents), seconds


def format_causes(incidents: list[Incident], causes: list[Cause]) -> str:
    """The incidents-to-causes table a team reads instead of voting."""
    lines = [f"{counted(len(incidents), 'incident')}, {counted(len(causes), 'root cause')}", ""]
    header = f"{'cause':<4} {'verdict':<11} {'incidents':>9}  {'symptoms':<28} {'steps':<18} names"
    lines += [header, "-" * len(header)]
    for i, c in enumerate(causes, 1):
        steps = ",".join(map(str, c.steps[:5])) + ("..." if len(c.steps) > 5 else "")
        names = []
        if c.op:
            names.append(f"op {c.op}")
        if c.property:
            names.append(f"data: {c.property}")
        if c.rank is not None:
            names.append(f"rank {c.rank}")
        if c.shard:
            names.append(f"shard {c.shard}")
        lines.append(
            f"{i:<4} {c.verdict:<11} {len(c.incidents):>9}  {', '.join(c.symptoms):<28} {steps:<18} "
            f"{'; '.join(names)}"
        )
    lines.append("")
    for i, c in enumerate(causes, 1):
        lines.append(f"cause {i} ({c.verdict}, incidents {', '.join(map(str, c.incidents))}):")
        lines += [f"  - {e}" for e in c.evidence]
    return "\n".join(lines)


def format_incident(incident: Incident) -> str:
    """One incident's verdict with its evidence (replay and bisection reports included)."""
    lines = [
        f"incident {incident.id} ({incident.kind}, step {incident.step}, rank {incident.rank}): "
        f"{incident.verdict} (confidence {incident.confidence})",
        f"  {incident.evidence.get('summary', '')}",
    ]
    for key in ("replay_text", "bisect_text", "counterfactual_text", "parted_bisect"):
        if incident.evidence.get(key):
            lines += ["  " + line for line in str(incident.evidence[key]).splitlines()]
    return "\n".join(lines)
