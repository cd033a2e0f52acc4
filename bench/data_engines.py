"""Engines for `tenx data prepare`'s per-document step: multiprocessing vs datatrove vs Ray Data, measured.

The step is the one `tenx data prepare` runs on every document: clean (UTF-8 decode, tenx/data/prepare/clean.py),
tokenize with a tenx BPE (vocab 8192, trained here on a ~5 MB sample), and append the tokens plus the
end-of-document id to spill files, each written with an index of (document, offset, length). Engines:

- mp: a `multiprocessing.Pool(N)` mapping `imap` (ordered) over batches of files; each batch writes its own
  spill, named by batch number, so the layout does not depend on which process ran it.
- datatrove: a whole-file reader (a `BaseDiskReader` subclass, which shards files by rank: `files[rank::N]`)
  and a custom `PipelineStep` that tokenizes and writes one spill per task, run by
  `LocalPipelineExecutor(tasks=N, workers=N)`.
- ray: `ray.data.read_binary_files` + a `map_batches` function on a local cluster of N CPUs; each batch
  writes a spill named by its first document.

The corpus is the CPython standard library, mutated per round (a seeded rename of `self` and a random
header) until it reaches --mb MB, one document per file, with a few invalid UTF-8 bytes in every 97th file.
Each job runs in a fresh interpreter with one tokenizer thread per worker (TOKENIZERS_PARALLELISM=false),
so N is the number of cores used. Measured per engine and N:

- MB/s: corpus MB (10^6 bytes) over the job's wall time, interpreter and engine start-up included;
- MB/cpu-s: corpus MB over the CPU time (user + system) its processes used, sampled like memory: less
  sensitive than MB/s to other load on a shared machine;
- start-up: the wall time of the same job over one tiny file;
- peak RSS: the largest sum, over the job's processes (its process tree and session), of RSS, sampled every
  0.1 s from /proc; PSS (shared pages split between their users) is reported beside it;
- deterministic: the xxh3-64 of every document's tokens concatenated in file order is the same for N=1 and
  N=2 and equals the mp N=1 reference;
- install MB: bytes of the package's installed files plus those of the dependencies it pulls in that tenx
  itself does not need.

Jobs are interleaved (repeat → N → engine) and repeated; medians are reported with their spread
(max - min). The corpus and all outputs live in a temporary directory deleted at the end.

    python bench/data_engines.py [--mb 150] [--repeats 1] [--engines mp,datatrove,ray] [--workers 1,2]
"""

from __future__ import annotations

import argparse
import importlib.metadata as im
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

ENGINES = ("mp", "datatrove", "ray")
DOCS_PER_ENCODE = 64
"""Documents handed to one `encode_batch` call by every engine."""
BATCH_BYTES = 4 << 20
"""mp: bytes of files per Pool work item (~1 s of tokenizing)."""
SAMPLE_INTERVAL_S = 0.1
TOKENIZER_SAMPLE_BYTES = 5 << 20
_FILE_INDEX = re.compile(r"(\d{6})_[^/]*$")


# ---------------------------------------------------------------- the per-document step, shared by engines


class SpillWriter:
    """Appends documents' tokens to `<stem>.bin` (uint16) and, on close, their index to `<stem>.idx.npy`."""

    def __init__(self, stem: Path) -> None:
        self.stem = stem
        self._file = open(stem.with_suffix(".bin"), "wb")
        self._rows: list[tuple[int, int, int]] = []
        self._offset = 0

    def add(self, doc_index: int, tokens: np.ndarray) -> None:
        """Append one document's tokens."""
        self._file.write(tokens.tobytes())
        self._rows.append((doc_index, self._offset, len(tokens)))
        self._offset += len(tokens)

    def close(self) -> int:
        """Flush the tokens, write the index; returns the number of tokens written."""
        self._file.close()
        np.save(self.stem.with_suffix(".idx.npy"), np.array(self._rows, dtype=np.int64).reshape(-1, 3))
        return self._offset


_tokenizers: dict[str, Any] = {}


