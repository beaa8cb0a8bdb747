"""Speculative decoding at batch B > 1 (greedy): B prompts decoded together, every row with its own
accepted length each round, one target forward verifying every row's draft tree.

Key trade-off: static batching with static shapes. All B rows run every step of every round, each
against its OWN cache row and its own committed length (a device vector), so rows progress raggedly
without any per-row host work on the device side; a row that has finished (EOS, max_new_tokens) or an
idle row (fewer prompts than B) keeps running frozen (its state stops advancing and its results are
ignored). That wastes the finished rows' share of each step until the slowest row is done, and
attention spans the whole preallocated cache, but every round is the same four fixed-shape steps
(CUDA graphs on CUDA, eager on the CPU) with ONE device->host copy of B x (D + 5) integers, and the
target-only baseline (drafter None: T = D = 0, one token per row per round) goes through the same
loop, so the speed-up compares like with like. Temperature > 0 is refused (ValueError): batched
rejection sampling is not implemented; batch 1 has it (speculative.py, speculative_static.py).

The round is speculative_static.py's, one row per sequence (same helpers: submitted_rows, greedy_walk,
TreeTarget, build_tree, FunctionalDrafter):

    draft   build_tree over the B rows' drafter caches (BatchedProposer), then every row's T submitted
            tokens, parents, depths and ancestors (submitted_rows)
    verify  TreeTarget.forward_rows over [B, N = T + 1]: row b's root at position start_b, its nodes at
            start_b + depth, keys written to ITS slots start_b..start_b+T, a [B, N, S] mask (its
            committed slots < start_b, plus root/ancestors/itself inside the round's window)
    walk    greedy_walk per row, then the cut on the device: at most max_new - new_b tokens, nothing
            after an EOS, no bonus token when either ends the row inside the path; a row continues
            when it got a bonus token that is no EOS and it is still short of max_new
    commit  per row: the accepted path's keys gathered into slots start_b..start_b+m_b (both the
            target's [L, B, K, S, d] cache and the drafter's step-0 update), start_b += m_b + 1 for
            rows that continue, + 0 for the others (frozen)

Prefill: the prompts right-padded to the longest, one eager forward over [B, Lmax] (causal per row,
attending to cache slots 0..Lmax-1 only, not the whole max_len; cuDNN attention off, as in
speculative_static.py). The padded slots hold garbage that no later query can see (slots >= start_b
are visible only inside a round's window, which the round's own keys overwrite first).

Shape legend: B rows, T drafted tokens a round (tree.tokens), N = T + 1 verified slots, D tree depth,
K tree candidates, S cache length (max_len), L target layers, V target vocab, F target feature width,
H draft hidden, E drafter tree slots, M step-0 entries appended.

State per row b on the device, with c_b committed tokens: start_b = c_b - 1 (target cache and drafter
step-0 entries hold 0..c_b-2), last_tok_b = s_{c_b-1}, new_b = tokens generated, done_b.

Run: `eyas generate --batch-size 4 ...` (eyas/specdec/generate_run.py); tests/test_specdec_batched.py.
"""

from __future__ import annotations

import time

import torch

from eyas.common import log
from eyas.specdec.functional import FunctionalDrafter
from eyas.specdec.replay import TreeConfig, build_tree
from eyas.specdec.speculative import DecodeStats, TreeTarget, _sync, eager_attention
from eyas.specdec.speculative_static import GraphStep, greedy_walk, submitted_rows, tree_expand


