"""DySpec greedy heap expansion (DySpec Algorithm 1, App. A.1; optimality App. D.1).

A heap holds one entry per *sampling position*: "the next child draw at node u". Popping an
entry draws one token from u's residual draft distribution and pushes

* the next-sibling entry of u (value ``v·(1 - R[y])``, R the current residual), and
* the first-child entry of the new node (value ``v·R[y]``),

until the tree has ``cfg.budget`` nodes (or the heap runs dry: vocabulary exhausted or depth
cap ``cfg.depth`` reached everywhere). With R the residual after k-1 draws, the values
telescope (App. D eq. 9–11): the k-th draw at u is keyed ``w(u)·(1 - Σ_{j<k} q_u(y_j))`` and
the new node's value is ``w(child) = w(u)·q_u(y) = Π`` draft probabilities along its path — the
node weight of App. D.1 and the ``value`` recorded on the tree.

Keys (a design decision; see the report's errata):

* stochastic (``swor``): Algorithm 1 verbatim — the key is the probability that the draw is
  reached, ``v``; it depends only on earlier draws, never on the token the draw will yield,
  so the decision to sample does not bias the tree (App. A.1's remark).
* deterministic (``topk``): App. D.1's greedy — the key of a draw is the weight of the node it
  will produce, ``w(u)·q_u(next top token)``. That greedy provably returns the max-weight
  root-connected subtree of size ``budget`` (Theorem D.1 B); Algorithm 1's ``v`` keys with top-k
  draws do not (q_root = (.6, .4), q_A = (.5, .5), budget 3: the ``v`` keys pick A then A's
  child, drafted weight .6 + .3 = .9, while the optimum A, B has weight 1.0).

Batching: the greedy's output is the set of the ``budget - 1`` draws with the largest keys in
the (depth-capped) tree of all possible draws — keys never increase from a draw to the draws
below it (the next sibling draw, the new child's draws), so that set is root-connected and it
is exactly what popping the heap ``budget - 1`` times returns. It is computed in *rounds*, one
batched ``next_probs`` call each. A node's sibling draws do not depend on when they are made
(``SiblingSampler``: SWOR by two-level inverse CDF, or top-k), so known draws are kept as
*virtual* nodes, materialised in the working tree only when requested or selected
(``source_index`` maps the result back); stochastic draws are made lazily, only when they
enter the selection (a heap merge of the evaluated nodes' draw streams). Each round takes S =
the ``budget - 1`` best known draws and the cut c = the worst key in S (draws at or below c
are dead for good: c only grows), and requests in one call the unevaluated nodes of S at depth
< ``cfg.depth`` whose draws could still beat c: stochastic — the first-draw key of a node is
exactly its weight, so the nodes with ``w > c``; deterministic — ``w`` only bounds the first
key ``w·max q``, so every node with ``w > c``. Among those, nodes predicted to stay leaves
(a projection of the cut, ``_likely``) are deferred while others are pending — the cut may rise
past them. The loop ends when no node of S can beat the cut, which in the deterministic mode
certifies the App. D.1 optimum (leaves of the result get evaluated too: exactness needs
their distributions). Nodes later pushed out of S were requested in vain, the price of
batching. Calls ≈ tree depth + 1 (measured: 8–10 at budget 64, depth 8).
"""

from __future__ import annotations

import heapq

import torch

from ..tree import TokenTree
from .builder import TreeBuilder
from .drafter import CountingSource, Drafter
from .siblings import SiblingSampler, top_children


