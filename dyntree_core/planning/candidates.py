"""The shapes ``auto`` prices, and what each would do on the pair's calibration text.

The grids of chain lengths, Sequoia (budget, depth), suffix and hybrid shapes; a chain of at most k
tokens with a confidence stop replayed on every calibration position (``simulate_chain``); ``suffix``
and ``hybrid`` shapes replayed on the calibration continuations in one lockstep pass
(``simulate_suffix_shapes``, through ``drafting.suffix_replay``); Sequoia's DP-optimal trees under an
acceptance vector (``sequoia_shapes``). Pure functions of the measured statistics: ``pricing`` turns
them into seconds per token.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

CHAIN_LENGTHS: tuple[int, ...] = tuple(range(1, 9))
CHAIN_MAX = 12
SEQUOIA_BUDGETS: tuple[int, ...] = (4, 6, 8, 12, 16, 24, 32)
SEQUOIA_DEPTHS: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
#: suffix-tree shapes priced: budgets x depths x path-probability thresholds
SUFFIX_BUDGETS: tuple[int, ...] = (4, 8, 16, 32)
SUFFIX_DEPTHS: tuple[int, ...] = (4, 8, 16)
SUFFIX_THRESHOLDS: tuple[float, ...] = (0.05, 0.2)
#: match-length caps priced (``DecodeConfig.spec_factor``; None = no cap)
SUFFIX_FACTORS: tuple[Optional[float], ...] = (0.5, 1.0, 2.0, None)
#: hybrid shapes priced (x SUFFIX_THRESHOLDS x SUFFIX_FACTORS): its model steps are OPT-Tree trees
HYBRID_BUDGETS: tuple[int, ...] = (4, 8, 16, 32)
HYBRID_DEPTHS: tuple[int, ...] = (4, 8)


def chain_expected_tokens(p1: float, k: int) -> float:
    return sum(p1 ** i for i in range(k + 1))


@dataclass(frozen=True)
class ChainStats:
    """A chain of at most k tokens with a stop rule, started at every calibration position, pooled:
    ``tokens`` committed per step, ``drafted`` draft forwards per step, ``size_probs[m-1]`` the
    probability that m tokens were drafted (the target then runs m + 1), ``all_accepted`` the probability
    that every drafted token was accepted: the last one was never forwarded by the draft, so the next
    step's first draft forward has two rows (it and the target's token) instead of one."""

    tokens: float
    drafted: float
    size_probs: tuple[float, ...]
    all_accepted: float


def simulate_chain(sequences: Sequence[Sequence[Sequence[float]]], k: int, stop_index: Optional[int]) -> ChainStats:
    """``ChainStats`` of a chain of at most ``k`` tokens (stop rule ``acceptance.STOP_GRID[stop_index]`` or none).

    With ``D`` the number drafted, ``P(D >= m) = prod_{l < m-1} cont_l`` and the accepted run reaching
    j needs ``D >= j`` and the first j tokens accepted; at T=0 every factor is 0 or 1, so this is
    exact for the calibration text (positions past its end take the sequence's means).
    """
    tok = dra = full = 0.0
    sizes = [0.0] * k
    starts = 0
    for seq in sequences:
        if not seq:
            continue
        mean = [sum(col) / len(seq) for col in zip(*seq)]
        for s in range(len(seq)):
            rows = [seq[s + l] if s + l < len(seq) else mean for l in range(k)]
            p_ge = [1.0]  # P(D >= 1), P(D >= 2), ...
            for l in range(k - 1):
                p_ge.append(p_ge[-1] * (1.0 if stop_index is None else rows[l][1 + stop_index]))
            run, e_tok = 1.0, 1.0
            for j in range(1, k + 1):
                run *= rows[j - 1][0]
                e_tok += p_ge[j - 1] * run
                full += (p_ge[j - 1] - (p_ge[j] if j < k else 0.0)) * run  # P(D = j, all j accepted)
            for m in range(1, k + 1):
                sizes[m - 1] += p_ge[m - 1] - (p_ge[m] if m < k else 0.0)
            tok += e_tok
            dra += sum(p_ge)
            starts += 1
    if not starts:
        return ChainStats(1.0, float(k), tuple(1.0 if m == k else 0.0 for m in range(1, k + 1)), 0.0)
    return ChainStats(tok / starts, dra / starts, tuple(x / starts for x in sizes), full / starts)


@dataclass(frozen=True)
class SuffixStats:
    """A ``suffix`` or ``hybrid`` shape replayed on the calibration continuations, pooled over steps:
    ``suffix_tokens`` tokens committed by suffix-tree steps per step (all steps counted),
    ``size_probs`` ``{suffix tree size: share of all steps}``, ``model_share`` the share of steps a
    hybrid drafts with the model, ``build_seconds`` the mean time per step to update the index and
    build suffix trees (the whole of the suffix side's drafting)."""

    suffix_tokens: float
    size_probs: dict[int, float]
    build_seconds: float
    model_share: float = 0.0


def simulate_suffix_shapes(texts: Sequence[tuple[Sequence[int], Sequence[int]]], shapes: Sequence,
                           model_commit: Optional[dict] = None) -> dict:
    """``{SuffixShape: SuffixStats or None}`` of every shape on ``(prompt, continuation)`` texts, from
    one lockstep replay per text (``drafting.suffix_replay.replay_shapes``); None without steps."""
    from ..drafting.suffix_replay import replay_shapes

    steps: dict = {s: [] for s in shapes}
    seconds = {s: 0.0 for s in shapes}
    for prompt, cont in texts:
        if not prompt or not cont:
            continue
        for s, rep in replay_shapes(prompt, cont, shapes, model_commit).items():
            steps[s].extend(rep.steps)
            seconds[s] += rep.build_seconds
    out = {}
    for s, st in steps.items():
        if not st:
            out[s] = None
            continue
        suffix = [x for x in st if x.from_suffix]
        sizes = Counter(x.size for x in suffix)
        out[s] = SuffixStats(sum(x.committed for x in suffix) / len(st),
                             {n: c / len(st) for n, c in sorted(sizes.items())},
                             seconds[s] / len(st), (len(st) - len(suffix)) / len(st))
    return out


def simulate_suffix(texts: Sequence[tuple[Sequence[int], Sequence[int]]], budget: int, depth: int,
                    threshold: float, spec_factor: Optional[float] = None) -> Optional[SuffixStats]:
    """``SuffixStats`` of one ``suffix`` shape on ``(prompt, continuation)`` texts (None without texts)."""
    from ..drafting.suffix_replay import SuffixShape

    shape = SuffixShape(budget, depth, threshold, spec_factor)
    return simulate_suffix_shapes(texts, [shape])[shape]


def sequoia_draft_levels(shape) -> list[int]:
    """Nodes fed to each batched draft forward of a Sequoia tree: the internal nodes of each level,
    root level first (one draft forward per level that has children)."""
    depth = shape.depths()
    counts = Counter(depth[p] for p in set(shape.parents) if p >= 0)
    return [counts[k] for k in sorted(counts)]


def sequoia_shapes(acceptance: Sequence[float], budgets: Sequence[int], depths: Sequence[int]) -> dict:
    """``{(budget, depth): (tree size, G, draft level widths)}`` of Sequoia's DP-optimal trees under the
    positional ``acceptance`` vector (``depth`` levels below the root)."""
    from ..drafting.sequoia import best_size, sequoia_dp, sequoia_tree

    table = sequoia_dp(tuple(acceptance), max(budgets), max(depths) + 1)
    out = {}
    for n in budgets:
        for d in depths:
            shape = sequoia_tree(table, best_size(table, n, d + 1), d + 1)
            out[(n, d)] = (shape.size, table.G(shape.size, d + 1), sequoia_draft_levels(shape))
    return out
