"""Preparing a corpus larger than memory: throughput per worker count, peak memory per corpus size, resume.

Generates (seeded) a directory of synthetic Python-like files: 0.5 GB, then grown to 2 GB, each with planted
exact duplicates (1%) and near duplicates (1%: a copy with a header line added and about 3% of its lines
changed). Prepares each with `python -m tenx data prepare` (BPE 8192, the tokenizer trained on a 64 MB
sample) in a fresh process while a sampler sums the proportional resident memory (Pss) of its process tree
every 0.1 s.

- `mb_per_s`: corpus MB / wall seconds of the whole prepare on the 0.5 GB corpus, 1 and 2 workers; the
  output must be byte-identical (`identical_across_workers`).
- `peak_rss_mb`: the process tree's peak on 0.5 GB and on 2 GB (2 workers); goal: ratio <= 1.2.
- `resume_identical`: a 2-worker prepare of 0.5 GB killed (SIGKILL, the whole process group) halfway through
  tokenization, then `--resume`: byte-identical to the uninterrupted one.
- `near_dups_found` / `near_dups_planted`: planted copies grouped with their original (manifest: documents
  in near-duplicate groups minus groups).
- Baseline, same process: Hugging Face `datasets` tokenizing the same 0.5 GB files with the same tokenizer
  (`load_dataset("text", sample_by="document")` then a batched `map`, num_proc 2): `vs_datasets` is our
  whole prepare's MB/s over its MB/s, and `tokenize_vs_datasets` our tokenize pass alone over it.

    python bench/prepare_scale.py [--out /tmp/prepare_scale] [--small-gb 0.5] [--large-gb 2]

The corpus and outputs are deleted at the end (--keep keeps them). About 25 minutes on 2 idle cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

WORDS = 6000
LINES = 300_000


def make_lines(rng: np.random.Generator) -> list[str]:
    """A pool of distinct Python-like lines built from a synthetic identifier vocabulary."""
    syllables = [
        "ka",
        "lo",
        "mi",
        "ra",
        "te",
        "zu",
        "po",
        "an",
        "el",
        "or",
        "ix",
        "um",
        "se",
        "di",
        "va",
        "ne",
    ]
    words = sorted({"".join(rng.choice(syllables, rng.integers(2, 5))) for _ in range(WORDS)})
    w = np.array(words)
    templates = [
        "def {0}_{1}({2}, {3}={n}):",
        "    {0} = {1}.{2}({3}, {n})",
        "    if {0} > {n} and not {1}:",
        "        return {0}({1}) + {2}",
        "    for {0} in range({n}):",
        "        {0}[{1}] = {2} * {n}",
        "class {0}{1}({2}):",
        '    """{0} the {1} of {2} with {3}."""',
        "    # {0} {1} {2} {3}",
        "import {0}.{1} as {2}",
        "    {0}.append({{'{1}': {2}, '{3}': {n}}})",
        "        raise {0}Error(f'{1} {{{2}}} {3}')",
    ]
    lines = set()
    while len(lines) < LINES:
        t = templates[rng.integers(len(templates))]
        lines.add(t.format(*rng.choice(w, 4), n=int(rng.integers(1000))))
    return sorted(lines)


def grow_corpus(root: Path, target_bytes: int, seed: int) -> dict[str, int]:
    """Add files under root until it holds target_bytes; returns counts of planted duplicates."""
    rng = np.random.default_rng(seed)
    lines = np.array(make_lines(np.random.default_rng(0)))
    counts = json.loads((root / ".counts.json").read_text()) if (root / ".counts.json").exists() else {}
    size, n = counts.get("bytes", 0), counts.get("files", 0)
    exact, near = counts.get("exact", 0), counts.get("near", 0)
    root.mkdir(parents=True, exist_ok=True)
    while size < target_bytes:
        body = "\n".join(lines[rng.integers(len(lines), size=int(rng.integers(200, 1200)))]) + "\n"
        d = root / f"pkg{n // 1000:04d}"
        d.mkdir(exist_ok=True)
        (d / f"mod{n:07d}.py").write_text(body)
        size, n = size + len(body), n + 1
        r = rng.random()
        if r < 0.01:
            (d / f"copy{n:07d}.py").write_text(body)
            size, n, exact = size + len(body), n + 1, exact + 1
        elif r < 0.02:
            edited = body.split("\n")
            for i in rng.integers(len(edited), size=max(1, len(edited) // 33)):
                edited[i] = str(lines[rng.integers(len(lines))])
            text = "# vendored copy, do not edit\n" + "\n".join(edited)
            (d / f"vendored{n:07d}.py").write_text(text)
            size, n, near = size + len(text), n + 1, near + 1
    counts = {"bytes": size, "files": n, "exact": exact, "near": near}
    (root / ".counts.json").write_text(json.dumps(counts))
    return counts


def tree_rss(pid: int) -> int:
    """Proportional resident bytes (Pss: a page shared by k processes counts 1/k in each, so forked workers
    sharing their parent's pages are not counted twice) of pid and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text()
            total += int(next(x.split()[1] for x in rollup.splitlines() if x.startswith("Pss:"))) * 1024
        except (OSError, ValueError, IndexError, StopIteration):
            pass
        todo += children.get(p, [])
    return total


def prepare(
    corpus: Path, out: Path, workers: int, *, resume: bool = False, kill_at: float | None = None
) -> dict:
    """Run `tenx data prepare` in a new process group; its wall time, peak tree RSS and pass timings."""
    cmd = [sys.executable, "-m", "tenx", "data", "prepare", "--source", str(corpus), "--out", str(out)]
    cmd += ["--workers", str(workers), "--tokenizer-sample-mb", "64", "--pattern", "**/*.py"]
    cmd += ["--resume"] if resume else []
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    killed = False
    if kill_at is not None:
        state = out / ".prepare-work" / "state.json"
        while proc.poll() is None:
            try:
                tok = json.loads(state.read_text()).get("tokenize", {})
            except (OSError, ValueError):
                tok = {}
            if tok.get("tokens", 0) >= kill_at:
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                break
            time.sleep(0.05)
    rc = proc.wait()
    stop.set()
    sampler.join()
    log.close()
    wall = time.perf_counter() - t0
    text = out.with_suffix(".log").read_text()
    if not killed and rc != 0:
        raise SystemExit(f"prepare failed (rc {rc}): see {out.with_suffix('.log')}\n{text[-2000:]}")
    passes = {}
    for line in text.splitlines():
        if line.startswith("passes (s): "):
            passes = {k: float(v) for k, v in (p.rsplit(" ", 1) for p in line[12:].split(", "))}
    return {"wall_s": wall, "peak_rss_mb": peak[0] / 2**20, "passes": passes, "killed": killed}


def outputs(out: Path) -> dict[str, str]:
    import xxhash

    return {p.name: xxhash.xxh3_64_hexdigest(p.read_bytes()) for p in sorted(out.iterdir()) if p.is_file()}


def datasets_baseline(corpus: Path, tokenizer_json: Path, work: Path) -> float:
    """Seconds for datasets to load the same files (one document per file) and tokenize them, 2 processes."""
    code = f"""
import os, sys, time
os.environ["RAYON_NUM_THREADS"] = "1"; os.environ["TOKENIZERS_PARALLELISM"] = "false"
from pathlib import Path
import datasets
from tokenizers import Tokenizer
files = sorted(str(p) for p in Path({str(corpus)!r}).rglob("*.py"))
tok = Tokenizer.from_file({str(tokenizer_json)!r})
def encode(batch):
    return {{"ids": [e.ids for e in tok.encode_batch_fast(batch["text"], add_special_tokens=False)]}}
t = time.perf_counter()
ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train", cache_dir={str(work)!r})
ds = ds.map(encode, batched=True, num_proc=2, remove_columns=["text"])
print("SECONDS", time.perf_counter() - t, len(ds))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("SECONDS")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/prepare_scale"))
    p.add_argument("--small-gb", type=float, default=0.5)
    p.add_argument("--large-gb", type=float, default=2.0)
    p.add_argument("--keep", action="store_true", help="keep the corpus and outputs")
    args = p.parse_args()
    root = args.out
    if root.exists() and not (root / "corpus" / ".counts.json").exists() and any(root.iterdir()):
        raise SystemExit(f"--out {root} holds files this benchmark did not write; choose another")
    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus"
    try:
        t = time.perf_counter()
        small = grow_corpus(corpus, int(args.small_gb * 1e9), seed=1)
        print(
            f"corpus {small['bytes'] / 1e9:.2f} GB, {small['files']:,} files in {time.perf_counter() - t:.0f} s",
            flush=True,
        )
        mb = small["bytes"] / 1e6
        runs = {}
        for workers in (1, 2):
            out = root / f"small-w{workers}"
            shutil.rmtree(out, ignore_errors=True)
            runs[workers] = prepare(corpus, out, workers)
            print(
                f"{workers} worker(s): {mb / runs[workers]['wall_s']:.2f} MB/s, peak {runs[workers]['peak_rss_mb']:.0f} MB, passes {runs[workers]['passes']}",
                flush=True,
            )
        identical = outputs(root / "small-w1") == outputs(root / "small-w2")
        manifest = json.loads((root / "small-w2" / "manifest.json").read_text())
        tokens = sum(s["tokens"] for s in manifest["splits"].values())
        itemsize = 2 if manifest["dtype"] == "uint16" else 4
        killed = root / "small-killed"
        shutil.rmtree(killed, ignore_errors=True)
        first = prepare(corpus, killed, 2, kill_at=tokens * itemsize / 2)
        resumed = prepare(corpus, killed, 2, resume=True)
        resume_identical = first["killed"] and outputs(killed) == outputs(root / "small-w2")
        print(
            f"killed halfway through tokenization, resumed in {resumed['wall_s']:.0f} s: identical {resume_identical}",
            flush=True,
        )
        hf_s = datasets_baseline(corpus, root / "small-w2" / "tokenizer.json", root / "hf-cache")
        shutil.rmtree(root / "hf-cache", ignore_errors=True)
        print(f"datasets load + map (2 processes): {mb / hf_s:.2f} MB/s", flush=True)
        dedup = manifest["dedup"]
        found = dedup["near_duplicate_documents"] - dedup["near_duplicate_groups"]

        t = time.perf_counter()
        large = grow_corpus(corpus, int(args.large_gb * 1e9), seed=2)
        print(f"corpus grown to {large['bytes'] / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s", flush=True)
        shutil.rmtree(root / "large-w2", ignore_errors=True)
        big = prepare(corpus, root / "large-w2", 2)
        print(
            f"2 workers on {large['bytes'] / 1e9:.2f} GB: {large['bytes'] / 1e6 / big['wall_s']:.2f} MB/s, peak {big['peak_rss_mb']:.0f} MB, passes {big['passes']}",
            flush=True,
        )
        big_dedup = json.loads((root / "large-w2" / "manifest.json").read_text())["dedup"]
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "bench": "prepare_scale",
        "corpus_gb": {"small": round(small["bytes"] / 1e9, 3), "large": round(large["bytes"] / 1e9, 3)},
        "mb_per_s": {str(w): round(mb / r["wall_s"], 3) for w, r in runs.items()},
        "mb_per_s_large_2_workers": round(large["bytes"] / 1e6 / big["wall_s"], 3),
        "peak_rss_mb": {"small": round(runs[2]["peak_rss_mb"], 1), "large": round(big["peak_rss_mb"], 1)},
        "peak_rss_ratio": round(big["peak_rss_mb"] / runs[2]["peak_rss_mb"], 3),
        "identical_across_workers": identical,
        "resume_identical": resume_identical,
        "near_dups_found": found,
        "near_dups_planted": small["near"],
        "near_dups_found_large": big_dedup["near_duplicate_documents"] - big_dedup["near_duplicate_groups"],
        "near_dups_planted_large": large["near"],
        "exact_dups_removed": manifest["stats"]["duplicates_removed"],
        "exact_dups_planted": small["exact"],
        "datasets_mb_per_s": round(mb / hf_s, 3),
        "vs_datasets": round(hf_s / runs[2]["wall_s"], 3),
        "tokenize_vs_datasets": round(hf_s / runs[2]["passes"].get("tokenize", float("nan")), 3),
        "passes_s": {"small_w1": runs[1]["passes"], "small_w2": runs[2]["passes"], "large_w2": big["passes"]},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