class DySpecGreedyDrafter(Drafter):
    name = "dyspec_greedy"

    def _draft(
        self, source: CountingSource, root_token: int, generator: torch.Generator, deterministic: bool
    ) -> TokenTree:
        n, max_depth = self.cfg.budget - 1, self.depth
        max_draws = min(n, int(source.vocab_size))
        b = TreeBuilder(root_token)
        # virtual draws; index 0 is the root. key = greedy key of the draw that made the node,
        # w = node weight (Π draft probabilities along the path), rank = draw order at the parent
        v_tok, v_par, v_q, v_w, v_key, v_depth, v_rank = [root_token], [-1], [1.0], [1.0], [float("inf")], [0], [0]
        v_bid = [0]  # builder id, -1 while virtual
        evaluated: set[int] = set()
        streams: dict[int, tuple[SiblingSampler, int]] = {}  # stochastic: node -> (sampler, row)
        conf: list[float] = []  # top-1 probability (T=0) / first-draw probability (T>0) per row

        def add_virtual(parent: int, tok: int, q: float, key: float, rank: int) -> None:
            v_tok.append(tok)
            v_par.append(parent)
            v_q.append(q)
            v_w.append(v_w[parent] * q)
            v_key.append(key)
            v_depth.append(v_depth[parent] + 1)
            v_rank.append(rank)
            v_bid.append(-1)

        def materialise(x: int) -> int:
            chain = []
            y = x
            while v_bid[y] < 0:
                chain.append(y)
                y = v_par[y]
            for z in reversed(chain):
                v_bid[z] = b.add(v_bid[v_par[z]], v_tok[z], v_q[z], v_w[z], rank=v_rank[z])
            return v_bid[x]

        def evaluate(nodes: list[int], cut: float) -> None:
            rows = b.request(source, [materialise(x) for x in nodes])
            evaluated.update(nodes)
            if deterministic:
                conf.extend(rows.detach().to("cpu", torch.float32).numpy().max(axis=1).tolist())
                for i, kids in enumerate(top_children(rows, [v_w[x] for x in nodes], cut, max_draws)):
                    for r, (t, q) in enumerate(kids):
                        add_virtual(nodes[i], t, q, v_w[nodes[i]] * q, r)
                return
            sampler = SiblingSampler(rows, generator, False, max_draws)
            for i, x in enumerate(nodes):
                streams[x] = (sampler, i)

        def next_key(x: int) -> float:
            sampler, i = streams[x]
            if sampler.count[i] >= max_draws or sampler.exhausted(i):
                return 0.0
            return v_w[x] * sampler.remaining(i)  # Alg. 1: v·(1 - R[y]) telescoped

        def select_best() -> list[int]:
            """The n best draws; stochastic draws are made only when they enter the selection."""
            heap = [(-v_key[x], v_depth[x], x, False) for x in range(1, len(v_tok))]
            for x in streams:
                k = next_key(x)
                if k > 0.0:
                    heap.append((-k, v_depth[x] + 1, float("inf"), x))
            heapq.heapify(heap)
            best: list[int] = []
            while heap and len(best) < n:
                neg_key, _, x, stream = heapq.heappop(heap)
                if stream is False:
                    best.append(x)
                    continue
                sampler, i = streams[stream]
                rank = sampler.count[i]
                drawn = sampler.draw(i)
                if drawn is None:
                    continue
                add_virtual(stream, drawn[0], drawn[1], -neg_key, rank)
                if rank == 0:
                    conf.append(drawn[1])
                best.append(len(v_tok) - 1)
                k = next_key(stream)
                if k > 0.0:
                    heapq.heappush(heap, (-k, v_depth[stream] + 1, float("inf"), stream))
            return best

        evaluate([0], 0.0)
        while True:
            best = select_best()
            cut = v_key[best[-1]] if len(best) == n else 0.0
            pending = [x for x in best if x not in evaluated and v_depth[x] < max_depth and v_w[x] > cut]
            if not pending:
                break
            evaluate(self._likely(pending, best, cut, v_w, v_key, v_depth, conf, deterministic), cut)
        for x in sorted(best):
            materialise(x)
        keep = [0] + sorted(v_bid[x] for x in best)
        return b.build(self.sampled_kind(deterministic), keep=keep)

    def _likely(
        self,
        pending: list[int],
        best: list[int],
        cut: float,
        v_w: list[float],
        v_key: list[float],
        v_depth: list[int],
        conf: list[float],
        deterministic: bool,
    ) -> list[int]:
        """The pending nodes predicted to stay internal, or all of them when none is.

        Projection: each pending node y is assumed to grow its main chain, a child of weight
        ``w(y)·q̄`` per level down to the depth cap (q̄ = mean confidence seen so far); the
        projected cut is the (budget-1)-th key among the known draws and these phantoms. Nodes
        whose own best draw falls below it are deferred — the cut may rise past them, saving
        their request — so batches stay small without adding many rounds.
        """
        n, max_depth = self.cfg.budget - 1, self.depth
        q_bar = sum(conf) / len(conf) if conf else 0.5
        keys = [v_key[x] for x in best]
        for y in pending:
            k = v_w[y] if not deterministic else v_w[y] * q_bar
            for _ in range(max_depth - v_depth[y]):
                keys.append(k)
                k *= q_bar
        projected = heapq.nlargest(n, keys)[-1] if len(keys) >= n else cut
        first = (lambda y: v_w[y] * q_bar) if deterministic else (lambda y: v_w[y])
        likely = [y for y in pending if first(y) > projected]
        return likely or pending
