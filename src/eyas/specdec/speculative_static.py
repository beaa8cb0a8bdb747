"""The fast path of batch-1 speculative decoding: every round is a few fixed-shape functions of static
device buffers, captured once as CUDA graphs on a GPU and run eagerly on the CPU (that is how the
tests check them against the plain engine, eyas/specdec/speculative.py).

Key trade-off: the plain engine builds a dense [new, cached + new] mask, grows its caches and walks
the tree on the host, so at batch 1 on a small target every round pays tens of kernel launches and
Python per layer. Here every shape is fixed by the tree (T drafted tokens, D depth), so one round is

    draft   the EAGLE-2 tree (replay.build_tree over a static drafter cache) and its bookkeeping on the
            device: the T submitted tokens, their parents, depths and ancestor matrix
    verify  the target over N = T + 1 slots (root + drafted), positions and the tree mask built on
            the device, keys written at slots start..start+T, attention over the WHOLE cache with a
            [N, max_len] mask (keys past the committed length are masked out, whatever they hold)
    walk    the greedy accept walk on the device (D static steps with an `alive` flag)
    commit  the accepted path's keys gathered into slots start..start+m in place, the drafter's
            step-0 update with the accepted tokens + bonus (D + 1 slots, the extra ones are masked
            garbage the next round overwrites), start += m + 1

and the only device->host copy of a greedy round is the walk's result [m, D path tokens, bonus]
(D + 2 integers). The price: attention spans the whole preallocated cache each round, and every
round drafts, verifies and updates the full static width even when the walk stops early.

The prefill runs eagerly (its shapes change with every prompt): the target and the drafter's step-0
pass attend over the prompt's P slots only, cuDNN attention off (speculative.eager_attention says why).

Sampling (temperature > 0) verifies on the host exactly as the plain engine does (same generator,
same code: SpeculativeDecoder._walk), then writes the accepted nodes into the walk's buffers and
runs the same commit. Target-only decoding (no drafter) is the same loop with T = D = 0.

Shape legend: T drafted tokens submitted (tree.tokens), N = T + 1 verified slots, D tree depth,
K tree candidates, S cache length (max_len), V target vocab, F target feature width, H draft hidden,
E drafter tree slots.

State kept on the device between rounds, with c committed tokens s_0..s_{c-1}:
    start = c - 1: the target cache holds s_0..s_{c-2}, the drafter's step-0 entries t = 0..c-2;
    last_tok = s_{c-1} (the root of the next round); the drafter's `last` = output o_{c-2}.

Run: `eyas generate --drafter DIR --engine static` (eyas/specdec/generate_run.py). On CUDA `eyas eval`
predicts its speed-up from this engine's step costs (measure_static_step_costs, below).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from eyas.common import log
from eyas.specdec.functional import FunctionalDrafter
from eyas.specdec.replay import DraftTree, TreeConfig, build_tree
from eyas.specdec.speculative import (
    DecodeStats,
    LiveProposer,
    SpeculativeDecoder,
    _emit,
    _sync,
    costs_from_samples,
    eager_attention,
)


def _path_end(toks: list[int], nxt: int, budget: int, eos_ids: set[int]) -> tuple[list[int], int | None]:
    """Cut the device walk's accepted path as the plain walk does: at most `budget` tokens, nothing
    after an EOS, and no bonus token when either ends the sequence inside the path."""
    for i, t in enumerate(toks):
        if i == budget:
            return toks[:i], None
        if t in eos_ids:
            return toks[: i + 1], None
    return toks, (nxt if len(toks) < budget else None)


def submitted_rows(tree: DraftTree, T: int, depth_K: torch.Tensor, max_depth: int):
    """The T submitted candidates of every row of a DraftTree, built on the device (no host reads):
    tokens [R, T], parent index among the submitted [R, T] (-1 = the root), depth [R, T] and ancestor
    matrix [R, T, T] (each node's ancestors and itself), in creation order (a parent precedes its
    children). depth_K: the depth of each candidate in build_tree's creation order."""
    sel_RK = tree.selected
    R, K = sel_RK.shape
    dev = sel_RK.device
    rank_RK = sel_RK.long().cumsum(1) - 1  # index among the submitted, for selected candidates
    slot_RK = torch.where(sel_RK, rank_RK, torch.full_like(rank_RK, T))  # the rest land in a dropped slot
    cand_RT = torch.zeros(R, T + 1, dtype=torch.long, device=dev).scatter_(
        1, slot_RK, torch.arange(K, device=dev).expand(R, K)
    )[:, :T]
    pc_RT = tree.parent.gather(1, cand_RT)
    par_RT = torch.where(pc_RT >= 0, rank_RK.gather(1, pc_RT.clamp(min=0)), torch.full_like(pc_RT, -1))
    arange_T = torch.arange(T, device=dev)
    anc = torch.eye(T, dtype=torch.bool, device=dev).expand(R, T, T).clone()
    cur = par_RT
    for _ in range(max_depth - 1):  # a node has at most depth - 1 proper ancestors
        hit = cur >= 0
        anc |= cur[:, :, None] == arange_T  # -1 (past the root) matches no column
        cur = torch.where(hit, par_RT.gather(1, cur.clamp(min=0)), cur)
    return tree.tokens.gather(1, cand_RT), par_RT, depth_K[cand_RT], anc


