"""The acceptance ``auto`` prices with, measured on the pair's own continuations, and its cache.

The target continues each calibration prompt, then draft and target are teacher-forced over prompt +
continuation; on the continuation positions Sequoia's estimator gives the positional acceptance
vector, and each position's chain acceptance and confidence-stop statistics are kept as they are
(``Acceptance``). Measured once per pair, precisions and temperature and cached as JSON next to the
machine profiles.

Each calibration text also keeps how often draft and target agree on its prompt (``prompt_agreement``: the
argmax of both over the prompt's last ``AGREEMENT_WINDOW`` tokens), so a prompt can be priced on the texts
whose prompts agree as much as its own (``Acceptance.nearest``): over 30 eval prompts the agreement on the
prompt followed the chain's tokens per step on the continuation (docs/PLANNING.md).
"""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..config import DecodeConfig
from .forward_timer import Progress, Turn

ACCEPTANCE_VERSION = 5  # 3: the calibration texts are kept (the suffix method is replayed on them)
# 4: an int4 draft's head is read from the embedding where that is the same matrix (gguf_model.with_head)
# 5: each text's own positional vector and its prompt's agreement (``nearest``)
#: confidence-stop thresholds the chain is priced at (None = always draft k tokens)
STOP_GRID: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
#: the prompt tokens whose draft/target argmax agreement is measured (the last ones; ``prompt_agreement``). Over
#: the 30 eval prompts of wiki, news and code (128 tokens; ``scripts/prompt_agreement.py``, docs/PLANNING.md) the
#: agreement over the last 16 / 32 / 64 / 128 correlated 0.17 / 0.58 / 0.67 / 0.82 with the chain's tokens per
#: step on the continuation, and the nearest two calibration texts by it predicted those within a median factor
#: of 1.41 / 1.58 / 1.30 / 1.29 (all four texts: 1.65); 64 costs half of 128's forwards
AGREEMENT_WINDOW = 64
#: calibration texts a prompt is priced on (``Acceptance.nearest``): by the last 128 tokens' agreement the nearest
#: 1 / 2 / 3 texts were within 1.23 / 1.29 / 1.46; two, as one 48-token text is a small sample
NEAREST_TEXTS = 2


@dataclass(frozen=True)
class Acceptance:
    """What the pair's own continuations say about acceptance.

    Attributes:
        vector: Sequoia's positional acceptance vector p_1..p_W.
        sequences: per calibration continuation, per position ``(accept, cont...)``: ``accept`` the
            probability that a chain token drafted there (given the target's prefix) is accepted
            (T=0: 1 if the draft argmax is the target's token; T>0: ``sum min(p, q)``), ``cont[j]``
            the probability that the drafted token's draft probability is >= ``STOP_GRID[j]``
            (the chain goes on). Runs of easy tokens (code) are kept as they are, not averaged away.
        texts: per calibration continuation, ``(prompt ids, continuation ids)`` (the suffix method
            is replayed on them).
        vectors: per calibration continuation, its own positional vector (``vector`` is their mean by
            position count).
        prompt_agreement: per calibration continuation, ``prompt_agreement`` of its prompt.
    """

    vector: tuple[float, ...]
    sequences: tuple[tuple[tuple[float, ...], ...], ...] = ()
    texts: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    vectors: tuple[tuple[float, ...], ...] = ()
    prompt_agreement: tuple[float, ...] = ()

    def nearest(self, agreement: float, k: int = NEAREST_TEXTS) -> "Acceptance":
        """The acceptance of the ``k`` calibration texts whose prompts' draft/target agreement is nearest
        ``agreement`` (a prompt's own, ``prompt_agreement``): their sequences and texts, and their positional
        vectors averaged by position count. Itself when it keeps no agreement or has at most ``k`` texts."""
        n = len(self.prompt_agreement)
        if n <= k or n != len(self.sequences) or n != len(self.vectors):
            return self
        pick = sorted(sorted(range(n), key=lambda i: (abs(self.prompt_agreement[i] - agreement), i))[:k])
        rows = [len(self.sequences[i]) for i in pick]
        width = min(len(self.vectors[i]) for i in pick)
        vector = tuple(sum(r * self.vectors[i][j] for r, i in zip(rows, pick)) / sum(rows) for j in range(width))
        return Acceptance(vector, tuple(self.sequences[i] for i in pick),
                          tuple(self.texts[i] for i in pick) if len(self.texts) == n else self.texts,
                          tuple(self.vectors[i] for i in pick), tuple(self.prompt_agreement[i] for i in pick))


