"""Streaming prepare (tenx/data/prepare/stream.py, tenx/data/prepare/partitioned.py): the output does not depend on the number
of workers, on a sampled tokenizer's order or on partitioning; a prepare killed with SIGKILL resumes to the
same bytes; nothing half-written is read."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import tenx.data.prepare.partitioned as partitioned
import tenx.data.prepare.stream as stream
from tenx.data.ngrams import build_index
from tenx.data.prepare.pipeline import PrepareConfig, is_prepared, prepare
from tenx.errors import ConfigError, DataError


def files_of(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(corpus_dir, tmp_path_factory) -> Path:
    """The tiny corpus plus planted exact and near duplicates."""
    root = tmp_path_factory.mktemp("stream") / "src"
    shutil.copytree(corpus_dir, root)
    files = sorted(root.rglob("*.py"))
    for i, f in enumerate(files[:6]):
        (root / f"copy_{i}.py").write_bytes(f.read_bytes())  # exact duplicate
        (root / f"near_{i}.py").write_text("# vendored copy\n" + f.read_text())  # near duplicate
    return root


def config(src: Path, out: Path, **kw) -> PrepareConfig:
    return PrepareConfig(
        source=str(src), out=str(out), vocab_size=512, val_ratio=0.1, heldout_ratio=0.1, **kw
    )


def test_output_is_identical_for_any_worker_count_and_partitioning(corpus, tmp_path, monkeypatch):
    outs = {}
    for workers in (1, 2, 3):
        manifest = prepare(config(corpus, tmp_path / f"w{workers}", workers=workers), progress=False)
        outs[workers] = files_of(tmp_path / f"w{workers}")
    assert outs[1] == outs[2] == outs[3]
    assert manifest["stats"]["duplicates_removed"] == 6 and manifest["dedup"]["near_duplicate_groups"] >= 6
    assert not (tmp_path / "w1" / stream.WORK_DIR).exists()  # the work directory is removed at the end
    # hash partitions: 1 or many, the same decontamination and the same index as the in-memory build_index
    monkeypatch.setattr(partitioned, "PARTITION_HASHES", 1 << 10)
    prepare(config(corpus, tmp_path / "parts", workers=2), progress=False)
    assert files_of(tmp_path / "parts") == outs[1]
    index = (tmp_path / "parts" / "ngrams-13.npy").read_bytes()
    build_index(tmp_path / "parts", 13)
    assert (tmp_path / "parts" / "ngrams-13.npy").read_bytes() == index


def test_a_tokenizer_sample_is_seeded_and_recorded(corpus, tmp_path):
    a = prepare(config(corpus, tmp_path / "a", tokenizer_sample_mb=0.2, workers=1), progress=False)
    prepare(config(corpus, tmp_path / "b", tokenizer_sample_mb=0.2, workers=2), progress=False)
    full = prepare(config(corpus, tmp_path / "full", workers=2), progress=False)
    assert a["prepare"]["tokenizer_sample_mb"] == 0.2 and "tokenizer_sample_mb" not in full["prepare"]
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b")
    assert a["tokenizer"]["xxhash"] != full["tokenizer"]["xxhash"]  # trained on fewer documents


def _run(cfg: PrepareConfig) -> None:
    stream.COMMIT_BATCHES, stream.BATCH_DOCUMENTS = 1, 4  # commit after every small batch
    prepare(cfg, progress=False)


@pytest.mark.parametrize("stage", ["scan", "tokenize"])
def test_a_prepare_killed_mid_pass_resumes_to_the_same_bytes(corpus, tmp_path, stage):
    reference = tmp_path / "ref"
    prepare(config(corpus, reference, workers=2), progress=False)
    out = tmp_path / "killed"
    state = out / stream.WORK_DIR / "state.json"
    child = multiprocessing.get_context("fork").Process(target=_run, args=(config(corpus, out, workers=2),))
    child.start()
    deadline = time.time() + 60
    while time.time() < deadline:
        text = state.read_text() if state.exists() else ""
        if f'"{stage}"' in text and '"seq": 0' not in text.split(f'"{stage}"')[1][:200]:
            break
        time.sleep(0.005)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert f'"{stage}"' in state.read_text(), "the child finished before it could be killed"
    assert not (out / "manifest.json").exists() and not is_prepared(
        config(corpus, out)
    )  # nothing half-done is used
    prepare(config(corpus, out, workers=1, resume=True), progress=False)
    assert files_of(out) == files_of(reference)


def test_resume_with_other_settings_starts_over_and_bad_sources_leave_nothing(corpus, tmp_path, capsys):
    out = tmp_path / "o"
    (out / stream.WORK_DIR).mkdir(parents=True)
    (out / stream.WORK_DIR / "state.json").write_text('{"fingerprint": {"other": 1}, "scan": {}}')
    prepare(config(corpus, out, resume=True, workers=2), progress=False)
    assert "other settings; starting over" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no usable documents"):
        prepare(config(empty, tmp_path / "none"), progress=False)
    assert not (tmp_path / "none").exists()


def test_ordered_map_keeps_order_bounds_work_in_flight_and_reports_a_worker_failure():
    consumed = []

    def items():
        for i in range(40):
            consumed.append(i)
            yield i

    results = stream.ordered_map(np.square, items(), 2)
    first = next(results)
    assert first == 0 and len(consumed) <= 5  # at most 2 x workers submitted ahead
    assert [first, *results] == [i * i for i in range(40)]
    with pytest.raises(ZeroDivisionError):
        list(stream.ordered_map(abs, range(3), 2, initializer=lambda: 1 / 0))


def test_the_datatrove_engine_gives_the_local_output(corpus, tmp_path):
    pytest.importorskip("datatrove")
    local = tmp_path / "local"
    prepare(config(corpus, local, workers=1), progress=False)
    engine = tmp_path / "engine"
    prepare(config(corpus, engine, engine="datatrove", tasks=2, workers=2), progress=False)
    assert files_of(engine) == files_of(local)
    with pytest.raises(ConfigError, match="slurm_partition"):
        prepare(config(corpus, tmp_path / "slurm", engine="datatrove-slurm"), progress=False)


def test_emit_slurm_writes_a_driver_job_beside_the_output(corpus, tmp_path):
    from tenx.cli import main

    out = tmp_path / "data"
    main(
        [
            "data",
            "prepare",
            "--source",
            str(corpus),
            "--out",
            str(out),
            "--slurm-partition",
            "cpu",
            "--emit",
            "slurm",
        ]
    )
    script = (tmp_path / "data.sbatch").read_text()
    assert (
        "#SBATCH --partition=cpu" in script and not out.exists()
    )  # nothing prepared, nothing written inside
    assert script.rstrip().endswith("--engine datatrove-slurm --resume") and "--emit" not in script


FAKE_SLURM = {
    # sbatch: job ids 1001, 1002, ... (datatrove submits the array, then a stats job depending on it)
    "sbatch": 'n=$(cat "$FAKE_SLURM/count" 2>/dev/null || echo 1000); n=$((n + 1)); echo $n > "$FAKE_SLURM/count"\n'
    'echo "Submitted batch job $n"',
    # sacct and squeue print what the test wrote, or fail like a cluster without accounting
    "sacct": '[ -f "$FAKE_SLURM/sacct" ] || { echo "accounting storage is disabled" >&2; exit 1; }\n'
    'cat "$FAKE_SLURM/sacct"',
    "squeue": '[ -f "$FAKE_SLURM/squeue" ] || exit 1; cat "$FAKE_SLURM/squeue"',
    "scancel": 'echo "$@" >> "$FAKE_SLURM/scancel"',
}


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """sbatch, sacct, squeue and scancel as shell scripts on PATH (their state: the folder returned); the
    driver's sleeps between polls return at once and are counted, and 50 polls are taken to mean forever."""
    import tenx.data.prepare.engine as engine

    state, bin_dir = tmp_path / "slurm-state", tmp_path / "bin"
    state.mkdir()
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM", str(state))
    polls: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if seconds < 1:  # subprocess's own short waits
            return real_sleep(seconds)
        polls.append(seconds)
        if len(polls) >= 50:
            raise AssertionError("the Slurm driver is still waiting after 50 polls")
        for hook in state_hooks:
            hook(len(polls))

    state_hooks: list = []
    monkeypatch.setattr(engine.time, "sleep", sleep)
    return state, polls, state_hooks