class BatchedProposer:
    """The `replay.Proposer` interface over B rows of static step-0 caches: row b's entries in slots
    0..max_len-1 (valid below start_B[b]), the round's tree slots at max_len..max_len+E-1, `last` [B, H]
    the output of each row's last step-0 entry. build_tree is always called with every row."""

    def __init__(self, drafter: FunctionalDrafter, *, batch: int, max_len: int, tree_slots: int, start_B: torch.Tensor):
        self.d = drafter
        c = drafter.config
        shape = (batch, c.num_key_value_heads, max_len + tree_slots, c.head_dim)
        self.k = torch.zeros(shape, device=drafter.device, dtype=drafter.dtype)
        self.v = torch.zeros(shape, device=drafter.device, dtype=drafter.dtype)
        self.max_len, self.slots = max_len, tree_slots
        self.start = start_B
        self.last = torch.zeros(batch, c.hidden_size, device=drafter.device, dtype=drafter.dtype)
        self._slots_S = torch.arange(max_len, device=drafter.device)

    @torch.no_grad()
    def extend_rows(
        self,
        tokens_BM: torch.Tensor,
        aux_BMF: torch.Tensor,
        start_B: torch.Tensor,
        m_B: torch.Tensor,
        span: int | None = None,
    ) -> None:
        """Step-0 entries at slots start_b..start_b+M-1 of every row (token s_{t+1}, features aux_t);
        `last[b]` becomes the output of entry m_b (entries past it are padding, masked until overwritten).
        Attention spans slots 0..span-1: the whole step-0 region by default (the commit's fixed shape),
        the longest prompt in the prefill."""
        d = self.d
        span = span or self.max_len
        B, M = tokens_BM.shape
        pos_BM = start_B[:, None] + torch.arange(M, device=d.device)
        q, k, v, residual = d.qkv(tokens_BM, d.fuse(aux_BMF), pos_BM)  # k, v: B,kv,M,d
        idx = pos_BM[:, None, :, None].expand_as(k)
        self.k.scatter_(2, idx, k)
        self.v.scatter_(2, idx, v)
        mask_BMS = self._slots_S[None, None, :span] <= pos_BM[:, :, None]  # causal over each row's spanned slots
        kbuf, vbuf = self.k[:, :, :span], self.v[:, :, :span]
        out = d.finish(d.attend(q, kbuf, vbuf, mask=mask_BMS[:, None]), residual)  # B,M,H
        self.last.copy_(out.gather(1, m_B[:, None, None].expand(B, 1, out.shape[-1]))[:, 0])

    # -- replay.Proposer (rows_R is every row, in order) ----------------------------------------------
    def begin(self, *args, **kwargs) -> None:
        pass

    def root(self, rows_R, t_R):
        return self.d.log_probs(self.last), self.last

    def expand(self, rows_R, t_R, depth, tokens_RF, feats_RFH, slot, tree_mask_RFE):
        prefix_RS = self._slots_S[None, :] < self.start[:, None]  # step-0 entries 0..c_b-2 of each row
        return tree_expand(self, t_R, depth, tokens_RF, feats_RFH, slot, tree_mask_RFE, prefix_RS)

    def to_target(self, draft_ids):
        return self.d.to_target(draft_ids)