def load_bench_tokenizer(tok_dir: str) -> Any:
    """The benchmark's BPE, loaded once per process."""
    if tok_dir not in _tokenizers:
        from tenx.data.tokenizer import load_tokenizer

        entry = json.loads((Path(tok_dir) / "entry.json").read_text())
        _tokenizers[tok_dir] = load_tokenizer(tok_dir, entry)
    return _tokenizers[tok_dir]


def doc_index(path: str) -> int:
    """A document's position in file order, from its file name."""
    match = _FILE_INDEX.search(path)
    assert match, path
    return int(match.group(1))


def clean(raw: bytes) -> str | None:
    """tenx's cleaning of one raw document (None: skipped)."""
    from tenx.data.prepare.clean import CleaningStats, clean_text

    cleaned = clean_text(raw, CleaningStats())
    return None if cleaned is None else cleaned[0]


def tokenize_into(writer: SpillWriter, tokenizer: Any, docs: list[tuple[int, str]]) -> None:
    """Tokenize (index, text) documents and append each, ended by the end-of-document id."""
    for start in range(0, len(docs), DOCS_PER_ENCODE):
        chunk = docs[start : start + DOCS_PER_ENCODE]
        for (index, _), ids in zip(chunk, tokenizer.encode_batch([t for _, t in chunk]), strict=True):
            writer.add(index, np.array([*ids, tokenizer.eot_id], dtype=np.uint16))


# ---------------------------------------------------------------- engines (run in the job's interpreter)


def _mp_batch(job: tuple[int, list[str], str, str]) -> int:
    batch_no, paths, tok_dir, out_dir = job
    docs = [(doc_index(p), text) for p in paths if (text := clean(Path(p).read_bytes())) is not None]
    writer = SpillWriter(Path(out_dir) / f"mp-{batch_no:05d}")
    tokenize_into(writer, load_bench_tokenizer(tok_dir), docs)
    return writer.close()


def run_mp(corpus: Path, tok_dir: str, out_dir: Path, workers: int) -> int:
    """Pool(workers).imap over ~BATCH_BYTES batches of files, results in order."""
    import multiprocessing as mp

    batches: list[list[str]] = [[]]
    size = 0
    for path in sorted(corpus.iterdir()):
        if size >= BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(str(path))
        size += path.stat().st_size
    jobs = [(i, b, tok_dir, str(out_dir)) for i, b in enumerate(batches)]
    with mp.get_context("fork").Pool(workers) as pool:
        return sum(pool.imap(_mp_batch, jobs))


def _datatrove_blocks() -> tuple[type, type]:
    from datatrove.data import Document
    from datatrove.pipeline.base import PipelineStep
    from datatrove.pipeline.readers.base import BaseDiskReader

    class WholeFileReader(BaseDiskReader):
        """One document per file, cleaned by tenx; the base class shards files by rank."""

        name = "whole files"

        def read_file(self, filepath: str) -> Iterator[Document]:
            with self.data_folder.open(filepath, "rb") as f:
                text = clean(f.read())
            if text is not None:
                yield Document(text=text, id=filepath)

    class TokenizeToSpill(PipelineStep):
        """tenx BPE over the task's documents, into one spill per task."""

        name = "tenx tokenize"
        type = "🔢 - TOKENIZER"

        def __init__(self, tok_dir: str, out_dir: str) -> None:
            super().__init__()
            self.tok_dir, self.out_dir = tok_dir, out_dir

        def run(self, data: Any, rank: int = 0, world_size: int = 1) -> Iterator[Document]:
            tokenizer = load_bench_tokenizer(self.tok_dir)
            writer = SpillWriter(Path(self.out_dir) / f"datatrove-{rank:05d}")
            docs: list[tuple[int, str]] = []
            for document in data:
                docs.append((doc_index(document.id), document.text))
                if len(docs) == DOCS_PER_ENCODE:
                    tokenize_into(writer, tokenizer, docs)
                    docs = []
            tokenize_into(writer, tokenizer, docs)
            self.stat_update("tokens", value=writer.close())
            yield from ()

    return WholeFileReader, TokenizeToSpill