def test_slurm_driver_stops_naming_the_failed_array_task(corpus, tmp_path, fake_slurm):
    pytest.importorskip("datatrove")
    state, polls, _ = fake_slurm
    (state / "sacct").write_text("1001_0|COMPLETED\n1001_1|FAILED\n1001_2|RUNNING\n")
    out = tmp_path / "out"
    cfg = config(corpus, out, engine="datatrove-slurm", slurm_partition="cpu", tasks=3)
    with pytest.raises(DataError) as caught:
        prepare(cfg, progress=False)
    message = str(caught.value)
    logs = out / stream.WORK_DIR / "datatrove-scan"
    assert message.startswith("scan: Slurm job 1001: task 1001_1 FAILED (rank 1: ")
    assert str(logs / "logs" / "task_00001.log") in message
    assert str(logs / "slurm_logs" / "1001_1.out") in message
    assert "1 other tasks are still queued or running" in message and "scancel 1001" in message
    assert "--resume" in message and "1001_0" not in message  # a completed task is not blamed
    assert polls == []  # stopped at the first look, without waiting
    assert (state / "scancel").read_text().split() == ["1002"]  # the stats job, which would never run


def test_slurm_driver_stops_when_tasks_leave_the_queue_without_finishing(corpus, tmp_path, fake_slurm):
    pytest.importorskip("datatrove")
    import tenx.data.prepare.engine as engine

    state, polls, _ = fake_slurm
    (state / "squeue").write_text("999_0|RUNNING\n")  # no accounting; squeue shows only another job
    cfg = config(corpus, tmp_path / "out", engine="datatrove-slurm", slurm_partition="cpu", tasks=2)
    with pytest.raises(
        DataError,
        match=r"scan: Slurm job 1001: task 1001_0 left the queue without its "
        r"completion marker \(rank 0: .*task 1001_1 left the queue",
    ):
        prepare(cfg, progress=False)
    assert len(polls) == engine.SLURM_GONE_POLLS  # a shared filesystem's lag is allowed for, then no more


