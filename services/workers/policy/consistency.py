"""Output consistency (pure): an output's fingerprint, and whether a shadow run agrees.

A request admission sampled is run again, as a shadow, by another worker (``worker``
sends it once the original is answered; ``ShadowOrder``). The shadow's worker compares
the two outputs by their fingerprints (``schemas.OutputFingerprint``): a greedy
(temperature 0) request must give the same text, digest for digest; a sampled one with
a seed must give a text at least ``min_similarity`` alike. The similarity is the
MinHash estimate of the Jaccard similarity of the two texts' word bigrams: token-level,
cheap (32 universal hashes of one 64-bit hash per bigram), no model.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Final

from schemas import OutputFingerprint, ShadowOf
from schemas.requests import MINHASH_PRIME, MINHASH_SIZE


# The universal hash family h_i(x) = (a_i x + b_i) mod p, fixed for the wire: every
# worker must draw the same minimums for the same bigrams.
def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest())


_COEFFICIENTS: Final = tuple(
    (_hash64(f"a{i}") % (MINHASH_PRIME - 1) + 1, _hash64(f"b{i}") % MINHASH_PRIME)
    for i in range(MINHASH_SIZE)
)


def _shingles(text: str) -> set[int]:
    """The text's word bigrams (its single word, if it has one), each as 64 bits."""
    words = text.split()
    grams = [" ".join(pair) for pair in itertools.pairwise(words)] or words
    return {_hash64(g) for g in grams}


def fingerprint(text: str) -> OutputFingerprint:
    shingles = _shingles(text)
    minhash = (
        tuple(min((a * x + b) % MINHASH_PRIME for x in shingles) for a, b in _COEFFICIENTS)
        if shingles
        else ()
    )
    digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    return OutputFingerprint(digest=digest, minhash=minhash)


def similarity(a: OutputFingerprint, b: OutputFingerprint) -> float:
    """The estimated share of word bigrams the two texts have in common (1.0 for equal
    texts, and for two empty ones)."""
    if a.digest == b.digest:
        return 1.0
    if not a.minhash or not b.minhash:
        return 0.0
    return sum(x == y for x, y in zip(a.minhash, b.minhash, strict=False)) / min(
        len(a.minhash), len(b.minhash)
    )


@dataclass(frozen=True)
class Comparison:
    agrees: bool
    similarity: float


def compare(original: ShadowOf, shadow: OutputFingerprint) -> Comparison:
    """Whether the shadow's output agrees with the original's, on the original's terms."""
    score = similarity(original.fingerprint, shadow)
    if original.exact:
        return Comparison(original.fingerprint.digest == shadow.digest, score)
    return Comparison(score >= original.min_similarity, score)