def greedy_walk(choice_RN: torch.Tensor, tok_RT: torch.Tensor, par_RT: torch.Tensor, depth: int):
    """The greedy accept walk of R rows on the device: from the root, follow the child whose token is
    the target's argmax at the current node (choice_RN: row 0 the root, row 1 + j node j).
    Returns (accepted count m [R], accepted node indices [R, depth] (0 past m), the target's token
    after the path [R]). [R]-shaped throughout: indexing with a 0-dim tensor would read it on the host."""
    R = choice_RN.shape[0]
    dev = choice_RN.device
    cur = torch.full((R,), -1, dtype=torch.long, device=dev)
    alive = torch.ones(R, dtype=torch.bool, device=dev)
    m = torch.zeros(R, dtype=torch.long, device=dev)
    nodes = []
    for _ in range(depth):
        want = choice_RN.gather(1, (cur + 1)[:, None])
        match_RT = (par_RT == cur[:, None]) & (tok_RT == want) & alive[:, None]  # siblings differ: <= 1 hit
        hit = match_RT.any(1)
        j = match_RT.long().argmax(1)
        nodes.append(torch.where(hit, j, torch.zeros_like(j)))
        m = m + hit.long()
        cur = torch.where(hit, j, cur)
        alive = alive & hit
    nxt = choice_RN.gather(1, (cur + 1)[:, None])[:, 0]
    nodes_RD = torch.stack(nodes, dim=1) if nodes else torch.zeros(R, 0, dtype=torch.long, device=dev)
    return m, nodes_RD, nxt


class GraphStep:
    """A function of static buffers (no arguments, no return value) run eagerly, or replayed as a
    CUDA graph once `capture()` has run on a CUDA device."""

    def __init__(self, name: str, fn: Callable[[], None]):
        self.name, self.fn = name, fn
        self.graph: torch.cuda.CUDAGraph | None = None

    @torch.no_grad()
    def capture(self, device: torch.device, reset: Callable[[], None]) -> str | None:
        """Warm up on a side stream, then capture; `reset` restores a harmless state before each run
        (the functions mutate the caches). Returns None, or why it could not capture (then the step
        keeps running eagerly: slower, still exact)."""
        try:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    reset()
                    self.fn()
            torch.cuda.current_stream(device).wait_stream(side)
            reset()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self.fn()
            torch.cuda.synchronize(device)
            self.graph = g
            return None
        except Exception as exc:  # a kernel that cannot be captured must cost speed, not correctness
            torch.cuda.synchronize(device)
            return f"{self.name}: {type(exc).__name__}: {str(exc)[:300]}"

    @torch.no_grad()
    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


def tree_expand(p, t_R, depth, tokens_RF, feats_RFH, slot, tree_mask_RFE, prefix_RS):
    """One draft step of a static proposer `p` (drafter d, caches k/v [B, kv, max_len + slots, d]):
    the R x F frontier tokens' keys go to tree slots slot.., and each attends to the step-0 entries
    prefix_RS marks ([R or 1, max_len]) plus its tree ancestors (tree_mask_RFE)."""
    d, lo = p.d, p.max_len + slot
    R, Fw = tokens_RF.shape
    pos = (t_R + depth)[:, None].expand(R, Fw)
    q, k, v, residual = d.qkv(d.to_target(tokens_RF), feats_RFH, pos)
    p.k[:, :, lo : lo + Fw] = k
    p.v[:, :, lo : lo + Fw] = v
    mask = torch.cat([prefix_RS[:, None, :].expand(R, Fw, p.max_len), tree_mask_RFE], dim=-1)[:, None]
    out = d.finish(d.attend(q, p.k, p.v, mask=mask), residual)
    return d.log_probs(out), out