def run_datatrove(corpus: Path, tok_dir: str, out_dir: Path, workers: int) -> int:
    """LocalPipelineExecutor(tasks=N, workers=N) over [whole-file reader, tokenize step]."""
    from datatrove.executor import LocalPipelineExecutor

    reader_cls, step_cls = _datatrove_blocks()
    executor = LocalPipelineExecutor(
        pipeline=[reader_cls(str(corpus)), step_cls(tok_dir, str(out_dir))],
        tasks=workers,
        workers=workers,
        logging_dir=str(out_dir / "datatrove-logs"),
    )
    executor.run()
    return -1


def ray_tokenize_batch(batch: dict[str, Any], tok_dir: str, out_dir: str) -> dict[str, Any]:
    """Ray Data UDF: clean + tokenize a batch of files into a spill named by its first document."""
    docs = [
        (doc_index(str(p)), text)
        for p, raw in zip(batch["path"], batch["bytes"], strict=True)
        if (text := clean(bytes(raw))) is not None
    ]
    first = min(doc_index(str(p)) for p in batch["path"])
    writer = SpillWriter(Path(out_dir) / f"ray-{first:06d}")
    tokenize_into(writer, load_bench_tokenizer(tok_dir), docs)
    return {"tokens": np.array([writer.close()])}


def run_ray(corpus: Path, tok_dir: str, out_dir: Path, workers: int) -> int:
    """read_binary_files + map_batches (tasks, fused with the read) on a local Ray of N CPUs."""
    import ray

    ray.init(
        num_cpus=workers,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        _temp_dir=str(out_dir / "ray"),  # session files inside the job's directory, not /tmp/ray
    )
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        ds = ray.data.read_binary_files(str(corpus), include_paths=True)
        ds = ds.map_batches(
            ray_tokenize_batch,
            batch_size=DOCS_PER_ENCODE,
            fn_kwargs={"tok_dir": tok_dir, "out_dir": str(out_dir)},
        )
        return int(sum(row["tokens"] for row in ds.take_all()))
    finally:
        ray.shutdown()


def job_main(engine: str, workers: int, corpus: str, tok_dir: str, out_dir: str) -> None:
    """Entry point of one measured job (a fresh interpreter)."""
    runner = {"mp": run_mp, "datatrove": run_datatrove, "ray": run_ray}[engine]
    runner(Path(corpus), tok_dir, Path(out_dir), workers)


# ---------------------------------------------------------------- measurement (the harness process)


def _proc_table() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, session id, CPU clock ticks used: user + system) of every live process."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(entry.name)] = (int(fields[1]), int(fields[3]), int(fields[11]) + int(fields[12]))
    return table


def job_pids(root: int) -> dict[int, int]:
    """The job's processes (descendants of `root` plus anything left in its session) -> CPU ticks used."""
    table = _proc_table()
    pids = {pid for pid, (_, sid, _) in table.items() if sid == root}
    pids.add(root)
    grew = True
    while grew:
        more = {pid for pid, (ppid, _, _) in table.items() if ppid in pids} - pids
        pids |= more
        grew = bool(more)
    return {p: table[p][2] for p in pids if p in table}


def _memory_kb(pid: int) -> tuple[int, int]:
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


