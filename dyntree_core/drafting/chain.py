"""Chain drafting (Leviathan et al.): one token per level, k = ``cfg.depth`` tokens.

One ``next_probs`` call per level (k calls); the last token is a leaf and gets no call.
Stochastic: each token is an i.i.d. draw from its parent's draft distribution (``iid``).
Deterministic: the draft argmax at every level (``topk``).
With ``cfg.stop_confidence`` = τ the chain ends early after a token whose draft probability is
below τ (that token is kept): drafting where the draft is unsure costs forwards that are rarely
repaid. The rule reads only draft probabilities, so every verifier stays lossless.
"""

from __future__ import annotations

import torch

from ..tree import TokenTree
from .builder import TreeBuilder
from .drafter import CountingSource, Drafter
from .siblings import iid_draws, sibling_orders


class ChainDrafter(Drafter):
    name = "chain"

    def _draft(
        self, source: CountingSource, root_token: int, generator: torch.Generator, deterministic: bool
    ) -> TokenTree:
        b = TreeBuilder(root_token)
        node = 0
        for _ in range(self.depth):
            rows = b.request(source, [node])
            if deterministic:
                toks, probs = sibling_orders(rows, 1, generator, True)
            else:
                toks, probs = iid_draws(rows, 1, generator)
            p = float(probs[0, 0])
            node = b.add(node, int(toks[0, 0]), p, b.value[node] * p)
            if self.cfg.stop_confidence is not None and p < self.cfg.stop_confidence:
                break
        return b.build(self.sampled_kind(deterministic))
