"""Tokenizers: byte-level BPE (Hugging Face `tokenizers`) and raw UTF-8 bytes, behind one interface."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tenx.data.manifest import (
    BYTES_EOT_ID,
    BYTES_VOCAB_SIZE,
    MANIFEST_NAME,
    ManifestFieldError,
    check_tokenizer_entry,
    read_manifest,
    regular_file_size,
)
from tenx.errors import ConfigError, DataError
from tenx.utils.io import atomic_write_text, bytes_xxhash
from tenx.utils.text import first_line

EOT_TEXT = "<|endoftext|>"
"""How the end-of-document token is spelled when ids are decoded to text."""

BPE_FILE = "tokenizer.json"
MIN_BPE_VOCAB = 257
"""256 byte tokens plus the end-of-document token: the smallest byte-level BPE vocabulary (no merges)."""


class Tokenizer(ABC):
    """Maps text to token ids and back; `decode(encode(s)) == s` for every str that is valid UTF-8."""

    kind: str
    """"bpe" or "bytes"."""
    vocab_size: int
    """Number of ids in use, including the end-of-document token."""
    eot_id: int
    """Id appended after every document in the token stream."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (without the end-of-document token)."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text; subclasses parallelise where they can."""
        return [self.encode(text) for text in texts]

    @abstractmethod
    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of `ids`; the end-of-document id decodes to EOT_TEXT, invalid UTF-8 to U+FFFD."""

    @abstractmethod
    def save(self, directory: Path) -> dict[str, Any]:
        """Write the tokenizer's files (if any) into `directory` and return its manifest entry."""

    @abstractmethod
    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for (b"" for the end-of-document id): a stream's bytes are theirs joined."""


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are the UTF-8 bytes of the text; 256 ends a document."""

    kind = "bytes"
    vocab_size = BYTES_VOCAB_SIZE
    eot_id = BYTES_EOT_ID

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of `text` as ids."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of byte ids, with EOT_TEXT in place of each end-of-document id."""
        array = np.asarray(ids, dtype=np.int64)
        if array.size and (array.min() < 0 or array.max() > self.eot_id):
            raise ValueError(f"byte tokenizer ids must lie in 0..{self.eot_id}")
        pieces = np.split(array, np.flatnonzero(array == self.eot_id))
        # Every piece after the first starts with the end-of-document id that np.split cut at.
        texts = [pieces[0].astype(np.uint8).tobytes().decode("utf-8", errors="replace")]
        texts += [
            EOT_TEXT + p[1:].astype(np.uint8).tobytes().decode("utf-8", errors="replace") for p in pieces[1:]
        ]
        return "".join(texts)

    def token_bytes(self) -> list[bytes]:
        """Each byte id is its byte; the end-of-document id is no byte."""
        return [bytes([i]) for i in range(256)] + [b""] * (self.vocab_size - 256)

    def save(self, directory: Path) -> dict[str, Any]:
        """Byte tokenizers need no file; the entry's hash is that of the string "bytes"."""
        return _entry(self, file=None, digest=bytes_xxhash(b"bytes"))