class BatchedSpeculativeDecoder:
    """Greedy speculative decoding (drafter given) or target-only decoding (drafter None) of up to
    `batch` prompts at once; outputs equal each prompt's batch-1 greedy decoding."""

    def __init__(
        self,
        target,
        drafter: FunctionalDrafter | None,
        *,
        tree: TreeConfig | None,
        layer_ids: list[int],
        max_len: int,
        eos_ids: set[int],
        batch: int,
        temperature: float = 0.0,
        graphs: bool = True,
    ):
        if drafter is not None and tree is None:
            raise ValueError("a drafter needs a TreeConfig")
        if temperature != 0:
            raise ValueError("batched decoding is greedy only (temperature 0); sampling needs batch size 1")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.target = TreeTarget(
            target, max_len=max_len, layer_ids=layer_ids if drafter is not None else [], batch=batch
        )
        dev = self.device = self.target.device
        lm = self.target.lm
        self.cache_k, self.cache_v = self.target.stacked_caches()  # L,B,K,S,d
        self.drafter, self.tree = drafter, tree
        self.B, self.max_len = batch, max_len
        self.eos_ids = set(eos_ids)
        self.T = tree.tokens if drafter is not None else 0
        self.D = tree.depth if drafter is not None else 0
        B, T, D, N = batch, self.T, self.D, self.T + 1
        L = torch.long
        self.start = torch.zeros(B, dtype=L, device=dev)
        self.last_tok = torch.zeros(B, dtype=L, device=dev)
        self.new = torch.zeros(B, dtype=L, device=dev)
        self.done = torch.ones(B, dtype=torch.bool, device=dev)
        self.max_new = torch.ones(1, dtype=L, device=dev)
        self.eos_E = torch.tensor(sorted(self.eos_ids), dtype=L, device=dev)
        self.tok_BT = torch.zeros(B, T, dtype=L, device=dev)
        self.par_BT = torch.full((B, T), -1, dtype=L, device=dev)
        self.depth_BT = torch.zeros(B, T, dtype=L, device=dev)
        self.anc_BTT = torch.zeros(B, T, T, dtype=torch.bool, device=dev)
        self.choice_BN = torch.zeros(B, N, dtype=L, device=dev)
        self.aux_BNF = torch.zeros(B, N, 0, device=dev, dtype=lm.dtype)
        self.walk_m = torch.zeros(B, dtype=L, device=dev)
        self.walk_nodes = torch.zeros(B, D, dtype=L, device=dev)
        self.walk_path = torch.zeros(B, D, dtype=L, device=dev)
        self.walk_nxt = torch.zeros(B, dtype=L, device=dev)
        self.walk_cont = torch.zeros(B, dtype=torch.bool, device=dev)
        # [live, emitted path length, bonus?, continues?, path (D), bonus token] per row: the round's one D2H copy
        self.result = torch.zeros(B, D + 5, dtype=L, device=dev)
        self._slots_S = torch.arange(max_len, device=dev)
        self._arange_N = torch.arange(N, device=dev)
        self._arange_D1 = torch.arange(D + 1, device=dev)
        self._rows_B = torch.arange(B, device=dev)
        self.proposer: BatchedProposer | None = None
        if drafter is not None:
            self.proposer = BatchedProposer(
                drafter, batch=B, max_len=max_len, tree_slots=tree.tree_slots, start_B=self.start
            )
            self._depth_K = torch.tensor(tree.candidate_depths(), device=dev)
            width = len(self.target.layer_ids) * int(lm.embed.weight.shape[1])
            self.aux_BNF = torch.zeros(B, N, width, device=dev, dtype=lm.dtype)
        self.steps = {
            "draft": GraphStep("draft", self._draft),
            "verify": GraphStep("verify", self._verify),
            "walk": GraphStep("walk", self._walk),
            "commit": GraphStep("commit", self._commit),
        }
        if drafter is None:
            del self.steps["draft"]
        self.graph_note: str | None = None
        if dev.type == "cuda" and graphs:
            self._capture()

    # -- the four steps (fixed shapes, no host reads) ------------------------------------------------
    def _draft(self) -> None:
        tree = build_tree(self.proposer, self._rows_B, self.start - 1, self.tree)
        tok, par, depth, anc = submitted_rows(tree, self.T, self._depth_K, self.tree.depth)
        self.tok_BT.copy_(tok)
        self.par_BT.copy_(par)
        self.depth_BT.copy_(depth)
        self.anc_BTT.copy_(anc)

    def _verify(self) -> None:
        B, T, N, dev = self.B, self.T, self.T + 1, self.device
        start = self.start[:, None]
        ids_BN = torch.cat([self.last_tok[:, None], self.tok_BT], dim=1)
        pos_BN = start + torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), self.depth_BT], dim=1)
        # inside the round's window: every token sees the root (column 0), a node its ancestors and itself
        local_BNN = torch.cat(
            [
                torch.ones(B, N, 1, dtype=torch.bool, device=dev),
                torch.cat([torch.zeros(B, 1, T, dtype=torch.bool, device=dev), self.anc_BTT], dim=1),
            ],
            dim=2,
        )
        col_BS = self._slots_S[None, :] - start  # slot relative to the row's root
        inside_BS = (col_BS >= 0) & (col_BS < N)
        window_BNS = local_BNN.gather(2, col_BS.clamp(0, T)[:, None, :].expand(B, N, self.max_len))
        mask_BNS = (col_BS < 0)[:, None, :] | (window_BNS & inside_BS[:, None, :])
        logits, aux = self.target.forward_rows(ids_BN, pos_BN, start + self._arange_N, mask_BNS)
        self.choice_BN.copy_(logits.argmax(-1))
        self.aux_BNF.copy_(aux)

    def _walk(self) -> None:
        D = self.D
        m, nodes, nxt = greedy_walk(self.choice_BN, self.tok_BT, self.par_BT, D)
        path = self.tok_BT.gather(1, nodes)  # B,D (garbage past m)
        is_eos = (path[:, :, None] == self.eos_E).any(-1) & (self._arange_D1[None, :D] < m[:, None])
        budget = self.max_new - self.new
        first_eos = (
            torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, torch.full_like(m, D + 1))
            if D
            else torch.ones_like(m)
        )  # target-only: no path to cut
        live = ~self.done
        emitted = torch.minimum(torch.minimum(m, budget), first_eos) * live
        bonus = (m < budget) & ~is_eos.any(1) & live
        new = self.new + emitted + bonus.long()
        cont = bonus & ~(nxt[:, None] == self.eos_E).any(-1) & (new < self.max_new)
        self.new.copy_(new)
        self.done.copy_(~cont)
        self.walk_m.copy_(m)
        self.walk_nodes.copy_(nodes)
        self.walk_path.copy_(path)
        self.walk_nxt.copy_(nxt)
        self.walk_cont.copy_(cont)
        self.result.copy_(
            torch.cat(
                [
                    live.long()[:, None],
                    emitted[:, None],
                    bonus.long()[:, None],
                    cont.long()[:, None],
                    path,
                    nxt[:, None],
                ],
                dim=1,
            )
        )

    def _commit(self) -> None:
        """Every row: the root and the accepted nodes' keys into slots start..start+m (rows that stop
        too: only slots >= start change, which they never read again), the drafter's step-0 update;
        then start += m + 1 for the rows that continue."""
        B, D, m = self.B, self.D, self.walk_m
        rows_BD1 = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=self.device), 1 + self.walk_nodes], dim=1)
        if D > 0:
            Lyr, _, K, _, d = self.cache_k.shape
            src = (self.start[:, None] + rows_BD1)[None, :, None, :, None].expand(Lyr, B, K, D + 1, d)
            dst = (self.start[:, None] + self._arange_D1)[None, :, None, :, None].expand(Lyr, B, K, D + 1, d)
            self.cache_k.scatter_(3, dst, self.cache_k.gather(3, src))  # gather copies first: overlap is safe
            self.cache_v.scatter_(3, dst, self.cache_v.gather(3, src))
        if self.proposer is not None:
            nxt = self.walk_nxt[:, None]
            toks = torch.cat([self.walk_path, nxt], dim=1)
            toks = torch.where(self._arange_D1[None, :] == m[:, None], nxt, toks)  # the bonus right after the path
            aux = self.aux_BNF.gather(1, rows_BD1[:, :, None].expand(B, D + 1, self.aux_BNF.shape[-1]))
            self.proposer.extend_rows(toks, aux, self.start, m)
        cont = self.walk_cont
        self.start.add_(torch.where(cont, m + 1, torch.zeros_like(m)))
        self.last_tok.copy_(torch.where(cont, self.walk_nxt, self.last_tok))

    # -- capture -------------------------------------------------------------------------------------
    def _capture(self) -> None:
        def reset():  # a valid state for every step: masks never empty, indices in range
            self.start.fill_(1)
            self.new.zero_()
            self.done.fill_(True)
            self.walk_m.zero_()
            self.walk_nodes.zero_()
            self.walk_cont.fill_(False)

        notes = [why for step in self.steps.values() if (why := step.capture(self.device, reset)) is not None]
        reset()
        if notes:
            self.graph_note = "; ".join(notes)
            log(f"speculative (batched): some steps run without CUDA graphs ({self.graph_note})")

    def describe(self) -> dict:
        return {
            "engine": "batched",
            "batch": self.B,
            "graphs": sorted(k for k, s in self.steps.items() if s.graph is not None),
            "graph_note": self.graph_note,
        }

    # -- prefill -------------------------------------------------------------------------------------
    @torch.no_grad()
    def _prefill(self, prompts: list[list[int]], max_new_tokens: int) -> list[int]:
        """Every row's prompt in one forward (right-padded; rows past len(prompts) get a 1-token dummy
        and stay done); the state set for the first round; returns the rows' first tokens."""
        B, dev = self.B, self.device
        rows = prompts + [prompts[0][:1]] * (B - len(prompts))
        lens = [len(p) for p in rows]
        Lmax = max(lens)
        ids = torch.zeros(B, Lmax, dtype=torch.long)
        for b, p in enumerate(rows):
            ids[b, : len(p)] = torch.tensor(p)
        ids_BL = ids.to(dev)
        P_B = torch.tensor(lens, device=dev)
        pos_BL = torch.arange(Lmax, device=dev).expand(B, Lmax)
        mask_BLL = self._slots_S[None, None, :Lmax] <= pos_BL[:, :, None]  # slots past the prompts: none to see
        with eager_attention(dev):  # eager: shapes [Lmax, Lmax], new with every longest prompt
            logits, aux = self.target.forward_rows(ids_BL, pos_BL, pos_BL, mask_BLL, logits_at=P_B - 1)
        first_B = logits[:, 0].argmax(-1)
        self.start.copy_(P_B)
        self.last_tok.copy_(first_B)
        self.new.fill_(1)
        self.max_new.fill_(max_new_tokens)
        idle = torch.arange(B, device=dev) >= len(prompts)
        self.done.copy_(idle | (first_B[:, None] == self.eos_E).any(-1) | (max_new_tokens <= 1))
        if self.proposer is not None:
            # step-0 entries t = 0..P-1: token s_{t+1} (the last one is the prefill's token), feature aux_t
            toks = torch.cat([ids_BL[:, 1:], ids_BL[:, :1]], dim=1).scatter(1, (P_B - 1)[:, None], first_B[:, None])
            with eager_attention(dev):
                self.proposer.extend_rows(toks, aux, torch.zeros_like(P_B), P_B - 1, span=Lmax)
        return first_B.tolist()

    # -- the loop ------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], *, max_new_tokens: int
    ) -> tuple[list[list[int]], DecodeStats, list[list[int]]]:
        """Up to `batch` prompts decoded together -> (generated tokens per prompt (EOS kept, nothing
        after it; at most max_new_tokens), stats of the whole batch (accepted_per_round: row 0's
        rounds, then row 1's, ...), accepted counts per prompt per round)."""
        if not 1 <= len(prompts) <= self.B:
            raise ValueError(f"{len(prompts)} prompts for a batch of {self.B}")
        if any(not p for p in prompts):
            raise ValueError("a prompt is empty")
        longest = max(map(len, prompts))
        if longest + max_new_tokens + self.T + 1 > self.max_len:
            raise ValueError(f"prompt of {longest} + {max_new_tokens} new tokens exceeds max_len {self.max_len}")
        dev, steps, n = self.device, self.steps, len(prompts)
        st = DecodeStats(prompt_tokens=sum(map(len, prompts)))
        clock = time.perf_counter
        t0 = clock()
        first = self._prefill(prompts, max_new_tokens)
        _sync(dev)
        st.prefill_s = clock() - t0
        outs = [[first[b]] for b in range(n)]
        accepted: list[list[int]] = [[] for _ in range(n)]
        going = [max_new_tokens > 1 and first[b] not in self.eos_ids for b in range(n)]
        drafting = self.proposer is not None
        while any(going):
            t0 = clock()
            if drafting:
                steps["draft"]()  # also finishes the previous round's commit
            _sync(dev)
            t1 = clock()
            steps["verify"]()
            _sync(dev)
            t2 = clock()
            steps["walk"]()
            res = self.result.tolist()  # the round's one device->host copy
            for b in range(n):
                live, e, bonus, cont, *path_nxt = res[b]
                if not live:
                    continue
                outs[b] += path_nxt[:e] + ([path_nxt[-1]] if bonus else [])
                if drafting:
                    accepted[b].append(e)
                going[b] = bool(cont)
            t3 = clock()
            st.verify_s += t2 - t1
            st.overhead_s += t3 - t2
            if any(going):
                steps["commit"]()  # runs on while the host loops; the next draft's sync waits for it
            st.draft_s += (t1 - t0) + (clock() - t3)
        st.tokens = sum(map(len, outs))
        st.accepted_per_round = [a for row in accepted for a in row]
        return outs, st, accepted
