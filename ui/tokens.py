"""Token ids -> display text, one id at a time (never by searching the decoded output).

``TokenTexts`` decodes each token id on its own with the tokenizer and caches the piece.
SentencePiece tokenizers drop a word-initial space when a single token is decoded; that space is
restored from the token's ``▁`` marker. Byte-level pieces that are only part of a multi-byte
character decode to U+FFFD on their own; ``group_pieces`` joins such runs of consecutive ids
by decoding the run together, so a character split over two tokens is shown once.
"""

from __future__ import annotations

from typing import Protocol, Sequence

REPLACEMENT = "\ufffd"
_VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}


class Tokenizer(Protocol):
    def decode(self, ids: Sequence[int], **kwargs) -> str: ...


class TokenTexts:
    """Per-id text pieces for one tokenizer (cached)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        token_id = int(token_id)
        if token_id not in self._cache:
            self._cache[token_id] = self._decode_one(token_id)
        return self._cache[token_id]

    def joint(self, ids: Sequence[int]) -> str:
        """Text of a run of consecutive ids decoded together (for split characters)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def _decode_one(self, token_id: int) -> str:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        if convert is not None and not text.startswith(" "):
            try:
                raw = convert(token_id)
            except Exception:  # noqa: BLE001 - some tokenizers reject unusual ids; keep the decode
                raw = None
            if isinstance(raw, str) and raw.startswith("▁"):
                text = " " + text
        return text

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.piece(i) for i in ids]


class StoredTokenTexts(TokenTexts):
    """Token texts read back from an exported run (no tokenizer): each id's stored piece; a run of
    ids is their pieces joined."""

    def __init__(self, pieces: dict[int, str]) -> None:
        self.tokenizer = None
        self._cache = {int(k): str(v) for k, v in pieces.items()}

    def piece(self, token_id: int) -> str:
        return self._cache.get(int(token_id), f"<{int(token_id)}>")

    def joint(self, ids: Sequence[int]) -> str:
        return "".join(self.piece(i) for i in ids)


def group_pieces(texts: TokenTexts, ids: Sequence[int], max_run: int = 4) -> list[tuple[int, int, str]]:
    """Split ``ids`` into ``(start, end, text)`` runs: one id per run, except that ids whose own
    piece contains U+FFFD are joined with their successors (up to ``max_run`` ids) when the joint
    decode is a clean character."""
    out: list[tuple[int, int, str]] = []
    i = 0
    n = len(ids)
    while i < n:
        text = texts.piece(ids[i])
        if REPLACEMENT in text:
            for j in range(i + 2, min(n, i + max_run) + 1):
                joint = texts.joint(ids[i:j])
                if REPLACEMENT not in joint:
                    out.append((i, j, joint))
                    i = j
                    break
            else:
                out.append((i, i + 1, text))
                i += 1
            continue
        out.append((i, i + 1, text))
        i += 1
    return out


def visible_whitespace(text: str, limit: int = 12) -> str:
    """A short one-line label for a token: whitespace made visible, long pieces truncated."""
    shown = "".join(_VISIBLE.get(ch, ch) for ch in text) or "∅"
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"