class BPETokenizer(Tokenizer):
    """Byte-level BPE backed by a Hugging Face `tokenizers.Tokenizer`."""

    kind = "bpe"

    def __init__(self, hf_tokenizer: HFTokenizer, source: str | Path = "the BPE tokenizer") -> None:
        self.source = str(source)
        """The tokenizer's file, as errors name it."""
        eot_id = hf_tokenizer.token_to_id(EOT_TEXT)
        if eot_id is None:
            raise DataError(f"BPE tokenizer has no {EOT_TEXT!r} token; re-run `tenx data prepare`")
        # A literal "<|endoftext|>" inside a document must stay ordinary text, never the document separator.
        hf_tokenizer.encode_special_tokens = True
        self._hf = hf_tokenizer
        self.vocab_size = hf_tokenizer.get_vocab_size()
        self.eot_id = eot_id

    def encode(self, text: str) -> list[int]:
        """BPE ids of `text`."""
        with self._panics("encoding"):
            return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """BPE ids of each text, encoded in parallel by `tokenizers` (without offsets: 1.5x faster)."""
        with self._panics("encoding"):
            return [enc.ids for enc in self._hf.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of BPE ids."""
        with self._panics("decoding"):
            return self._hf.decode(np.asarray(ids, dtype=np.int64).tolist(), skip_special_tokens=False)

    @contextlib.contextmanager
    def _panics(self, doing: str) -> Iterator[None]:
        """A Rust panic inside `tokenizers` (pyo3's PanicException: a BaseException, not an Exception, which
        would end tenx with a traceback, or a prepare worker) as a DataError naming the tokenizer's file, the
        panic and the tokenizer's regexes (a regex engine's limit is the usual cause)."""
        try:
            yield
        except (Exception, KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as e:  # noqa: BLE001 - the panic, handed on as an error
            from tenx.data.tokenizer_regex import tokenizer_regexes

            patterns = "; ".join(
                f"{where} {pattern[:200]!r}" for where, pattern in tokenizer_regexes(self._hf.to_str())
            )
            raise DataError(
                f"{self.source}: the tokenizer panicked while {doing} ({type(e).__name__}: {first_line(e, 200)})"
                + (f"; its regexes: {patterns}" if patterns else "")
            ) from None

    def token_bytes(self) -> list[bytes]:
        """Each token's bytes, read back from its byte-level form (GPT-2's bytes-to-unicode alphabet);
        special tokens (the end-of-document token) are no bytes, and an added token that is not special is
        the bytes it decodes to."""
        decoder = _byte_level_decoder()
        added = self._hf.get_added_tokens_decoder()
        special = {t.content for t in added.values() if t.special}
        out = []
        for i in range(self.vocab_size):
            token = self._hf.id_to_token(i)
            if i in added and not added[i].special:  # added text: the bytes it decodes to, as a stream's
                out.append(self._hf.decode([i], skip_special_tokens=False).encode("utf-8"))
            elif token is None or token in special or any(ch not in decoder for ch in token):
                out.append(b"" if token is None or token in special else token.encode("utf-8"))
            else:
                out.append(bytes(decoder[ch] for ch in token))
        return out

    def to_json(self) -> str:
        """The tokenizer serialised as `tokenizer.json` text (deterministic for a given vocabulary)."""
        return self._hf.to_str()

    def save(self, directory: Path) -> dict[str, Any]:
        """Write `tokenizer.json` atomically and return the manifest entry with its hash."""
        text = self.to_json()
        atomic_write_text(Path(directory) / BPE_FILE, text)
        return _entry(self, file=BPE_FILE, digest=bytes_xxhash(text.encode("utf-8")))


def _byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes-to-unicode map, which byte-level BPE uses to spell every byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _entry(tokenizer: Tokenizer, file: str | None, digest: str) -> dict[str, Any]:
    return {
        "kind": tokenizer.kind,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "file": file,
        "xxhash": digest,
    }


def train_bpe(texts: Iterable[str], vocab_size: int, *, show_progress: bool = False) -> BPETokenizer:
    """Train a byte-level BPE with an end-of-document special token on `texts`."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_BPE_VOCAB:
        raise ConfigError(f"vocab_size must be an integer >= {MIN_BPE_VOCAB} for BPE, got {vocab_size!r}")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TEXT],
        # The full byte alphabet up front makes every str encodable, even bytes unseen in training.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(hf)


def load_tokenizer(data_dir: str | Path, entry: dict[str, Any] | None = None) -> Tokenizer:
    """The tokenizer of a prepared data directory, checked against its manifest entry."""
    data_dir = Path(data_dir)
    if entry is None:
        entry = read_manifest(data_dir)["tokenizer"]
    try:
        check_tokenizer_entry(entry)
    except ManifestFieldError as e:
        field, problem = e.args
        raise DataError(
            f"{data_dir / MANIFEST_NAME}: field {field}: {problem}; re-run `tenx data prepare`"
        ) from None
    tokenizer: Tokenizer
    if entry["kind"] == "bytes":
        tokenizer = ByteTokenizer()
    else:
        path = data_dir / entry["file"]
        if regular_file_size(path) is None:
            raise DataError(
                f"tokenizer file {path} is missing (or not a regular file); re-run `tenx data prepare`"
            )
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise DataError(
                f"tokenizer file {path} cannot be read ({e.strerror or e}); re-run `tenx data prepare`"
            ) from None
        actual = bytes_xxhash(raw)
        if actual != entry["xxhash"]:
            raise DataError(
                f"tokenizer file {path} is corrupt: xxhash {actual}, manifest says {entry['xxhash']}; "
                "re-run `tenx data prepare`"
            )
        try:
            hf = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # UnicodeDecodeError, or the plain Exception `tokenizers` raises on bad JSON
            raise DataError(
                f"tokenizer file {path} is not a Hugging Face tokenizer ({first_line(e, 200)}); "
                "re-run `tenx data prepare`"
            ) from None
        check_tokenizer_regexes(hf, path)
        tokenizer = BPETokenizer(hf, path)
    if (tokenizer.vocab_size, tokenizer.eot_id) != (entry["vocab_size"], entry["eot_id"]):
        raise DataError(
            f"tokenizer in {data_dir} has vocab_size {tokenizer.vocab_size}, eot_id {tokenizer.eot_id}; "
            f"manifest says {entry['vocab_size']}, {entry['eot_id']}; re-run `tenx data prepare`"
        )
    return tokenizer