def test_slurm_driver_waits_for_running_tasks_and_maps_each_array_to_its_ranks(tmp_path, fake_slurm):
    pytest.importorskip("datatrove")
    from datatrove.executor import SlurmPipelineExecutor

    import tenx.data.prepare.engine as engine

    state, polls, hooks = fake_slurm
    executor = SlurmPipelineExecutor(
        pipeline=[],
        tasks=5,
        time="1:00:00",
        partition="cpu",
        logging_dir=str(tmp_path / "logs"),
        max_array_size=2,
    )
    with executor.logging_dir.open("ranks_to_run.json", "w") as f:
        f.write("[0, 2, 3, 4]")  # rank 1 finished before: 3 arrays of at most 2 tasks
    executor.mark_rank_as_completed(1)
    (state / "sacct").write_text("1001_0|RUNNING\n1001_1|RUNNING\n1003_0|RUNNING\n1003_1|PENDING\n")
    hooks.append(lambda poll: executor.mark_rank_as_completed([0, 2, 3, 4][poll - 1]))
    engine.wait_for_slurm(executor, ["1001", "1003"], "tokenize", str(tmp_path / "logs"))
    assert polls == [engine.SLURM_POLL_S] * 4  # one rank finishes per poll; none is blamed meanwhile

    for rank in (3, 4):
        executor.logging_dir.rm(f"completions/{rank:05d}")
    (state / "sacct").write_text(
        "1001_0|COMPLETED\n1001_1|COMPLETED\n1003_0|CANCELLED by 0\n1003_1|TIMEOUT\n"
    )
    with pytest.raises(
        DataError,
        match=r"tokenize: Slurm job 1001, 1003: task 1003_0 CANCELLED \(rank 3: .*"
        r"task_00003.log\); task 1003_1 TIMEOUT \(rank 4: ",
    ):
        engine.wait_for_slurm(executor, ["1001", "1003"], "tokenize", str(tmp_path / "logs"))

    (state / "sacct").unlink()  # neither sacct nor squeue answers: bounded, then an error
    polls.clear()
    hooks.clear()
    with pytest.raises(DataError, match="neither sacct nor squeue answered about Slurm jobs 1001, 1003"):
        engine.wait_for_slurm(executor, ["1001", "1003"], "tokenize", str(tmp_path / "logs"))
    assert len(polls) == engine.SLURM_QUERY_FAILURES - 1


def test_a_foreign_work_directory_or_sbatch_file_is_never_touched(corpus, tmp_path):
    out = tmp_path / "o"
    (out / stream.WORK_DIR).mkdir(parents=True)
    (out / stream.WORK_DIR / "mine.txt").write_text("user data")
    with pytest.raises(DataError, match="not a tenx work directory"):
        prepare(config(corpus, out), progress=False)
    assert (out / stream.WORK_DIR / "mine.txt").read_text() == "user data"
    (tmp_path / "d.sbatch").write_text("#!/bin/bash\necho mine\n")
    from tenx.data.prepare.engine import emit_slurm

    with pytest.raises(ConfigError, match="tenx did not write it"):
        emit_slurm(config(corpus, tmp_path / "d", slurm_partition="cpu"), [])
    assert "echo mine" in (tmp_path / "d.sbatch").read_text()