def measure_acceptance(pair, prompts: Sequence[Sequence[int]], temperature: float, new_tokens: int = 48,
                       width: int = 8, seed: int = 0, progress: Optional[Progress] = None,
                       turn: Turn = nullcontext) -> Acceptance:
    """Acceptance on the pair's *own* continuations: the target continues each prompt
    (autoregressive, at ``temperature``), then draft and target are teacher-forced over prompt +
    continuation; on the continuation positions Sequoia's estimator (notes/sequoia.md §1.5) gives
    the positional vector and each position's chain acceptance / confidence-stop statistics
    (``Acceptance``). Text the models write agrees more than human text does. Each decoding step
    and each prompt's teacher-forced forwards run in a ``turn()`` (the app's shared models)."""
    from ..drafting.sequoia import estimate_acceptance_vector
    from ..decode.engine import SpeculativeDecoder
    from ..sampling import probs_from_logits

    say = progress or (lambda _m: None)
    gen = torch.Generator().manual_seed(seed)
    total, count = None, 0
    sequences, texts, vectors, agreements = [], [], [], []
    taus = torch.tensor(STOP_GRID, dtype=torch.float64)
    dec = SpeculativeDecoder(pair.draft, pair.target,
                             DecodeConfig(method="autoregressive", temperature=temperature, seed=seed,
                                          dtype=_dense_dtype(pair)),
                             eos_token_id=list(pair.eos_token_ids) or None)
    for i, ids in enumerate(prompts):
        ids = list(ids)
        cont: list[int] = []
        steps = dec.generate(ids, new_tokens, seed=seed + i)
        while True:
            with turn():
                trace = next(steps, None)
            if trace is None:
                break
            cont.extend(c.token_id for c in trace.committed)
        full = ids + cont
        if len(cont) < 2:
            continue
        texts.append((tuple(ids), tuple(int(t) for t in cont)))
        with turn(), torch.inference_mode():
            x = torch.tensor([full])
            tl = pair.target(x).logits[0, len(ids) - 1:-1]
            dl = pair.draft(x).logits[0, len(ids) - 1:-1]
        t = temperature if temperature > 0 else 1.0
        tp, dp = probs_from_logits(tl, t).cpu().double(), probs_from_logits(dl, t).cpu().double()
        own = estimate_acceptance_vector(dp, tp, width, gen, deterministic=temperature == 0)
        vectors.append(tuple(float(a) for a in own))
        acc = own * tp.shape[0]
        total = acc if total is None else total + acc
        count += tp.shape[0]
        with turn():
            agreements.append(prompt_agreement(pair, ids))
        if temperature == 0:
            accept = (dp.argmax(-1) == torch.tensor(cont)).double()
            conf = dp.max(-1).values
            go_on = (conf[:, None] >= taus[None, :]).double()
        else:
            accept = torch.minimum(tp, dp).sum(-1)
            go_on = torch.stack([(dp * (dp >= tau)).sum(-1) for tau in STOP_GRID], dim=-1)
        sequences.append(tuple(tuple([float(a), *map(float, c)]) for a, c in zip(accept, go_on)))
        say(f"    acceptance prompt {i + 1}/{len(prompts)}: p1 so far {float(total[0]) / count:.2f}")
    if not count:
        raise ValueError("no acceptance could be measured: the continuations were empty")
    return Acceptance(tuple(float(a) for a in total / count), tuple(sequences), tuple(texts), tuple(vectors),
                      tuple(agreements))