def load_hf_tokenizer(hf_dir: str | Path) -> BPETokenizer:
    """The tokenizer of a Hugging Face model directory (its tokenizer.json, read by `tokenizers`: no code
    runs), for `tenx data prepare --tokenizer-from` and `tenx train --init-from`."""
    path = Path(hf_dir) / BPE_FILE
    if regular_file_size(path) is None:
        raise DataError(
            f"{path} is missing (or not a regular file): a model directory's tokenizer is its {BPE_FILE}"
        )
    try:
        hf = HFTokenizer.from_str(path.read_bytes().decode("utf-8"))
    except Exception as e:  # OSError, UnicodeDecodeError, or the plain Exception `tokenizers` raises
        raise DataError(f"{path} is not a Hugging Face tokenizer ({first_line(e, 200)})") from None
    check_tokenizer_regexes(hf, path)
    kind = type(hf.model).__name__
    if kind != "BPE":
        raise DataError(
            f"{path}: model.type={kind}: tenx imports byte-level BPE tokenizers only (GPT-2's, Qwen's, a tenx "
            f"export's), whose tokens stand for bytes; a {kind} tokenizer's do not"
        )
    if hf.get_vocab_size() < MIN_BPE_VOCAB:
        raise DataError(
            f"{path}: a vocabulary of {hf.get_vocab_size()} tokens; a byte-level BPE has at least "
            f"{MIN_BPE_VOCAB} (the 256 bytes and {EOT_TEXT!r})"
        )
    if hf.token_to_id(EOT_TEXT) is None:
        raise DataError(
            f"{path} has no {EOT_TEXT!r} token, which tenx puts between documents; tenx imports tokenizers "
            "that have it (GPT-2's, Qwen's, a tenx export's)"
        )
    if EOT_TEXT not in {t.content for t in hf.get_added_tokens_decoder().values()}:
        # special, as in tenx's own BPE (it stands for no bytes); its id stays the vocabulary's
        hf.add_special_tokens([EOT_TEXT])
    return BPETokenizer(hf, path)


def check_tokenizer_regexes(hf: HFTokenizer, path: Path) -> None:
    """Refuse a tokenizer holding a regular expression that can backtrack exponentially (which byte-level BPE
    patterns never do; tenx/data/tokenizer_regex.py), naming the pattern, before any text is encoded."""
    from tenx.data.tokenizer_regex import backtracking_problem, tokenizer_regexes

    for where, pattern in tokenizer_regexes(hf.to_str()):
        problem = backtracking_problem(pattern)
        if problem:
            raise DataError(
                f"{path}: {where} regex {pattern[:200]!r} is refused: {problem}; byte-level BPE patterns "
                "(GPT-2's, Llama 3's, Qwen's) repeat only single characters and classes"
            )


ROUND_TRIP_SAMPLE_BYTES = 4 << 20
"""How much text check_round_trip is given: a corpus or an evaluated dataset at most this large is checked
whole, a larger one on documents spread evenly over it."""


def round_trip_sample(sizes: Sequence[int], budget: int = ROUND_TRIP_SAMPLE_BYTES) -> list[int]:
    """The positions of the documents (of byte sizes `sizes`) that check_round_trip checks: every one when
    they fit `budget`, else every k-th, k chosen so that about `budget` bytes are checked."""
    total = int(sum(int(n) for n in sizes))
    return list(range(0, len(sizes), max(1, -(-total // budget))))


def check_round_trip(
    tokenizer: Tokenizer, documents: Iterable[tuple[str, str, Sequence[int] | None]], where: str
) -> None:
    """DataError unless decoding each document's tokens gives back its text, naming the first document that
    differs, the byte offset, and the bytes expected and got there. `documents`: (name, text, its ids or
    None to encode it here). Bits per byte, the prequential byte count and compression all count the bytes
    the tokens decode to: a tokenizer whose normalizer changes the text (lowercase, NFKC, a replacement)
    would give figures about another text."""
    for name, text, ids in documents:
        back = tokenizer.decode(tokenizer.encode(text) if ids is None else ids)
        if back == text:
            continue
        want = text.encode("utf-8", "surrogatepass")
        got = back.encode("utf-8", "surrogatepass")
        at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        raise DataError(
            f"{where}: the tokenizer does not give back the text it encodes: {name}, byte {at:,}: expected "
            f"{want[at : at + 16]!r}, got {got[at : at + 16]!r}; tenx's bits per byte count the bytes the "
            "tokens decode to, so a tokenizer that changes the text (a lowercasing, NFKC or replacing "
            "normalizer) would score another text: use one whose decode(encode(text)) is the text"
        )
