"""Issue 47, part C: crafted inputs that hung, ran away or misled now end in one `error:` line naming the flag,
field or pattern (or a WARNING where the input is legal but a figure would mislead)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tenx.cli import main
from tenx.data.tokenizer import BPE_FILE, BPETokenizer, train_bpe
from tenx.data.tokenizer_regex import backtracking_problem

# ----- item 6: a pre-tokenizer regex that backtracks ---------------------------------------------------------

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEEPSEEK = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.mark.parametrize("pattern", [GPT2, LLAMA3, O200K, DEEPSEEK, r"\p{N}{1,3}", r"(?:ab)+", r"[]a]+x{2,}"])
def test_byte_level_bpe_patterns_pass(pattern):
    assert backtracking_problem(pattern) is None


@pytest.mark.parametrize(
    "pattern, why",
    [
        (r"(a+)+$", "repetition"),
        (r"(a|aa)*", "alternation"),
        (r"(?:a?){30}a{30}", "repetition"),
        (r"(?i:a|b)+", "alternation"),
        (r"((ab)*c)+", "repetition"),
        (r"(a)\1", "backreference"),
        ("a" * 5000, "characters long"),
    ],
)
def test_backtracking_patterns_are_named(pattern, why):
    assert why in backtracking_problem(pattern)


def _tokenizer_dir(tmp_path: Path, pattern: str | None) -> Path:
    """A model directory whose tokenizer.json splits on `pattern` before its byte-level step."""
    tree = json.loads(train_bpe(["hello world aaaa"] * 10, 300).to_json())
    if pattern is not None:
        split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
        tree["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, tree["pre_tokenizer"]]}
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / BPE_FILE).write_text(json.dumps(tree))
    return directory


@pytest.fixture
def aaa_source(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"f{i}.txt").write_text(("a" * 40 + "b\n") * 3 + f"document {i}\n")
    return src


def _prepare(source: Path, out: Path, tokenizer_dir: Path) -> list[str]:
    return [
        "data", "prepare", "--source", str(source), "--out", str(out), "--tokenizer-from", str(tokenizer_dir),
        "--workers", "2", "--val-ratio", "0.1", "--heldout-ratio", "0.1", "--quiet",
    ]  # fmt: skip


def test_prepare_refuses_a_backtracking_pattern_before_reading(aaa_source, tmp_path, capsys):
    started = time.monotonic()
    assert main(_prepare(aaa_source, tmp_path / "out", _tokenizer_dir(tmp_path, r"(a+)+$"))) == 2
    err = capsys.readouterr().err
    assert "'(a+)+$'" in err and "pre_tokenizer" in err and err.count("error:") == 1
    assert not (tmp_path / "out").exists()  # refused before any worker started
    assert time.monotonic() - started < 30  # hang guard


class _Panic(BaseException):
    """Stands for pyo3's PanicException, which derives from BaseException and killed the pool's worker."""


_MAIN_PID = os.getpid()
_ENCODE = BPETokenizer.encode


def _panicking_encode_batch(self, texts):
    if os.getpid() != _MAIN_PID:  # in the prepare workers only
        raise _Panic("Onig: Regex search error: retry-limit-in-match over")
    return [_ENCODE(self, text) for text in texts]


def _panicking_encode(self, text):
    if os.getpid() != _MAIN_PID and "a" * 40 in text:
        raise _Panic("Onig: Regex search error: retry-limit-in-match over")
    return _ENCODE(self, text)


def test_a_worker_panic_ends_prepare_with_an_error(aaa_source, tmp_path, monkeypatch, capsys):
    """A pattern that passes the check and still reaches Oniguruma's retry limit ends in an error naming it
    and the document (the workers are forked, so they see the patched tokenizer)."""
    monkeypatch.setattr(BPETokenizer, "encode_batch", _panicking_encode_batch)
    monkeypatch.setattr(BPETokenizer, "encode", _panicking_encode)
    started = time.monotonic()
    assert main(_prepare(aaa_source, tmp_path / "out", _tokenizer_dir(tmp_path, r"a+b"))) == 2
    err = capsys.readouterr().err
    assert "retry-limit-in-match" in err and "'a+b'" in err and "document" in err
    assert time.monotonic() - started < 60  # hang guard: it waited for ever


def _dying_batch(batch):
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_worker_ends_prepare_with_an_error(aaa_source, tmp_path, monkeypatch, capsys):
    from tenx.data.prepare import pool, stream

    monkeypatch.setattr(stream, "_tokenize_batch", _dying_batch)
    monkeypatch.setattr(pool, "_POLL_S", 0.2)
    started = time.monotonic()
    assert main(_prepare(aaa_source, tmp_path / "out", _tokenizer_dir(tmp_path, None))) == 2
    err = capsys.readouterr().err
    assert "worker process died (signal 9" in err
    assert time.monotonic() - started < 60  # hang guard


# ----- item 7: eval --split DIR: globs, deep trees, long files -----------------------------------------------


def _gitignored(text: str, path: str) -> bool:
    from tenx.data.codebase import parse_gitignore

    verdict = False
    for rule in parse_gitignore(text):
        if rule.regex.fullmatch(path):
            verdict = not rule.negated
    return verdict


def test_many_double_star_segments_match_in_linear_time():
    deep = "/".join(["a"] * 1100)
    started = time.monotonic()
    assert not _gitignored("**/" * 20 + "x", deep)  # 20 segments: hung (14 took 111 s)
    assert _gitignored("**/" * 20 + "a", deep)
    assert not _gitignored("/".join(["a/**"] * 20) + "/b", deep)
    assert not _gitignored("*a" * 30 + "*b", "a" * 250)  # many stars in one name
    assert _gitignored("*a" * 30 + "*", "a" * 250)
    assert time.monotonic() - started < 5  # hang guard


def test_include_exclude_globs_are_linear_too(tmp_path):
    from tenx.data.codebase import read_codebase

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("print(1)\n")
    (tmp_path / "src" / "b.txt").write_text("hello\n")
    started = time.monotonic()
    found = read_codebase(tmp_path, include=["**/" * 20 + "*.py"], exclude=["**/" * 20 + "*.c"])
    assert [f.path for f in found.files] == ["src/a.py"]
    assert time.monotonic() - started < 5  # hang guard


def test_a_deep_tree_is_walked_and_what_is_too_deep_counted(tmp_path):
    from tenx.data.codebase import MAX_DEPTH, read_codebase

    root = tmp_path / "tree"
    (root / "top.txt").parent.mkdir()
    (root / "top.txt").write_text("top\n")
    fd = os.open(root, os.O_RDONLY)
    try:  # 1,100 nested directories, made relative to each one's parent (the full path is too long for open)
        for _ in range(1100):
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
        with open(os.open("deep.txt", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "w") as f:
            f.write("deep\n")
    finally:
        os.close(fd)
    (root / "d" / "d" / "near.txt").write_text("near\n")
    try:
        found = read_codebase(root)  # RecursionError before
        assert [f.path for f in found.files] == ["d/d/near.txt", "top.txt"]
        assert found.skipped == {"too_deep": 1}
        assert found.skipped_examples["too_deep"][0].count("/") == MAX_DEPTH
    finally:  # flatten the tree: shutil.rmtree (pytest's clean-up) recurses too
        todo, k = [root / "d"], 0
        while todo:
            parent = todo.pop()
            if (parent / "d").is_dir():
                os.rename(parent / "d", root / f"x{k}")
                todo += [root / f"x{k}"]
                k += 1


@pytest.fixture(scope="module")
def tiny_run(tiny_data, tiny_config, tmp_path_factory) -> Path:
    from tenx.train.run import train

    out = tmp_path_factory.mktemp("round4") / "run"
    train(tiny_config(tiny_data, "train.steps=4", "train.eval_every=0", "checkpoint.every=4"), out)
    return out


def test_a_long_file_is_encoded_in_pieces_with_the_same_tokens(monkeypatch):
    from tenx.eval import documents

    tokenizer = train_bpe(["def f(x):\n    return x + 1\n", "class A:\n    pass\n"] * 50, 400)
    text = "".join(
        f"def f{i}(x):\n    return x * {i}  # line {i}\nvalue_{i} = f{i}(2)\n" for i in range(3000)
    )
    monkeypatch.setattr(documents, "ENCODE_CHARS", 1000)
    assert len(documents._pieces(text)) > 50
    (ids,) = documents.encode_texts(tokenizer, [text])
    assert ids.tolist() == tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


LINE = "x = compute(1, 2)  # a line of code\n"


def _eval_one_big_file(tiny_run, tmp_path, lines: int) -> tuple[Path, list[str]]:
    """A directory holding one file of `lines` LINEs, and the `tenx eval` argv (bar threads and batch size)
    that scores it without a file size limit into tmp_path/e.json."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "big.py").write_text(LINE * lines)
    out = str(tmp_path / "e.json")
    return code, ["eval", str(tiny_run), "--split", str(code), "--max-file-bytes", "0", "--out", out]


