"""The constants of Engram's n-gram hashing, as the released model derives them.

A token id is first mapped to a compressed id: ids whose text normalises alike (case, accents,
Unicode forms, runs of whitespace) share one (`compressed_token_map`, read from the tokenizer).
Each Engram layer hashes the n-grams ending at a token -- orders 2 .. `max_ngram_size`, each
over `n_heads` heads -- into columns of one table: column `(n - 2) * n_heads + h` owns a range of
rows of prime size, the primes drawn in order above `vocab_size - 1` and never reused, so the
ranges of a layer, and of all layers, are disjoint (`hash_primes`). A column's rows start at the
sum of the earlier columns' primes (`column_offsets`); a layer's table has as many rows as its
primes add up to. Per layer, `max_ngram_size` odd multipliers come from a generator seeded with
`10007 * layer_id`, bounded so that no compressed id times a multiplier overflows int64
(`hash_multipliers`).

These are the numbers the released tables were trained with: a different prime, multiplier or
compressed id reads other rows, silently. The tests check them against the facts of the released
model (the prime sums are its `engram_num_embeddings`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from sympy import nextprime

if TYPE_CHECKING:
    from tokenizers.normalizers import Normalizer

__all__ = [
    "column_offsets",
    "compressed_token_map",
    "hash_multipliers",
    "hash_primes",
    "normalize_token",
]

_INT64_MAX = int(np.iinfo(np.int64).max)


@functools.lru_cache(maxsize=16)
def hash_primes(
    layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """Per Engram layer (in order), its columns' primes in column order: for each order n in
    2 .. `max_ngram_size`, `n_heads` primes. Each (layer, order) searches up from
    `vocab_size - 1` for the next prime not handed out before (to any layer)."""
    seen: set[int] = set()
    layers = []
    for _ in layer_ids:
        columns = []
        for _ in range(max_ngram_size - 1):
            current = vocab_size - 1
            for _ in range(n_heads):
                current = nextprime(current)
                while current in seen:
                    current = nextprime(current)
                seen.add(current)
                columns.append(int(current))
        layers.append(tuple(columns))
    return tuple(layers)


def column_offsets(primes: Sequence[int]) -> tuple[int, ...]:
    """The first row of each column of one layer's table: the sum of the earlier primes."""
    return tuple(int(x) for x in np.cumsum([0, *primes[:-1]]))


def hash_multipliers(
    layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """Per Engram layer, `max_ngram_size` odd multipliers (the one for lookback k at index k):
    `2 v + 1` for v drawn from `numpy.random.default_rng(10007 * layer_id)` below
    `(INT64_MAX // compressed_vocab_size) // 2`."""
    bound = max(1, (_INT64_MAX // compressed_vocab_size) // 2)
    out = []
    for layer_id in layer_ids:
        values = np.random.default_rng(10007 * layer_id).integers(
            low=0, high=bound, size=(max_ngram_size,), dtype=np.int64
        )
        out.append(tuple(int(v) * 2 + 1 for v in values))
    return tuple(out)


def normalize_token(text: str) -> str:
    """The key two tokens share when they are the same word: NFKC, then NFD, accents (combining
    marks) dropped, lowercase, every run of spaces, tabs and line breaks one space, then stripped
    -- except that a token that is whitespace alone keeps one space (it would strip to nothing
    and share its key with unrelated tokens). What `tokenizers`' normalizers compute in that
    order; an empty result keys the token by its text."""
    return _normalizer().normalize_str(text) or text


@functools.cache
def _normalizer() -> Normalizer:
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # a private-use character: a lone space survives Strip() as this
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )


def compressed_token_map(tokenizer_file: str | Path) -> tuple[int, ...]:
    """Token id -> compressed id for every id of the tokenizer in `tokenizer_file` (a
    `tokenizer.json`, read with the `tokenizers` package), added tokens included: each id's
    text (decoded alone, special tokens kept) is normalised (`normalize_token`) and the id maps
    to the first-seen index of its key, in id order. A token whose text is a partial UTF-8
    sequence (it decodes to U+FFFD) is keyed by its raw vocabulary string. Computed once per
    file content."""
    data = Path(tokenizer_file).read_bytes()
    return _token_map(hashlib.sha256(data).hexdigest(), data)


@functools.lru_cache(maxsize=4)
def _token_map(digest: str, data: bytes) -> tuple[int, ...]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    keys: dict[str, int] = {}
    out = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id) or text
        else:
            key = _normalizer().normalize_str(text) or text
        out.append(keys.setdefault(key, len(keys)))
    return tuple(out)