def run_job(engine: str, workers: int, corpus: Path, tok_dir: Path, out_dir: Path, timeout_s: float) -> dict:
    """Run one job in a fresh interpreter, sampling its processes' memory; returns wall time and peaks."""
    out_dir.mkdir(parents=True)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parent), env.get("PYTHONPATH")])
    )
    code = "import data_engines, sys; data_engines.job_main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])"
    args = [sys.executable, "-c", code, engine, str(workers), str(corpus), str(tok_dir), str(out_dir)]
    peak = {"rss": 0, "pss": 0, "procs": 0}
    ticks: dict[int, int] = {}  # last CPU ticks seen per process (misses each one's last < 0.1 s)
    start = time.perf_counter()
    proc = subprocess.Popen(
        args, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    log: list[bytes] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        pids = job_pids(proc.pid)
        ticks.update(pids)
        mem = [_memory_kb(p) for p in pids]
        peak["rss"] = max(peak["rss"], sum(m[0] for m in mem))
        peak["pss"] = max(peak["pss"], sum(m[1] for m in mem))
        peak["procs"] = max(peak["procs"], len(pids))
        if time.perf_counter() - start > timeout_s:
            _kill_session(proc.pid)
            break
        time.sleep(SAMPLE_INTERVAL_S)
    rc = proc.wait()
    wall = time.perf_counter() - start
    reader.join(timeout=5)
    _kill_session(proc.pid)  # anything the engine left behind (e.g. Ray daemons after a failure)
    if rc != 0:
        tail = b"".join(log).decode(errors="replace")[-3000:]
        print(f"[{engine} N={workers}] exit {rc}:\n{tail}", file=sys.stderr)
    cpu_s = sum(ticks.values()) / os.sysconf("SC_CLK_TCK")
    return {
        "wall_s": wall,
        "cpu_s": cpu_s,
        "rc": rc,
        "rss_mb": peak["rss"] / 1024,
        "pss_mb": peak["pss"] / 1024,
        "procs": peak["procs"],
    }


def _kill_session(sid: int) -> None:
    for pid, (_, session, _) in _proc_table().items():
        if session == sid:
            try:
                os.kill(pid, 9)
            except OSError:
                pass


def stream_checksum(out_dir: Path, n_docs: int) -> tuple[str, int]:
    """xxh3-64 of all documents' tokens in file order, from any engine's spills; checks none is missing."""
    where: dict[int, tuple[Path, int, int]] = {}
    for idx_file in sorted(out_dir.glob("*.idx.npy")):
        bin_file = idx_file.with_name(idx_file.name.removesuffix(".idx.npy") + ".bin")
        for doc, offset, length in np.load(idx_file).tolist():
            assert doc not in where, f"document {doc} written twice"
            where[doc] = (bin_file, offset, length)
    assert len(where) == n_docs, f"{len(where)} documents written, {n_docs} expected"
    digest, tokens, maps = xxhash.xxh3_64(), 0, {}
    for doc in sorted(where):
        path, offset, length = where[doc]
        if path not in maps:
            maps[path] = np.fromfile(path, dtype=np.uint16)
        digest.update(maps[path][offset : offset + length].tobytes())
        tokens += length
    return digest.hexdigest(), tokens


# ---------------------------------------------------------------- corpus, tokenizer, install footprint


def make_corpus(root: Path, target_bytes: int, seed: int = 0) -> tuple[int, int]:
    """Mutated stdlib files, one document each, named `<index>_<name>`; returns (files, bytes)."""
    rng = np.random.default_rng(seed)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(
        p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts
    )
    words = (
        "alpha beta gamma delta parse token shard buffer stream index cache merge split value node".split()
    )
    root.mkdir(parents=True)
    total = count = 0
    rounds = 0
    while total < target_bytes:
        for src in sources:
            if total >= target_bytes:
                break
            data = src.read_bytes()
            if not data.strip():
                continue
            if rounds:
                name = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=4))
                header = "# " + " ".join(rng.choice(words, size=12)) + "\n"
                data = header.encode() + data.replace(b"self", f"self_{name}".encode())
            if count % 97 == 13:
                data += b"\n# \xff\xfe not utf-8 \xc3\x28\n"
            (root / f"{count:06d}_{src.name}").write_bytes(data)
            total += len(data)
            count += 1
        rounds += 1
    return count, total


def train_tokenizer(corpus: Path, tok_dir: Path, vocab_size: int) -> float:
    """Train the tenx BPE on the first ~5 MB of the corpus (in a shuffled file order); returns seconds."""
    from tenx.data.tokenizer import train_bpe

    files = sorted(corpus.iterdir())
    order = np.random.default_rng(1).permutation(len(files))
    texts, size = [], 0
    for i in order:
        text = clean(files[i].read_bytes())
        if text is not None:
            texts.append(text)
            size += len(text)
        if size >= TOKENIZER_SAMPLE_BYTES:
            break
    start = time.perf_counter()
    tokenizer = train_bpe(texts, vocab_size)
    seconds = time.perf_counter() - start
    tok_dir.mkdir(parents=True)
    (tok_dir / "entry.json").write_text(json.dumps(tokenizer.save(tok_dir)))
    return seconds