def test_a_long_evaluation_prints_progress(tiny_run, tmp_path, monkeypatch, capsys):
    """`--max-file-bytes 0` on a large file: minutes of scoring on a CPU now say how far they got (a line
    every PROGRESS_S where stderr is a log; here every batch)."""
    from tenx.eval import bpb

    monkeypatch.setattr(bpb, "PROGRESS_S", 0.0)
    code, argv = _eval_one_big_file(tiny_run, tmp_path, 3000)  # 108 KB
    assert main([*argv, "--threads", "1", "--batch-size", "64"]) == 0
    err = capsys.readouterr().err
    assert "tenx eval: " in err and "batches of 108,001 tokens scored" in err
    report = json.loads((tmp_path / "e.json").read_text())
    assert report["datasets"][str(code)]["bytes"] == 108_000


@pytest.mark.slow
def test_a_50_mb_file_stays_under_4_gb(tiny_run, tmp_path):
    """The issue's case: --max-file-bytes 0 on a 50 MB file reached 1.9 GB and printed nothing for 170 s+."""
    import resource
    import subprocess
    import sys

    _, argv = _eval_one_big_file(tiny_run, tmp_path, 50_000_000 // len(LINE))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tenx", *argv, "--threads", "1", "--batch-size", "64"],
        capture_output=True, text=True, env=env, timeout=3600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "batches of" in done.stderr  # progress while it scores
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss < 4 * 1024 * 1024  # KiB


# ----- item 10: --seeds and --law-seeds bounded ----------------------------------------------------------


@pytest.mark.parametrize(
    "argv, named",
    [
        (["ladder", "--config", "tiny", "--budgets", "1e11", "--grid", "ratio", "--seeds", "1000000000"], "seeds"),
        (["ladder", "--config", "tiny", "--budgets", "1e11", "--noise-seeds", "1000000000"], "noise_seeds"),
        (["derisk", "--base", "tiny", "--budgets", "1e11,2e11", "--change", "w:model.aspect_ratio=64",
          "--seeds", "1000000000"], "seeds"),
        (["derisk", "--base", "tiny", "--budgets", "1e11,2e11", "--change", "w:model.aspect_ratio=64",
          "--mode", "data", "--unique-tokens", "100000", "--unique-tokens", "200000",
          "--law-seeds", "1000000000", "--law-seeds", "1"], "--law-seeds"),
    ],
)  # fmt: skip
def test_a_billion_seeds_are_refused_at_once(argv, named, tmp_path, capsys):
    started = time.monotonic()
    assert main([*argv, "--out", str(tmp_path / "out"), "--dry-run"]) == 2  # hung for ever
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and named in err and "1000" in err
    assert time.monotonic() - started < 30  # hang guard
    assert not (tmp_path / "out").exists()


# ----- items 12 and 13: the data-mode law's warnings, and a law that cannot be fitted -------------------------

LAW = {"E": 1.5, "A": 50.0, "B": 200.0, "alpha": 0.3, "beta": 0.3, "R_D_star": 5.0}


def _law_rows() -> list[dict]:
    """Six points of a known L(N, D, U): five single-epoch runs over two sizes, one repeating its data."""
    import numpy as np

    from tenx.scaling.fit import effective_data

    rows = []
    for n, d, u in [(1e6, 2e7, 2e7), (1e6, 4e7, 4e7), (1e6, 8e7, 8e7), (4e6, 4e7, 4e7), (4e6, 8e7, 8e7),
                    (4e6, 8e7, 2e7)]:  # fmt: skip
        d_eff = effective_data(np.array([d]), np.array([u]), LAW["R_D_star"])[0]
        loss = LAW["E"] + LAW["A"] / n ** LAW["alpha"] + LAW["B"] / d_eff ** LAW["beta"]
        rows.append(
            {"params": n, "tokens": d, "unique_tokens": u, "heldout_loss": float(loss), "budget": 6 * n * d}
        )
    return rows


def test_the_data_derisk_report_carries_the_fits_warnings():
    """Item 12: the verdicts came from a law `tenx fit` flags (too few runs, seed noise from one seed)
    without a word; the report now says so above them."""
    import numpy as np

    from tenx.scaling.derisk.data_multiplier import format_data_derisk, law_warnings
    from tenx.scaling.fit.laws import fit_data_constrained

    rows = _law_rows()
    fit = fit_data_constrained(*(np.array([r[k] for r in rows]) for k in ("params", "tokens", "unique_tokens",
                                                                           "heldout_loss")), bootstrap=4)  # fmt: skip
    warnings = law_warnings(fit, rows, 0.0, 0)
    assert any("6 runs fitted for 6 parameters: too few" in w for w in warnings)
    assert any(w.startswith("seed noise 0.0000 nats/token is from one seed") for w in warnings)
    assert not any("seed noise" in w for w in law_warnings(fit, rows, 0.01, 4))
    result = {
        "budgets": [1e14, 1e15], "law": {"form": fit.form, "params": fit.params, "n_points": 6},
        "law_max_abs_rel_error": 0.0, "baseline": [], "compare_unique_tokens": 20_000_000, "target": 1e17,
        "changes": [], "seed_sigma": 0.0, "warnings": warnings,
    }  # fmt: skip
    report = format_data_derisk(result)
    assert report.count("WARNING: ") == len(warnings) and "provisional" in report


def test_plan_choose_repeats_the_fits_warnings(tmp_path, capsys):
    params = {k: LAW[k] for k in ("E", "A", "B", "alpha", "beta")}
    fit = tmp_path / "fit.json"
    warning = "alpha = 0.05 is the lowest value the fit allows: the runs do not determine alpha"
    fit.write_text(json.dumps({"fit": {"law": "chinchilla", "params": params}, "warnings": [warning]}))
    out = tmp_path / "choices.json"
    argv = ["plan", "choose", "--config", "gpt2-d12", "--cluster", "h100-node", "--fit", str(fit)]
    assert main([*argv, "--budget", "1e19", "--top", "2", "--json", str(out)]) == 0
    assert f"WARNING: the fit in {fit}: {warning}" in capsys.readouterr().out
    assert json.loads(out.read_text())["fit_warnings"] == [warning]


def test_a_data_plan_whose_law_cannot_be_fitted_fails_its_dry_run(tiny_data, tmp_path, capsys):
    """Item 13: one model size (max_depth 1) passed --dry-run and failed only after training every run."""
    study = tmp_path / "study.toml"
    study.write_text(
        'base = "tiny"\n'
        f"set = ['data.dir=\"{tiny_data}\"', 'log.progress=false', 'train.threads=1']\n"
        'budgets = [2e10, 6e10]\nseeds = 1\nmode = "data"\nunique_tokens = [20000, 40000]\n'
        '[[change]]\nname = "rope"\nset = [\'model.pos="rope"\']\n'
        '[ladder]\ngrid = "ratio"\nmin_steps = 20\nmax_depth = 1\n'
    )
    out = tmp_path / "out"
    assert main(["derisk", "--config", str(study), "--out", str(out), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "cannot fit the data-constrained law" in err
    assert "over 1 model sizes" in err and "budgets" in err and "token_fractions" in err
    assert not out.exists()


# ----- item 15: --emit slurm refuses what a local run refuses ------------------------------------------------


@pytest.mark.parametrize(
    "flag, value, named",
    [
        ("--max-restarts", "-1", "--max-restarts"),
        ("--backoff", "nan", "--backoff"),
        ("--time", "forever", "--time"),
    ],
)
def test_emit_slurm_refuses_what_the_job_would_refuse(flag, value, named, tmp_path, capsys):
    script = tmp_path / "job.sbatch"
    argv = [
        "train",
        "--config",
        "tiny",
        "--run-dir",
        str(tmp_path / "run"),
        "--emit",
        "slurm",
        "-o",
        str(script),
    ]
    assert main([*argv, flag, value]) == 2  # written into the job script before
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and named in err and value in err
    assert not script.exists()


@pytest.mark.parametrize("value", ["90", "1-00:00:00", "12:00:00", "2-12", "UNLIMITED"])
def test_emit_slurm_takes_slurm_time_limits(value):
    from tenx.utils.scripts import slurm_time

    assert slurm_time(value, "--time") == value