class StaticProposer(LiveProposer):
    """LiveProposer with every shape fixed: step-0 entries in slots 0..max_len-1 (valid below the
    device scalar `start`), the round's tree slots at max_len..max_len+E-1, `last` a static buffer."""

    def __init__(self, drafter: FunctionalDrafter, *, max_len: int, tree_slots: int, start_1: torch.Tensor):
        super().__init__(drafter, max_len=max_len, tree_slots=tree_slots)
        self.max_len = max_len
        self.start = start_1
        self.last = torch.zeros(drafter.config.hidden_size, device=drafter.device, dtype=drafter.dtype)
        self._slots_S = torch.arange(max_len, device=drafter.device)

    def reset(self) -> None:
        self.length = 0

    @torch.no_grad()
    def extend_static(
        self,
        tokens_M: torch.Tensor,
        aux_MF: torch.Tensor,
        start_1: torch.Tensor,
        m_1: torch.Tensor,
        span: int | None = None,
    ) -> None:
        """Step-0 entries at slots start..start+M-1 (token s_{t+1}, features aux_t); `last` becomes the
        output of entry m (entries past m are padding: masked out until overwritten). Attention spans
        slots 0..span-1: the whole step-0 region by default (the commit's fixed shape); the prefill
        passes its length, which makes it the plain engine's computation (LiveProposer.extend) bit for
        bit, whatever max_len."""
        d, M = self.d, tokens_M.shape[0]
        span = span or self.max_len
        pos_M = start_1 + torch.arange(M, device=d.device)
        q, k, v, residual = d.qkv(tokens_M[None], d.fuse(aux_MF)[None], pos_M[None])
        self.k.index_copy_(2, pos_M, k)
        self.v.index_copy_(2, pos_M, v)
        mask_MS = self._slots_S[None, :span] <= pos_M[:, None]  # causal over the spanned step-0 slots
        kbuf, vbuf = self.k[:, :, :span], self.v[:, :, :span]
        out = d.finish(d.attend(q, kbuf, vbuf, mask=mask_MS[None, None]), residual)  # 1,M,H
        self.last.copy_(out[0].index_select(0, m_1)[0])

    def expand(self, rows_R, t_R, depth, tokens_RF, feats_RFH, slot, tree_mask_RFE):
        prefix_S = self._slots_S < self.start  # step-0 entries 0..c-2, i.e. positions <= t
        return tree_expand(self, t_R, depth, tokens_RF, feats_RFH, slot, tree_mask_RFE, prefix_S[None])