def _dist_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(name: str, extras: tuple[str, ...] = ()) -> set[str]:
    """Names of the installed distributions `name[extras]` requires, transitively (itself included)."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    visited: set[tuple[str, tuple[str, ...]]] = set()
    stack = [(name, extras)]
    while stack:
        dist_name, dist_extras = stack.pop()
        key = _dist_name(dist_name)
        if (key, dist_extras) in visited:
            continue
        visited.add((key, dist_extras))
        try:
            dist = im.distribution(dist_name)
        except im.PackageNotFoundError:
            continue
        seen.add(key)
        envs = [{"extra": e} for e in dist_extras] or [{"extra": ""}]
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or any(req.marker.evaluate(e) for e in envs):
                stack.append((req.name, tuple(sorted(req.extras))))
    return seen


def _dist_mb(name: str) -> float:
    dist = im.distribution(name)
    total = 0
    for f in dist.files or []:
        try:
            total += Path(dist.locate_file(f)).stat().st_size
        except OSError:
            pass
    return total / 1e6


def install_footprint() -> dict[str, dict[str, Any]]:
    """MB of each engine package, and with the dependencies it adds beyond tenx's own."""
    base = _closure("tenx")
    out = {}
    for engine, (dist, extras) in {"datatrove": ("datatrove", ()), "ray": ("ray", ("data",))}.items():
        try:
            own = _dist_mb(dist)
        except im.PackageNotFoundError:
            continue
        added = sorted(_closure(dist, extras) - base - {_dist_name(dist)})
        out[engine] = {
            "package_mb": round(own, 1),
            "added_deps": added,
            "total_mb": round(own + sum(_dist_mb(d) for d in added), 1),
            "version": im.version(dist),
        }
    return out


# ---------------------------------------------------------------- main