def prompt_agreement(pair, ids: Sequence[int], window: int = AGREEMENT_WINDOW) -> float:
    """How often draft and target pick the same next token over the last ``window`` tokens of ``ids`` (one forward
    of each over those tokens alone, every row's argmax): what a prompt says of the acceptance of its continuation
    before it is decoded. ``ids``: ``[P]`` token ids (P >= 1)."""
    tail = list(ids)[-window:]
    if not tail:
        raise ValueError("an empty prompt has no agreement")
    with torch.inference_mode():
        x = torch.tensor([tail])
        same = pair.target(x).logits[0].argmax(-1) == pair.draft(x).logits[0].argmax(-1)
    return float(same.double().mean())


def _dense_dtype(pair) -> str:
    return str(pair.dtype).removeprefix("torch.") if pair.dtype is not None else "float32"


def acceptance_cache_path(key: str) -> Path:
    from ..paths import cache_root

    return cache_root() / "profiles" / f"acceptance-{key}.json"


def _acceptance_path(pair_name: str, draft_precision: str, target_precision: str, temperature: float,
                     new_tokens: int, prompts: Sequence[Sequence[int]]) -> Path:
    from ..models.load import draft_head

    raw = json.dumps([pair_name, draft_precision, target_precision, float(temperature), new_tokens,
                      [list(p) for p in prompts], ACCEPTANCE_VERSION, draft_head(), AGREEMENT_WINDOW])
    return acceptance_cache_path(hashlib.sha256(raw.encode()).hexdigest()[:16])


def cached_acceptance(pair_name: str, draft_precision: str, target_precision: str, temperature: float,
                      prompts: Sequence[Sequence[int]], new_tokens: int = 48) -> Optional[Acceptance]:
    """The acceptance ``load_or_measure_acceptance`` cached for these arguments (None if none)."""
    path = _acceptance_path(pair_name, draft_precision, target_precision, temperature, new_tokens, prompts)
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        return Acceptance(tuple(d["acceptance"]), tuple(tuple(tuple(r) for r in seq) for seq in d["sequences"]),
                          tuple((tuple(p), tuple(c)) for p, c in d["texts"]), tuple(tuple(v) for v in d["vectors"]),
                          tuple(d["prompt_agreement"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_or_measure_acceptance(pair, pair_name: str, prompts: Sequence[Sequence[int]], temperature: float,
                               new_tokens: int = 48, refresh: bool = False,
                               progress: Optional[Progress] = None, turn: Turn = nullcontext) -> Acceptance:
    path = _acceptance_path(pair_name, pair.draft_precision, pair.target_precision, temperature, new_tokens, prompts)
    if not refresh:
        acc = cached_acceptance(pair_name, pair.draft_precision, pair.target_precision, temperature, prompts,
                                new_tokens)
        if acc is not None:
            return acc
    t0 = time.perf_counter()
    acc = measure_acceptance(pair, prompts, temperature, new_tokens, progress=progress, turn=turn)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"acceptance": acc.vector, "sequences": acc.sequences, "texts": acc.texts,
                                "vectors": acc.vectors, "prompt_agreement": acc.prompt_agreement,
                                "stop_grid": STOP_GRID,
                                "pair": pair_name, "temperature": temperature,
                                "draft_precision": pair.draft_precision, "target_precision": pair.target_precision,
                                "seconds": time.perf_counter() - t0}))
    return acc


def calibration_prompts(tokenizer, n_per_dataset: int = 2, max_tokens: int = 96) -> list[list[int]]:
    """Prompts from the ``calib`` slices of wiki and code (disjoint from every evaluation)."""
    from ..prompts import load_prompts

    return [list(tokenizer(p.text, add_special_tokens=False)["input_ids"])[:max_tokens]
            for ds in ("wiki", "code") for p in load_prompts(ds, n_per_dataset, split="calib")]
