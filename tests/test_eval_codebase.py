"""`tenx eval --split DIR` on any codebase: every text file, .gitignore, include/exclude, size limit, binary
and non-UTF-8 files, figures per language and per directory, decontamination (tests/data/polyglot)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tenx.cli import main
from tenx.data.codebase import language_of, parse_gitignore, read_codebase
from tenx.errors import DataError, TenxError
from tenx.eval.evaluate import evaluate
from tenx.train.run import train

POLYGLOT = Path(__file__).parent / "data" / "polyglot"
SETTINGS = ("train.steps=8", "train.eval_every=0", "checkpoint.every=8", "train.threads=1")
LATIN1_BAD_BYTES = 5  # é è ï é é in legacy/latin1.txt: each becomes U+FFFD, 3 bytes in UTF-8

SCORED = {
    ".gitignore": "(none)",
    "LICENSE": "(none)",
    "README.md": "Markdown",
    "c/ring.c": "C",
    "c/ring.h": "C",
    "data/config.json": "JSON",
    "docs/guide.md": "Markdown",
    "docs/notes.txt": "text",  # /notes.txt is anchored to the top directory
    "go/main.go": "Go",
    "keep.log": ".log",  # re-included by !keep.log
    "legacy/latin1.txt": "text",
    "tools/build_info.py": "Python",
    "web/.gitignore": "(none)",
    "web/index.html": "HTML",
    "web/index.js": "JavaScript",
    "web/package.json": "JSON",
}
IGNORED = ["debug.log", "notes.txt", "out", "web/app.min.js", "web/bundle"]


@pytest.fixture
def polyglot(tmp_path) -> Path:
    """A copy of tests/data/polyglot with its `_gitignore` files named `.gitignore` (see its README)."""
    root = tmp_path / "polyglot"
    shutil.copytree(POLYGLOT, root)
    for committed in sorted(root.rglob("_gitignore")):
        committed.rename(committed.with_name(".gitignore"))
    return root


def expected_bytes(root: Path, path: str) -> int:
    size = (root / path).stat().st_size
    return size + 2 * LATIN1_BAD_BYTES if path == "legacy/latin1.txt" else size


@pytest.fixture(scope="module")
def run(tiny_data, tiny_config, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("evalcode") / "run"
    train(tiny_config(tiny_data, *SETTINGS), out)
    return out


def test_corpus_is_small_and_licensed():
    total = sum(p.stat().st_size for p in POLYGLOT.rglob("*") if p.is_file())
    assert total < 60_000
    assert "Apache-2.0" in (POLYGLOT / "LICENSE").read_text()
    assert "Apache-2.0" in (POLYGLOT / "README.md").read_text()
    assert b"\x00" in (POLYGLOT / "assets" / "logo.png").read_bytes()[:8192]
    with pytest.raises(UnicodeDecodeError):
        (POLYGLOT / "legacy" / "latin1.txt").read_bytes().decode("utf-8")


def test_every_text_file_is_read_gitignore_respected_binary_skipped(polyglot):
    (polyglot / ".git").mkdir()
    (polyglot / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    found = read_codebase(polyglot)
    assert [f.path for f in found.files] == sorted(SCORED)
    assert {f.path: f.num_bytes for f in found.files} == {p: expected_bytes(polyglot, p) for p in SCORED}
    assert found.skipped == {"binary": 1, "gitignored": 5}
    assert found.skipped_examples == {"binary": ["assets/logo.png"], "gitignored": IGNORED}
    latin1 = next(f for f in found.files if f.path == "legacy/latin1.txt")
    assert latin1.text.startswith("Caf\ufffd cr\ufffdme") and latin1.num_bytes == 57 + 2 * LATIN1_BAD_BYTES
    assert found.decoded_with_replacement == ["legacy/latin1.txt"]
    assert {p: language_of(p) for p in SCORED} == SCORED
    # without the .gitignore files, the ignored files are scored (and the binary is still skipped)
    assert len(read_codebase(polyglot, gitignore=False).files) == len(SCORED) + 5


def test_include_exclude_and_size_limit(polyglot):
    found = read_codebase(polyglot, include=["*.c", "*.h", "web/**"], exclude=["web/*.html"])
    assert [f.path for f in found.files] == [
        "c/ring.c",
        "c/ring.h",
        "web/.gitignore",
        "web/index.js",
        "web/package.json",
    ]
    assert found.skipped == {"excluded": 12, "gitignored": 5}
    # a directory excluded whole counts once and is not entered
    found = read_codebase(polyglot, exclude=["docs", "**/*.json"])
    assert {f.path for f in found.files} == set(SCORED) - {
        "docs/guide.md",
        "docs/notes.txt",
        "data/config.json",
        "web/package.json",
    }
    assert found.skipped["excluded"] == 3
    # the size limit: ring.c (879 bytes) and the others over 500 bytes are skipped and counted
    big = sorted(p for p in SCORED if (polyglot / p).stat().st_size > 500)
    assert big == ["README.md", "c/ring.c", "go/main.go"]
    found = read_codebase(polyglot, max_file_bytes=500)
    assert [f.path for f in found.files] == sorted(set(SCORED) - set(big))
    assert found.skipped == {"gitignored": 5, "too_large": 4}  # the 852-byte PNG is over the limit too
    assert len(read_codebase(polyglot, max_file_bytes=0).files) == len(SCORED)


def test_links_leaving_the_directory_and_fifos_are_skipped(polyglot, tmp_path):
    outside = tmp_path / "secret.c"
    outside.write_text("int secret = 1;\n")
    (polyglot / "c" / "leak.c").symlink_to(outside)
    (polyglot / "c" / "alias.h").symlink_to(polyglot / "c" / "ring.h")  # inside: read
    (polyglot / "linked").symlink_to(polyglot / "go", target_is_directory=True)
    os.mkfifo(polyglot / "c" / "pipe.c")
    found = read_codebase(polyglot)
    paths = [f.path for f in found.files]
    assert "c/alias.h" in paths and "c/leak.c" not in paths and "c/pipe.c" not in paths
    assert len(paths) == len(SCORED) + 1
    assert found.skipped == {"binary": 1, "gitignored": 5, "outside": 1, "special": 1, "linked_directory": 1}


def test_gitignore_syntax():
    def ignored(text: str, path: str, is_dir: bool = False) -> bool:
        verdict = False
        for rule in parse_gitignore(text):
            if rule.dir_only and not is_dir:
                continue
            if rule.regex.fullmatch(path):
                verdict = not rule.negated
        return verdict

    assert ignored("*.o", "a/b/x.o") and not ignored("*.o", "a/b/x.oo")
    assert ignored("/top.txt", "top.txt") and not ignored("/top.txt", "sub/top.txt")
    assert ignored("doc/*.txt", "doc/a.txt") and not ignored("doc/*.txt", "doc/sub/a.txt")
    assert ignored("doc/**/*.txt", "doc/sub/deep/a.txt") and ignored("doc/**/*.txt", "doc/a.txt")
    assert ignored("**/cache", "x/y/cache") and ignored("**/cache", "cache")
    assert ignored("lib/**", "lib/a/b.c") and not ignored("lib/**", "lib")
    assert ignored("file?.c", "file1.c") and not ignored("file?.c", "file12.c")
    assert ignored("[ab].c", "a.c") and not ignored("[ab].c", "c.c") and ignored("[!ab].c", "c.c")
    assert ignored("tmp/", "tmp", is_dir=True) and not ignored("tmp/", "tmp")
    assert not ignored("*.log\n!keep.log", "keep.log") and ignored("*.log\n!keep.log", "other.log")
    assert not ignored("# a comment\n\n   \n", "# a comment")
    assert ignored("\\#hash", "#hash") and ignored("\\!bang", "!bang")


def test_eval_directory_per_language_and_directory(run, polyglot, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", str(run), "--split", str(polyglot), "--out", str(out), "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())["datasets"][str(polyglot)]
    languages = r["by_language"]
    assert set(languages) == {
        "C",
        "Go",
        "JavaScript",
        "HTML",
        "JSON",
        "Markdown",
        "Python",
        "text",
        "(none)",
        ".log",
    }
    for language in languages:
        files = [p for p, lang in SCORED.items() if lang == language]
        assert languages[language]["documents"] == len(files)
        assert languages[language]["bytes"] == sum(expected_bytes(polyglot, p) for p in files)
        # bytes tokenizer: one token per byte, plus each document's end-of-document token
        assert languages[language]["tokens"] == languages[language]["bytes"] + len(files)
        assert languages[language]["bits_per_byte"] > 0
    assert (
        languages["C"]["bytes"]
        == (polyglot / "c/ring.c").stat().st_size + (polyglot / "c/ring.h").stat().st_size
    )
    assert r["bytes"] == sum(expected_bytes(polyglot, p) for p in SCORED)
    assert sum(g["nll_nats"] for g in languages.values()) == pytest.approx(r["nll_nats"], rel=1e-9)
    directories = r["by_directory"]
    assert set(directories) == {".", "c", "data", "docs", "go", "legacy", "tools", "web"}
    assert directories["web"]["documents"] == 4 and directories["."]["documents"] == 4
    assert sum(g["bytes"] for g in directories.values()) == r["bytes"]
    assert r["files"]["scored"] == 16
    assert r["files"]["skipped"] == {"binary": 1, "gitignored": 5}
    assert r["files"]["decoded_with_replacement"] == 1
    assert "files: 16 scored (1 not valid UTF-8, bad bytes replaced); skipped: 1 binary" in printed
    assert "by language:" in printed and "by directory:" in printed
    c_line = next(line for line in printed.splitlines() if line.strip().startswith("C "))
    assert c_line.split()[-2] == f"{languages['C']['bytes']:,}"


def test_a_c_only_directory_is_scored_and_filters_apply(run, polyglot, tmp_path, capsys):
    c_only = tmp_path / "c_only"
    shutil.copytree(polyglot / "c", c_only)
    # before: "no text documents to evaluate" (only *.py, *.md and *.txt were read)
    report = evaluate(run, [str(c_only)], tmp_path / "c.json", device="cpu")
    r = report["datasets"][str(c_only)]
    assert set(r["by_language"]) == {"C"} and r["by_language"]["C"]["documents"] == 2
    assert r["bytes"] == 879 + 393 and r["tokens"] == 879 + 393 + 2
    assert report["overall"]["bytes"] == r["bytes"]
    # the CLI's filters: only the headers, under a size limit that keeps them
    assert (
        main(
            [
                "eval",
                str(run),
                "--split",
                str(polyglot),
                "--include",
                "*.h",
                "--include",
                "go/**",
                "--exclude",
                "**/main.go",
                "--max-file-bytes",
                "400",
                "--out",
                str(tmp_path / "h.json"),
            ]
        )
        == 0
    )
    r = json.loads((tmp_path / "h.json").read_text())["datasets"][str(polyglot)]
    assert r["by_language"].keys() == {"C"} and r["bytes"] == 393
    assert r["files"]["skipped"] == {"excluded": 16, "gitignored": 5}
    capsys.readouterr()
    # nothing left to score: the error says why
    with pytest.raises(
        DataError, match=r"no text files to evaluate \(skipped: 2 larger than --max-file-bytes"
    ):
        evaluate(run, [str(c_only)], tmp_path / "x.json", max_file_bytes=10)
    with pytest.raises(TenxError, match="give one with --split DIR"):
        evaluate(run, ["heldout"], tmp_path / "x.json", include=["*.c"])
    with pytest.raises(SystemExit) as usage:
        main(["eval", str(run), "--split", str(c_only), "--max-file-bytes", "-1"])
    assert usage.value.code == 2
    assert "--max-file-bytes: must be an integer >= 0, got '-1'" in capsys.readouterr().err


def test_decontaminate_a_directory(run, polyglot, tiny_data, tmp_path, monkeypatch):
    from tenx.data.tokenizer import load_tokenizer
    from tenx.eval.documents import split_documents

    monkeypatch.setenv("TENX_CACHE_DIR", str(tmp_path / "cache"))
    tok = load_tokenizer(tiny_data)
    (polyglot / "vendored").mkdir()
    (polyglot / "vendored" / "copied.py").write_text(
        tok.decode(split_documents(tiny_data, "train")[3].tokens)
    )
    report = evaluate(run, [str(polyglot)], tmp_path / "eval.json", decontaminate=True)
    r = report["datasets"][str(polyglot)]
    c = r["contamination"]
    assert c["documents"] == len(SCORED) + 1
    assert c["contaminated_names"] == ["vendored/copied.py"]
    assert r["clean"]["documents"] == len(SCORED)
    assert r["clean"]["bytes"] == sum(expected_bytes(polyglot, p) for p in SCORED)
    assert r["by_language"]["Python"]["documents"] == 2
