"""An ensemble's code: each member's exact format-4 frequencies, mixed with exact integer arithmetic.

An ensemble predicts the mean of its members' probabilities (tenx/model/ensemble.py), so its code length on
a token is -log2 of that mean. The coder needs the mixture as integer frequencies that the encoder and the
decoder compute bit for bit alike on any machine. Each member's frequencies are those format 4 gives one
model (`fixed_frequencies`: exact integers on every CPU kind, thread count and GPU); `mix_frequencies`
scales each (end-of-document left out, as it is never coded) to the common total 2**MIX_BITS with integer
division (int64: exact, in any order), sums them
and adds 1, so every token stays codable even where every member's share rounds to 0. The sum is exact and
commutative: no rounding mode, kernel or member order can change it. An ensemble of one member codes with
that member's frequencies unchanged (format 4's).

The container (format version 5, tenx/compress/container.py) records the member count and each member's
checkpoint manifest digest and step; `check_members` refuses to decode a file with any other model or
ensemble, naming the file and what differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tenx import rundir
from tenx.compress.container import ADAPTIVE_VERSION, ENSEMBLE_VERSION, VERSION, CodecAdaptation, Header
from tenx.compress.fixed import FixedWeights, fixed_frequencies
from tenx.compress.model import CodecModel
from tenx.errors import TenxError

MIX_BITS = 30
"""Each member's frequencies are scaled to a total of 2**30 before they are summed: finer than the range
coder's 2**-24 steps, and a member's largest frequency (2**24 + 1) times 2**30 stays below 2**55, exact in
int64; 64 members sum below 2**37, exact in the float64 the coder reads."""


def mix_frequencies(freqs_KRV: Sequence[np.ndarray], eot: int) -> np.ndarray:
    """The mixture's integer frequencies (R, V) of K members' (each (R, V), exact integers as float64 or
    int64): sum_k floor(f_k * 2**MIX_BITS / sum(f_k)) + 1 per token, the sums over every token but
    end-of-document, whose frequency is 1 (never coded); as float64 (exact)."""
    total_RV = np.zeros(freqs_KRV[0].shape, dtype=np.int64)
    for freqs_RV in freqs_KRV:
        f_RV = freqs_RV.astype(np.int64)
        f_RV[:, eot] = 0  # never coded: each member's probabilities over the tokens that are
        total_RV += (f_RV << MIX_BITS) // f_RV.sum(axis=1, keepdims=True)
    total_RV += 1
    total_RV[:, eot] = 1
    return total_RV.astype(np.float64)


def frequencies(heads: Sequence[tuple[FixedWeights, torch.Tensor]], vocab: int, eot: int) -> np.ndarray:
    """The coder's frequencies from each member's weights and final-norm outputs (the same rows): one
    model's as format 4 computes them, several members' mixed (`mix_frequencies`)."""
    freqs = [fixed_frequencies(weights.head(hidden), vocab, eot) for weights, hidden in heads]
    return freqs[0] if len(freqs) == 1 else mix_frequencies(freqs, eot)


def ensemble_version(codec: CodecModel, version: int, adapt: CodecAdaptation | None) -> int:
    """The format `codec` writes when asked for `version`: an ensemble's is ENSEMBLE_VERSION (asked for the
    default), one model's the one asked for; a TenxError for a combination that cannot code."""
    if not codec.members:
        if version == ENSEMBLE_VERSION:
            raise TenxError(
                f"format version {ENSEMBLE_VERSION} codes an ensemble; {codec.checkpoint} is one model"
            )
        return version
    if adapt is not None or version == ADAPTIVE_VERSION:
        raise TenxError(
            f"{codec.checkpoint} is an ensemble of {len(codec.members)} members: --adapt (format "
            f"{ADAPTIVE_VERSION}) trains one model's output layer while it codes, which a mixture of members "
            f"has not; compress without --adapt (format {ENSEMBLE_VERSION}: the members' mixture)"
        )
    if version not in (VERSION, ENSEMBLE_VERSION):
        raise TenxError(
            f"{codec.checkpoint} is an ensemble: it codes with format {ENSEMBLE_VERSION} (its members' "
            f"format-{VERSION} frequencies, mixed), not {version}"
        )
    return ENSEMBLE_VERSION


def header_members(codec: CodecModel) -> list[tuple[bytes, int]] | None:
    """What a format-5 header records of `codec`'s members (None for one model)."""
    if not codec.members:
        return None
    return [(bytes.fromhex(m.model_hash), m.step) for m in codec.members]


def check_members(header: Header, codec: CodecModel, name: str) -> None:
    """A TenxError naming file `name` and the mismatch unless `codec` is the kind of model (one, or an
    ensemble with the same members in the same order) that wrote `header`."""
    again = "decompress with the ensemble that compressed it"
    if header.members is None:
        if codec.members:
            raise TenxError(
                f"{name} was compressed with one model (checkpoint manifest xxhash {header.model_hash.hex()}, "
                f"step {header.step}); {codec.checkpoint} is an ensemble of {len(codec.members)} members: "
                "decompress with that model's run or checkpoint directory"
            )
        return
    recorded = ", ".join(f"{digest.hex()} (step {step})" for digest, step in header.members)
    if not codec.members:
        raise TenxError(
            f"{name} was compressed with an ensemble of {len(header.members)} members (checkpoint manifest "
            f"xxhashes {recorded}); {codec.checkpoint} is one model: {again} (its directory holds "
            f"{rundir.ENSEMBLE})"
        )
    if len(header.members) != len(codec.members):
        raise TenxError(
            f"{name} was compressed with an ensemble of {len(header.members)} members ({recorded}); "
            f"{codec.checkpoint} has {len(codec.members)}: {again}"
        )
    for i, ((digest, step), member) in enumerate(zip(header.members, codec.members)):
        if (digest.hex(), step) != (member.model_hash, member.step):
            raise TenxError(
                f"{name} was compressed with an ensemble whose member {i} has checkpoint manifest xxhash "
                f"{digest.hex()} (step {step}); member {i} of {codec.checkpoint} is {member.checkpoint}, "
                f"xxhash {member.model_hash} (step {member.step}): {again}"
            )
