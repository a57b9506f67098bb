"""``SuffixIndex``: continuation counts of every recent substring of a growing token sequence.

For each substring ``s`` of length 1..``max_len`` of the sequence, the index counts the tokens that
followed ``s`` (a suffix trie truncated at depth ``max_len + 1``, keyed by substring). Appending a
token costs O(``max_len``); a lookup finds the longest suffix of a context that occurred before and
returns what followed it. Pure Python, no model: it is the draft of the model-free ``suffix``
method (SuffixDecoding's idea: draft from text already seen, scored by frequency).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Continuations:
    """What followed the longest earlier occurrence of a context's suffix.

    Attributes:
        match_len: length of that suffix (0 = nothing of the context occurred before).
        counts: token -> times it followed the suffix (empty when ``match_len`` is 0).
    """

    match_len: int
    counts: dict[int, int]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def ranked(self) -> list[tuple[int, float]]:
        """``(token, empirical probability)``, most frequent first (ties: smaller token id first)."""
        total = self.total
        return [(t, c / total) for t, c in sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))]


class SuffixIndex:
    """Continuation counts of the substrings (length <= ``max_len``) of an appended-to sequence."""

    def __init__(self, max_len: int = 16):
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be a positive integer, got {max_len!r}")
        self.max_len = max_len
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], Counter] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens``; each new token is counted as the continuation of the up to
        ``max_len`` tokens before it."""
        seq = self.tokens
        for t in tokens:
            t = int(t)
            end = len(seq)
            for length in range(1, min(self.max_len, end) + 1):
                key = tuple(seq[end - length:end])
                c = self._next.get(key)
                if c is None:
                    c = self._next[key] = Counter()
                c[t] += 1
            seq.append(t)

    def continuations(self, context: Sequence[int]) -> Continuations:
        """The continuations of the longest suffix of ``context`` (at most ``max_len`` tokens) that
        occurred in the sequence followed by some token."""
        ctx = [int(t) for t in context[-self.max_len:]]
        for length in range(len(ctx), 0, -1):
            c = self._next.get(tuple(ctx[len(ctx) - length:]))
            if c:
                return Continuations(length, dict(c))
        return Continuations(0, {})