def _fmt(values: list[float], digits: int = 2) -> str:
    med = statistics.median(values)
    spread = max(values) - min(values) if len(values) > 1 else 0.0
    return f"{med:.{digits}f}" + (f" ±{spread / 2:.{digits}f}" if len(values) > 1 else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=150.0, help="corpus size in MB (10^6 bytes)")
    parser.add_argument("--repeats", type=int, default=1, help="measurements per engine and N (interleaved)")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--workers", default="1,2", help="comma-separated N")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job before it is killed")
    parser.add_argument("--tmp", default=None, help="parent of the temporary directory")
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    workers = [int(n) for n in args.workers.split(",")]

    tmp = Path(tempfile.mkdtemp(prefix="tenx-data-engines-", dir=args.tmp))
    try:
        t0 = time.perf_counter()
        n_files, n_bytes = make_corpus(tmp / "corpus", int(args.mb * 1e6))
        tiny = tmp / "tiny"
        tiny.mkdir()
        (tiny / "000000_tiny.py").write_text("x = 1\n")
        print(
            f"corpus: {n_files} files, {n_bytes / 1e6:.1f} MB ({time.perf_counter() - t0:.1f} s)", flush=True
        )
        train_s = train_tokenizer(tmp / "corpus", tmp / "tok", args.vocab_size)
        print(f"tokenizer: BPE vocab {args.vocab_size} trained on ~5 MB in {train_s:.1f} s", flush=True)

        runs: dict[tuple[str, int], dict[str, list]] = {}
        job = 0
        for rep in range(args.repeats):
            for n in workers:
                for engine in engines:
                    for kind, corpus in (("startup", tiny), ("full", tmp / "corpus")):
                        job += 1
                        out = tmp / f"out-{job:03d}"
                        r = run_job(engine, n, corpus, tmp / "tok", out, args.timeout)
                        rec = runs.setdefault((engine, n), {})
                        if r["rc"] != 0:
                            rec.setdefault(f"{kind}_failed", []).append(r["rc"])
                        elif kind == "startup":
                            rec.setdefault("startup_s", []).append(r["wall_s"])
                        else:
                            checksum, tokens = stream_checksum(out, n_files)
                            rec.setdefault("wall_s", []).append(r["wall_s"])
                            rec.setdefault("mb_per_s", []).append(n_bytes / 1e6 / r["wall_s"])
                            rec.setdefault("mb_per_cpu_s", []).append(n_bytes / 1e6 / max(r["cpu_s"], 1e-9))
                            rec.setdefault("rss_mb", []).append(r["rss_mb"])
                            rec.setdefault("pss_mb", []).append(r["pss_mb"])
                            rec.setdefault("procs", []).append(r["procs"])
                            rec.setdefault("checksum", []).append(checksum)
                            rec.setdefault("tokens", []).append(tokens)
                        shutil.rmtree(out, ignore_errors=True)
                        print(
                            f"  rep {rep} {engine:9s} N={n} {kind:7s} {r['wall_s']:7.2f} s  cpu {r['cpu_s']:6.1f} s  "
                            f"rss {r['rss_mb']:7.0f} MB  pss {r['pss_mb']:7.0f} MB  procs {r['procs']}"
                            + (f"  FAILED rc={r['rc']}" if r["rc"] else ""),
                            flush=True,
                        )

        reference = (runs.get(("mp", 1), {}).get("checksum") or [None])[0]
        footprint = install_footprint()
        print()
        print(f"{n_bytes / 1e6:.1f} MB, {n_files} files; medians ± half-spread over {args.repeats} run(s)")
        header = (
            f"{'engine':10s} {'N':>2s} {'MB/s':>12s} {'MB/cpu-s':>12s} {'wall s':>12s} {'startup s':>11s} "
        )
        header += f"{'peak RSS MB':>13s} {'peak PSS MB':>13s} {'procs':>5s}  checksum"
        print(header)
        result: dict[str, Any] = {
            "bench": "data_engines",
            "mb": round(n_bytes / 1e6, 1),
            "files": n_files,
            "repeats": args.repeats,
            "mb_per_s": {},
            "mb_per_cpu_s": {},
            "startup_s": {},
            "peak_rss_mb": {},
            "peak_pss_mb": {},
            "deterministic": {},
            "install_mb": {e: footprint[e]["total_mb"] for e in footprint},
        }
        for engine in engines:
            sums = set()
            for n in workers:
                rec = runs.get((engine, n), {})
                if "mb_per_s" not in rec:
                    print(f"{engine:10s} {n:2d}  failed: {rec}")
                    continue
                sums |= set(rec["checksum"])
                print(
                    f"{engine:10s} {n:2d} {_fmt(rec['mb_per_s']):>12s} {_fmt(rec['mb_per_cpu_s']):>12s} "
                    f"{_fmt(rec['wall_s'], 1):>12s} "
                    f"{_fmt(rec.get('startup_s', [float('nan')])):>11s} {_fmt(rec['rss_mb'], 0):>13s} "
                    f"{_fmt(rec['pss_mb'], 0):>13s} {max(rec['procs']):5d}  {','.join(sorted(set(rec['checksum'])))}"
                )
                result["mb_per_s"].setdefault(engine, {})[n] = round(statistics.median(rec["mb_per_s"]), 2)
                if rec.get("startup_s"):
                    result["startup_s"].setdefault(engine, {})[n] = round(
                        statistics.median(rec["startup_s"]), 2
                    )
                result["mb_per_cpu_s"].setdefault(engine, {})[n] = round(
                    statistics.median(rec["mb_per_cpu_s"]), 2
                )
                result["peak_rss_mb"].setdefault(engine, {})[n] = round(statistics.median(rec["rss_mb"]))
                result["peak_pss_mb"].setdefault(engine, {})[n] = round(statistics.median(rec["pss_mb"]))
            if sums:
                result["deterministic"][engine] = len(sums) == 1 and (
                    reference is None or sums == {reference}
                )
        print()
        for engine, fp in footprint.items():
            print(
                f"install {engine} {fp['version']}: package {fp['package_mb']} MB, "
                f"{fp['total_mb']} MB with added deps {', '.join(fp['added_deps']) or '-'}"
            )
        print(json.dumps(result))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