class StaticSpeculativeDecoder(SpeculativeDecoder):
    """SpeculativeDecoder's interface and results with static shapes and, on CUDA, CUDA graphs."""

    def __init__(
        self,
        target,
        drafter: FunctionalDrafter | None,
        *,
        tree: TreeConfig | None,
        layer_ids: list[int],
        max_len: int,
        eos_ids: set[int],
        temperature: float = 0.0,
        seed: int = 0,
        graphs: bool = True,
    ):
        super().__init__(
            target,
            drafter,
            tree=tree,
            layer_ids=layer_ids,
            max_len=max_len,
            eos_ids=eos_ids,
            temperature=temperature,
            seed=seed,
        )
        dev, lm = self.device, self.target.lm
        self.cache_k, self.cache_v = self.target.stacked_caches()  # L,1,K,S,d
        self.T = tree.tokens if drafter is not None else 0
        self.D = tree.depth if drafter is not None else 0
        T, D, N = self.T, self.D, self.T + 1
        vocab = int(lm.lm_head.out_features)
        L = torch.long
        self.start = torch.zeros(1, dtype=L, device=dev)
        self.last_tok = torch.zeros(1, dtype=L, device=dev)
        self.tok_T = torch.zeros(T, dtype=L, device=dev)
        self.par_T = torch.full((T,), -1, dtype=L, device=dev)
        self.depth_T = torch.zeros(T, dtype=L, device=dev)
        self.anc_TT = torch.zeros(T, T, dtype=torch.bool, device=dev)
        self.logits_NV = torch.zeros(N, vocab, device=dev)
        self.aux_NF = torch.zeros(N, 0, device=dev, dtype=lm.dtype)
        self.walk_nodes_D = torch.zeros(D, dtype=L, device=dev)
        self.walk_m_1 = torch.zeros(1, dtype=L, device=dev)
        self.walk_nxt_1 = torch.zeros(1, dtype=L, device=dev)
        self.result = torch.zeros(D + 2, dtype=L, device=dev)  # [m, path tokens (D), bonus]: the one D2H copy
        self._slots_S = torch.arange(max_len, device=dev)
        self._arange_N = torch.arange(N, device=dev)
        self._arange_D1 = torch.arange(D + 1, device=dev)
        if drafter is not None:
            self.proposer = StaticProposer(drafter, max_len=max_len, tree_slots=tree.tree_slots, start_1=self.start)
            self._depth_K = torch.tensor(tree.candidate_depths(), device=dev)
            hidden = int(lm.embed.weight.shape[1])
            width = len(self.target.layer_ids) * hidden
            self.aux_NF = torch.zeros(N, width, device=dev, dtype=lm.dtype)
        self.steps = {
            "draft": GraphStep("draft", self._draft),
            "verify": GraphStep("verify", self._verify),
            "walk": GraphStep("walk", self._walk_device),
            "commit": GraphStep("commit", self._commit),
        }
        if drafter is None:
            del self.steps["draft"]
        self.graph_note: str | None = None  # why some step runs eagerly on CUDA, when one does
        if dev.type == "cuda" and graphs:
            self._capture()

    # -- the four steps (fixed shapes, no host syncs) --------------------------------------------
    def _draft(self) -> None:
        """The tree from the root o_{c-2}, then the T submitted nodes in creation order (a parent
        precedes its children): tokens, parent index among them (-1 = root), depth, ancestors."""
        dev = self.device
        tree = build_tree(self.proposer, torch.zeros(1, dtype=torch.long, device=dev), self.start - 1, self.tree)
        tok, par, depth, anc = submitted_rows(tree, self.T, self._depth_K, self.tree.depth)
        self.tok_T.copy_(tok[0])
        self.par_T.copy_(par[0])
        self.depth_T.copy_(depth[0])
        self.anc_TT.copy_(anc[0])

    def _verify(self) -> None:
        """Root s_{c-1} at position c-1 and the drafted nodes at c-1+depth, into slots start..start+T."""
        T, N, dev = self.T, self.T + 1, self.device
        ids_N = torch.cat([self.last_tok, self.tok_T])
        pos_N = self.start + torch.cat([torch.zeros(1, dtype=torch.long, device=dev), self.depth_T])
        # every row sees the root (column 0); node rows their ancestors and themselves (no scalar
        # setitem: a Python value assigned into a device tensor goes through a host tensor)
        local_NN = torch.cat(
            [
                torch.ones(N, 1, dtype=torch.bool, device=dev),
                torch.cat([torch.zeros(1, T, dtype=torch.bool, device=dev), self.anc_TT]),
            ],
            dim=1,
        )
        col_S = self._slots_S - self.start  # slot relative to the root's
        inside_S = (col_S >= 0) & (col_S < N)
        mask_NS = (col_S < 0)[None, :] | (local_NN[:, col_S.clamp(0, T)] & inside_S[None, :])
        logits, aux = self.target.forward_static(ids_N, pos_N, self.start + self._arange_N, mask_NS)
        self.logits_NV.copy_(logits)
        self.aux_NF.copy_(aux)

    def _walk_device(self) -> None:
        """Greedy accept walk: from the root, follow the child whose token is the target's argmax."""
        m, nodes, nxt = greedy_walk(self.logits_NV.argmax(-1)[None], self.tok_T[None], self.par_T[None], self.D)
        nodes_D = nodes[0]
        self.walk_nodes_D.copy_(nodes_D)
        self.walk_m_1.copy_(m)
        self.walk_nxt_1.copy_(nxt)
        self.result.copy_(torch.cat([m, self.tok_T[nodes_D], nxt]))

    def _commit(self) -> None:
        """Keep the root and the accepted nodes' keys as slots start..start+m, update the drafter."""
        D, m_1 = self.D, self.walk_m_1
        rows_D1 = torch.cat([torch.zeros(1, dtype=torch.long, device=self.device), 1 + self.walk_nodes_D])
        if D > 0:
            dst = self.start + self._arange_D1  # slots past start+m receive padding: masked until overwritten
            src = self.start + rows_D1
            self.cache_k.index_copy_(3, dst, self.cache_k.index_select(3, src))  # gather copies first: overlap is safe
            self.cache_v.index_copy_(3, dst, self.cache_v.index_select(3, src))
        if self.proposer is not None:
            toks_D1 = torch.cat([self.tok_T[self.walk_nodes_D], self.walk_nxt_1])
            toks_D1 = torch.where(self._arange_D1 == m_1, self.walk_nxt_1, toks_D1)  # the bonus right after the path
            self.proposer.extend_static(toks_D1, self.aux_NF[rows_D1], self.start, m_1)
        self.start.add_(m_1 + 1)
        self.last_tok.copy_(self.walk_nxt_1)

    # -- capture -----------------------------------------------------------------------------------
    def _capture(self) -> None:
        def reset():  # a valid state for every step: masks never empty, indices in range
            self.start.fill_(1)
            self.walk_m_1.zero_()
            self.walk_nodes_D.zero_()

        notes = [why for step in self.steps.values() if (why := step.capture(self.device, reset)) is not None]
        reset()
        if notes:
            self.graph_note = "; ".join(notes)
            log(f"speculative (static): some steps run without CUDA graphs ({self.graph_note})")

    def describe(self) -> dict:
        return {
            "engine": "static",
            "graphs": sorted(k for k, s in self.steps.items() if s.graph is not None),
            "graph_note": self.graph_note,
        }

    # -- the loop --------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompt: list[int]) -> int:
        """Fill both caches from `prompt` (P tokens) and set start = P and last_tok = the first generated
        token, which it returns: the state the first round starts from."""
        dev, tgt, prop, P = self.device, self.target, self.proposer, len(prompt)
        tgt.reset()
        with eager_attention(dev):  # eager prefill: shapes [P, P], new with every prompt length
            logits, aux = tgt.forward(torch.tensor(prompt, device=dev), torch.arange(P, device=dev), None)
            first = self._first(logits[-1])
            self.start.fill_(P)
            self.last_tok.fill_(first)
            if prop is not None:
                # step-0 entries t = 0..P-1: token s_{t+1} (the last one is the prefill's token), feature aux_t
                prop.extend_static(
                    torch.tensor(prompt[1:] + [first], device=dev),
                    aux,
                    torch.zeros(1, dtype=torch.long, device=dev),
                    torch.tensor([P - 1], device=dev),
                    span=P,
                )
        return first

    @torch.no_grad()
    def generate(self, prompt: list[int], *, max_new_tokens: int) -> tuple[list[int], DecodeStats]:
        """Generated tokens (EOS kept, nothing after it; at most max_new_tokens) and the stats."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + max_new_tokens + self.T + 1 > self.max_len:
            raise ValueError(f"prompt of {len(prompt)} + {max_new_tokens} new tokens exceeds max_len {self.max_len}")
        dev, st = self.device, DecodeStats(prompt_tokens=len(prompt))
        prop, steps = self.proposer, self.steps
        clock = time.perf_counter
        t0 = clock()
        seq = list(prompt) + [self.prefill(prompt)]
        _sync(dev)
        st.prefill_s = clock() - t0
        greedy = self.temperature == 0
        new = 1
        while new < max_new_tokens and seq[-1] not in self.eos_ids:
            budget = max_new_tokens - new
            t0 = clock()
            if prop is not None:
                steps["draft"]()  # also finishes the previous round's commit, when its time is counted here
            _sync(dev)
            t1 = clock()
            steps["verify"]()
            _sync(dev)
            t2 = clock()
            if greedy:
                steps["walk"]()
                res = self.result.tolist()  # the round's one device->host copy
                m = res[0]
                path, nxt = _path_end(res[1 : 1 + m], res[-1], budget, self.eos_ids)
            else:
                tok, par = torch.stack([self.tok_T, self.par_T]).tolist() if self.T else ([], [])
                nodes, path, nxt = self._walk(self.logits_NV, tok, par, budget)
                if nxt is not None:
                    walk = torch.tensor([len(nodes), nxt] + nodes + [0] * (self.D - len(nodes)), device=dev)
                    self.walk_m_1.copy_(walk[:1])
                    self.walk_nxt_1.copy_(walk[1:2])
                    self.walk_nodes_D.copy_(walk[2:])
            new += _emit(st, seq, path, nxt, drafting=prop is not None)
            t3 = clock()
            st.verify_s += t2 - t1
            st.overhead_s += t3 - t2
            if nxt is not None and new < max_new_tokens and nxt not in self.eos_ids:
                steps["commit"]()  # runs on while the host loops; the next draft's sync waits for it
            st.draft_s += (t1 - t0) + (clock() - t3)
        out = seq[len(prompt) :]
        st.tokens = len(out)
        return out, st


# ----------------------------------------------------------------------------------------------
# step costs of this engine (what `eyas eval`'s prediction uses on CUDA: speculative.predict_for_modes)

MIN_CAPACITY = 1024
"""The smallest cache `eyas generate` gives this engine (generate_run.ensure): every round attends over
all of it, so the costs below are measured at the capacity generate would use, not at `context`."""


@torch.no_grad()
def measure_static_step_costs(
    target,
    drafter: FunctionalDrafter,
    *,
    tree: TreeConfig,
    layer_ids: list[int],
    context: int = 512,
    repeats: int | None = None,
    seed: int = 0,
) -> dict:
    """Seconds per round of this engine after a prefill of `context` random tokens, as generate's loop
    runs it: draft, verify, walk (+ the read of `result`, the round's one device->host copy) and commit
    (KV compaction + the drafter's step-0 update), each step synced (the loop syncs after draft and
    verify and reads after walk; its commit runs on until the next draft's sync, so the whole of it
    counts there too); and a full round of the engine without a drafter (verify of 1 token, walk,
    read, commit), synced the same way: the target-only step.
    On CUDA the steps are the captured graphs (`cuda_graphs` lists them; graph_note says why one is not).

    The rounds are real decoding rounds: each commit advances `start` by m + 1 <= depth + 1, so the
    cache gets room for every round (warm-up included) and nothing is reset between timed rounds (a
    reset would add its own kernel to what is timed). Token values do not change the arithmetic:
    random ids measure the same costs as real text. The decoders are built here and dropped after.
    """
    from eyas.specdec.generate import context_length

    dev = drafter.device
    repeats = repeats or (20 if dev.type == "cuda" else 3)
    warmup = 2 if dev.type == "cuda" else 1
    rounds = warmup + repeats
    room = tree.tokens + 1 + rounds * (tree.depth + 1)  # the last verify writes start..start+T; rounds advance start
    limit = context_length(target)
    context = max(2, min(context, limit - room))
    max_len = min(limit, max(context + room, MIN_CAPACITY))
    vocab = int(target.get_input_embeddings().weight.shape[0])
    prompt = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(seed)).tolist()
    clock = time.perf_counter

    def timed_rounds(dec: StaticSpeculativeDecoder, parts: dict[str, Callable[[], None]]) -> dict[str, list[float]]:
        dec.prefill(prompt)
        samples: dict[str, list[float]] = {name: [] for name in parts}
        for r in range(rounds):
            for name, fn in parts.items():
                t0 = clock()
                fn()
                _sync(dev)
                if r >= warmup:
                    samples[name].append(clock() - t0)
        if int(dec.start) + dec.T + 1 > dec.max_len:  # room above is the bound; this read is after the timing
            raise RuntimeError(f"step-cost rounds ran start to {int(dec.start)} of max_len {dec.max_len}")
        return samples

    spec = StaticSpeculativeDecoder(target, drafter, tree=tree, layer_ids=layer_ids, max_len=max_len, eos_ids=set())
    s = spec.steps
    costs = timed_rounds(
        spec,
        {
            "draft_s": s["draft"],
            "verify_s": s["verify"],
            "walk_s": lambda: (s["walk"](), spec.result.tolist()),
            "commit_s": s["commit"],
        },
    )
    base = StaticSpeculativeDecoder(target, None, tree=None, layer_ids=[], max_len=max_len, eos_ids=set())
    b = base.steps  # synced step by step like the drafter's rounds: the two differ only in what the steps do
    step = timed_rounds(
        base, {"verify": b["verify"], "walk": lambda: (b["walk"](), base.result.tolist()), "commit": b["commit"]}
    )
    notes = [n for n in (spec.describe()["graph_note"], base.describe()["graph_note"]) if n]
    # the prediction's figures: each part's median, and the quartiles of the round and of the target step
    return {
        "engine": "static",
        "context": context,
        "max_len": max_len,
        **costs_from_samples(costs, [sum(x) for x in zip(*step.values())]),
        "cuda_graphs": spec.describe()["graphs"],
        "graph_note": "; ".join(notes) or None,
    }
