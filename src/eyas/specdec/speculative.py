"""Real speculative decoding at batch 1: an EAGLE-3 drafter proposes a chain or an EAGLE-2 tree, the
target verifies every drafted token in ONE forward, and both KV caches keep only the accepted path.

Key trade-off: plain PyTorch with a dense [new, cached + new] attention mask and host-side tree
bookkeeping. It is exact and easy to check (greedy output equals the target's own greedy decoding
token for token, and the accepted counts equal `eyas eval`'s replay, tests/test_specdec_speculative.py),
but on a GPU every round pays Python and launch overhead. The fast path (static shapes, CUDA graphs
for the draft and the verify forward, an on-device accept walk) is specdec/speculative_static.py,
tested against this one.

Target-only decoding runs through the same loop with no drafter (each round verifies only the last
committed token), so the speed-up compares like with like.

Shape legend: N verified tokens this round (root + drafted nodes), S cache length, D target hidden,
A aux layers, F = A*D target feature width, H draft hidden, V target vocab, Vd draft vocab, E tree slots.

One round, with c committed tokens s_0..s_{c-1} (prompt + generated):
    target cache holds s_0..s_{c-2}; the root s_{c-1} is fed now at position c-1, each drafted node
    at position c-1+depth; the root sees the cache and itself, a node sees the cache, the root, its
    ancestors and itself.
    drafter cache holds step-0 entries t = 0..c-2 (token s_{t+1}, feature aux_t); its last output
    o_{c-2} is the tree's root (it proposes s_c).
    accept a_1..a_m along the tree, then the target's bonus token b:
        target cache keeps s_{c-1}, a_1..a_m (positions c-1..c-1+m), the rest of the round is dropped;
        drafter gets step-0 entries t = c-1..c-1+m: tokens a_1..a_m, b with the target's aux states
        of s_{c-1}, a_1..a_m from the verify forward.
    prompt [p0 p1 p2] -> prefill caches p0 p1 p2, samples g0; c = 4, the first round feeds g0 at position 3.

Sampling (temperature > 0): each node's submitted children are candidates fixed by the drafter (not
samples of it), so verification is sequential rejection against point-mass proposals: candidate x is
accepted with probability p'(x) / sum(p'), where p' is the target's distribution with the rejected
siblings removed; if every child is rejected the token is drawn from what is left of p'. The emitted
token therefore follows the target's distribution exactly, whatever the drafter proposes.

Run: `eyas generate --drafter DIR --prompts mtbench` (eyas/commands/generate.py).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from eyas.specdec.functional import FunctionalDrafter
from eyas.specdec.replay import TreeConfig, build_tree


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eager_attention(device: torch.device):
    """SDPA backends for attention whose shapes change from call to call (a prompt's prefill, the plain
    engine's growing cache): all but cuDNN's. On Hopper (cuDNN > 9.15) torch tries cuDNN attention
    first, and cuDNN builds an execution graph for every new (query, key, mask) shape before running
    it: each static-engine prefill met two new shapes (the target's [P, P], the drafter's step-0 pass)
    and the plain engine one a round, which made the first prefill of each shape several times slower than the
    next. Flash and memory-efficient attention have no
    per-shape set-up. The CUDA-graph steps replay one shape and keep torch's choice. A no-op off CUDA."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


# ----------------------------------------------------------------------------------------------
# target: a KV-cached forward over any [new tokens x (cache + new)] mask


class TreeTarget:
    """The target's own modules over a batch-1 KV cache (eyas.regen.static_lm.StaticLM's buffers),
    with one forward that takes arbitrary positions and a dense mask, and returns the aux states."""

    def __init__(self, model, *, max_len: int, layer_ids: list[int], batch: int = 1):
        """`batch` cache rows: forward, forward_static and keep are for batch 1; forward_rows runs every
        row, each against its own cache row (specdec/speculative_batched.py)."""
        from eyas.regen.static_lm import StaticLM

        self.lm = StaticLM(model, batch=batch, max_len=max_len, attention="sdpa", prefill="sdpa")
        self.device = self.lm.device
        self.layer_ids = list(layer_ids)
        self.length = 0  # cache entries in use (positions 0..length-1)

    def reset(self) -> None:
        self.length = 0

    @torch.no_grad()
    def forward(
        self, ids_N: torch.Tensor, pos_N: torch.Tensor, mask_NS: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed N tokens into cache slots length..length+N-1 -> (logits [N, V] fp32, aux [N, F]).

        mask_NS: bool [N, length+N] (True = may attend), or None for a causal block after the cache.
        The new entries stay in the cache until `keep` compacts them.
        """
        lm = self.lm
        N = ids_N.shape[0]
        start, S = self.length, self.length + ids_N.shape[0]
        if S > lm.max_len:
            raise RuntimeError(f"target cache overflow: {S} > {lm.max_len}")
        if mask_NS is None:
            mask_NS = torch.ones(N, S, dtype=torch.bool, device=self.device).tril(start)

        def store(i: int, k_1KNd: torch.Tensor, v_1KNd: torch.Tensor):
            lm.cache_k[i][:, :, start:S] = k_1KNd
            lm.cache_v[i][:, :, start:S] = v_1KNd
            return lm.cache_k[i][:, :, :S], lm.cache_v[i][:, :, :S]

        logits, aux = self._layers(ids_N[None], pos_N[None], mask_NS[None], store)
        self.length = S
        return logits[0], aux[0]

    @torch.no_grad()
    def forward_static(
        self, ids_N: torch.Tensor, pos_N: torch.Tensor, write_N: torch.Tensor, mask_NS: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same forward with every shape fixed (what a CUDA graph captures): the new keys go to
        cache slots write_N (a device tensor), attention runs over the WHOLE cache, mask_NS [N, max_len]
        marking the slots each token may see. `length` is not touched (the caller keeps it on the device)."""
        lm = self.lm

        def store(i: int, k_1KNd: torch.Tensor, v_1KNd: torch.Tensor):
            lm.cache_k[i].index_copy_(2, write_N, k_1KNd)
            lm.cache_v[i].index_copy_(2, write_N, v_1KNd)
            return lm.cache_k[i], lm.cache_v[i]

        logits, aux = self._layers(ids_N[None], pos_N[None], mask_NS[None], store)
        return logits[0], aux[0]

    def stacked_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One tensor per K and V for all layers ([L, B, K, S, d]), the layers' caches becoming views of
        it: a cache compaction is then one gather + one scatter for the whole stack, not two per layer."""
        lm = self.lm
        k, v = torch.stack(lm.cache_k), torch.stack(lm.cache_v)
        lm.cache_k, lm.cache_v = list(k.unbind(0)), list(v.unbind(0))
        return k, v

    @torch.no_grad()
    def forward_rows(
        self,
        ids_BN: torch.Tensor,
        pos_BN: torch.Tensor,
        write_BN: torch.Tensor,
        mask_BNS: torch.Tensor,
        *,
        logits_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_static for every cache row at once: row b's N new keys go to its slots write_BN[b],
        mask_BNS [B, N, S] marks the slots 0..S-1 of its OWN cache row each token may see (S = max_len
        in a round, a fixed shape; the prefill's S = its longest prompt: no attention over empty slots).
        Returns (logits [B, N, V] fp32, or [B, 1, V] at position logits_at[b] of each row, aux [B, N, F])."""
        lm = self.lm
        B, N = ids_BN.shape
        S = mask_BNS.shape[-1]
        idx = write_BN[:, None, :, None].expand(B, lm.kv_heads, N, lm.head_dim)

        def store(i: int, k_BKNd: torch.Tensor, v_BKNd: torch.Tensor):
            lm.cache_k[i].scatter_(2, idx, k_BKNd)
            lm.cache_v[i].scatter_(2, idx, v_BKNd)
            return lm.cache_k[i][:, :, :S], lm.cache_v[i][:, :, :S]

        return self._layers(ids_BN, pos_BN, mask_BNS, store, logits_at=logits_at)

    def _layers(self, ids_BN, pos_BN, mask_BNS, store, logits_at=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder stack over N new tokens of B rows; store(layer, k, v) writes their keys and
        returns the keys/values to attend to ([B, K, S, d] each, S = mask_BNS.shape[-1]).
        Returns (logits [B, N, V] fp32, aux [B, N, F])."""
        lm = self.lm
        B, N = ids_BN.shape
        cos = lm.cos_Sd[pos_BN][:, :, None]  # B,N,1,d
        sin = lm.sin_Sd[pos_BN][:, :, None]
        x = lm.embed(ids_BN)  # B,N,D
        want: dict[int, list[int]] = {}  # layer -> aux slots (small targets can repeat an id: [2, 2, 1])
        for a, i in enumerate(self.layer_ids):
            want.setdefault(i, []).append(a)
        aux: list[torch.Tensor | None] = [None] * len(self.layer_ids)
        mask = mask_BNS[:, None]
        for i, layer in enumerate(lm.layers):
            for a in want.get(i, ()):
                aux[a] = x
            attn = layer.self_attn
            q, k, v = lm._qkv(attn, layer.input_layernorm(x))  # BN,H,d / BN,K,d
            q = lm._rope(q.view(B, N, lm.heads, lm.head_dim), cos, sin)
            k = lm._rope(k.view(B, N, lm.kv_heads, lm.head_dim), cos, sin)
            keys, values = store(i, k.transpose(1, 2), v.view(B, N, lm.kv_heads, lm.head_dim).transpose(1, 2))
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=lm.groups > 1
            )  # B,H,N,d
            x = x + attn.o_proj(o.transpose(1, 2).reshape(B, N, lm.heads * lm.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        aux_BNF = torch.cat(aux, dim=-1) if aux else x.new_zeros(B, N, 0)
        if logits_at is not None:
            x = x.gather(1, logits_at[:, None, None].expand(B, 1, x.shape[-1]))
        return lm._logits(x), aux_BNF

    def keep(self, start: int, slots: list[int]) -> None:
        """Keep the entries at cache `slots` (ascending, >= start) as positions start.., drop the rest."""
        idx = torch.tensor(slots, device=self.device)
        n = len(slots)
        if slots != list(range(start, start + n)):  # the accepted path is not already in place
            for ck, cv in zip(self.lm.cache_k, self.lm.cache_v):
                ck[:, :, start : start + n] = ck[:, :, idx]  # advanced indexing copies first: overlap is safe
                cv[:, :, start : start + n] = cv[:, :, idx]
        self.length = start + n


# ----------------------------------------------------------------------------------------------
# drafter: step-0 cache of the committed sequence + tree slots for one round


class LiveProposer:
    """The `replay.Proposer` interface over a growing step-0 KV cache of one sequence (row 0)."""

    def __init__(self, drafter: FunctionalDrafter, *, max_len: int, tree_slots: int):
        self.d = drafter
        c = drafter.config
        # one buffer: step-0 entries 0..length-1, then this round's tree slots right after them (scratch
        # that the next extend() overwrites), so a draft step attends to one contiguous slice, no copy
        shape = (1, c.num_key_value_heads, max_len + tree_slots, c.head_dim)
        self.k = torch.zeros(shape, device=drafter.device, dtype=drafter.dtype)
        self.v = torch.zeros(shape, device=drafter.device, dtype=drafter.dtype)
        self.slots = tree_slots
        self.length = 0
        self.last: torch.Tensor | None = None  # pre-norm output of the last step-0 entry [H]

    def reset(self) -> None:
        self.length, self.last = 0, None

    @torch.no_grad()
    def extend(self, tokens_M: torch.Tensor, aux_MF: torch.Tensor) -> None:
        """Append step-0 entries t = length..length+M-1: token s_{t+1}, target features aux_t."""
        d, n, M = self.d, self.length, tokens_M.shape[0]
        pos = torch.arange(n, n + M, device=d.device)[None]
        q, k, v, residual = d.qkv(tokens_M[None], d.fuse(aux_MF)[None], pos)
        self.k[:, :, n : n + M] = k
        self.v[:, :, n : n + M] = v
        mask = torch.ones(M, n + M, dtype=torch.bool, device=d.device).tril(n)
        out = d.finish(d.attend(q, self.k[:, :, : n + M], self.v[:, :, : n + M], mask=mask[None, None]), residual)
        self.length = n + M
        self.last = out[0, -1]

    # -- replay.Proposer -------------------------------------------------------------------------
    def begin(self, *args, **kwargs) -> None:  # the live cache is filled by extend()
        pass

    def root(self, rows_R, t_R):
        out = self.last[None]
        return self.d.log_probs(out), out

    def expand(self, rows_R, t_R, depth, tokens_RF, feats_RFH, slot, tree_mask_RFE):
        d, n = self.d, self.length
        R, Fw = tokens_RF.shape
        pos = (t_R + depth)[:, None].expand(R, Fw)
        q, k, v, residual = d.qkv(d.to_target(tokens_RF), feats_RFH, pos)
        self.k[:, :, n + slot : n + slot + Fw] = k
        self.v[:, :, n + slot : n + slot + Fw] = v
        kbuf, vbuf = self.k[:, :, : n + self.slots], self.v[:, :, : n + self.slots]
        mask = torch.cat([torch.ones(R, Fw, n, dtype=torch.bool, device=d.device), tree_mask_RFE], dim=-1)[:, None]
        out = d.finish(d.attend(q, kbuf, vbuf, mask=mask), residual)
        return d.log_probs(out), out

    def to_target(self, draft_ids):
        return self.d.to_target(draft_ids)


# ----------------------------------------------------------------------------------------------
# one sequence


def sample_among(p_V: torch.Tensor, candidates: list[int], gen: torch.Generator) -> tuple[int | None, int]:
    """Draw one token from p_V (probabilities, any positive scale) by testing fixed candidates first.

    Candidate x is accepted with probability p'(x) / sum(p'), p' = p with the candidates already
    rejected removed; if none is accepted the token comes from the rest of p'. Every token x thus
    comes out with probability exactly p(x) / sum(p) (the candidates only decide which path of the
    tree it is reached by). Returns (index of the accepted candidate or None, the token).
    """
    p = p_V.clone()
    for k, x in enumerate(candidates):
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        if u * float(p.sum()) < float(p[x]):
            return k, x
        p[x] = 0.0
    return None, int(torch.multinomial(p / p.sum(), 1, generator=gen))


@dataclass
class DecodeStats:
    """What one or more decodes measured; `accepted_per_round` feeds eyas.specdec.metrics.summarize."""

    tokens: int = 0
    prompt_tokens: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.draft_s + self.verify_s + self.overhead_s

    def add(self, other: DecodeStats) -> None:
        self.tokens += other.tokens
        self.prompt_tokens += other.prompt_tokens
        self.accepted_per_round += other.accepted_per_round
        for k in ("prefill_s", "draft_s", "verify_s", "overhead_s"):
            setattr(self, k, getattr(self, k) + getattr(other, k))


def _submitted(tree) -> tuple[list[int], list[int], list[int]]:
    """Selected candidates of a one-row DraftTree -> (target tokens, parent index among them or -1, depth)."""
    sel = tree.selected[0].tolist()
    cand = [i for i, s in enumerate(sel) if s]  # creation order: a parent precedes its children
    where = {c: j for j, c in enumerate(cand)}
    toks, parents = tree.tokens[0].tolist(), tree.parent[0].tolist()
    tok = [toks[c] for c in cand]
    par = [-1 if parents[c] < 0 else where[parents[c]] for c in cand]
    depth: list[int] = []
    for p in par:
        depth.append(1 if p < 0 else depth[p] + 1)
    return tok, par, depth


def _emit(st: DecodeStats, seq: list[int], path: list[int], nxt: int | None, *, drafting: bool) -> int:
    """Append a round's accepted tokens and bonus token to `seq` (and, when drafting, the accepted
    count to the stats); the number of tokens emitted."""
    if drafting:
        st.accepted_per_round.append(len(path))
    seq += path
    if nxt is not None:
        seq.append(nxt)
    return len(path) + (nxt is not None)


def _tree_mask(par: list[int], start: int, device) -> torch.Tensor:
    """[1+N, start+1+N] bool: every row sees the cache and the root; a node its ancestors and itself."""
    N = len(par)
    m = torch.zeros(1 + N, start + 1 + N, dtype=torch.bool)
    m[:, : start + 1] = True
    for j, p in enumerate(par):
        row = 1 + j
        if p >= 0:
            m[row, start + 1 :] = m[1 + p, start + 1 :]
        m[row, start + 1 + j] = True
    return m.to(device)


class SpeculativeDecoder:
    """Batch-1 speculative decoding (drafter given) or plain decoding (drafter None) with one code path."""

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
    ):
        if drafter is not None and tree is None:
            raise ValueError("a drafter needs a TreeConfig")
        self.target = TreeTarget(target, max_len=max_len, layer_ids=layer_ids if drafter is not None else [])
        self.device = self.target.device
        self.drafter = drafter
        self.tree = tree
        self.proposer = (
            LiveProposer(drafter, max_len=max_len, tree_slots=tree.tree_slots) if drafter is not None else None
        )
        self.eos_ids = set(eos_ids)
        self.temperature = float(temperature)
        self.max_len = max_len
        self.gen = torch.Generator(device="cpu").manual_seed(seed)

    # -- token choice ------------------------------------------------------------------------------
    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.double().cpu() / self.temperature, dim=-1)

    def _draw(self, p: torch.Tensor) -> int:
        return int(torch.multinomial(p / p.sum(), 1, generator=self.gen))

    def _walk(
        self, logits_NV: torch.Tensor, tok: list[int], par: list[int], budget: int
    ) -> tuple[list[int], list[int], int | None]:
        """Accept along the tree -> (accepted node indices, their tokens, next token or None when the
        budget or an EOS ends the sequence inside the path)."""
        children: dict[int, list[int]] = {}
        for j, p in enumerate(par):
            children.setdefault(p, []).append(j)
        greedy = self.temperature == 0
        choice = logits_NV.argmax(-1).tolist() if greedy else None
        nodes, path = [], []
        cur = -1  # the root
        while True:
            row = cur + 1
            kids = children.get(cur, [])
            if greedy:
                nxt = choice[row]
                hit = next((j for j in kids if tok[j] == nxt), None)
            else:
                k, nxt = sample_among(self._probs(logits_NV[row]), [tok[j] for j in kids], self.gen)
                hit = kids[k] if k is not None else None
            if hit is None or len(path) == budget:
                return nodes, path, (nxt if len(path) < budget else None)
            nodes.append(hit)
            path.append(nxt)
            cur = hit
            if nxt in self.eos_ids:
                return nodes, path, None

    def _first(self, logits_V: torch.Tensor) -> int:
        return int(logits_V.argmax()) if self.temperature == 0 else self._draw(self._probs(logits_V))

    # -- the loop --------------------------------------------------------------------------------
    def generate(self, prompt: list[int], *, max_new_tokens: int) -> tuple[list[int], DecodeStats]:
        """Generated tokens (EOS kept, nothing after it; at most max_new_tokens) and the stats."""
        with eager_attention(self.device):  # every round's attention has a new shape
            return self._generate(prompt, max_new_tokens=max_new_tokens)

    @torch.no_grad()
    def _generate(self, prompt: list[int], *, max_new_tokens: int) -> tuple[list[int], DecodeStats]:
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + max_new_tokens + (self.tree.tokens if self.tree else 0) + 1 > self.max_len:
            raise ValueError(f"prompt of {len(prompt)} + {max_new_tokens} new tokens exceeds max_len {self.max_len}")
        dev, st = self.device, DecodeStats(prompt_tokens=len(prompt))
        tgt, prop = self.target, self.proposer
        tgt.reset()
        clock = time.perf_counter
        t0 = clock()
        ids = torch.tensor(prompt, device=dev)
        logits, aux = tgt.forward(ids, torch.arange(len(prompt), device=dev), None)
        seq = list(prompt) + [self._first(logits[-1])]
        if prop is not None:
            prop.reset()
            # step-0 entries t = 0..P-1: token s_{t+1} (the last one is the prefill's token), feature aux_t
            prop.extend(torch.tensor(seq[1:], device=dev), aux)
        _sync(dev)
        st.prefill_s = clock() - t0
        new = 1
        while new < max_new_tokens and seq[-1] not in self.eos_ids:
            c = len(seq)
            t0 = clock()
            if prop is not None:
                drafted = build_tree(
                    prop, torch.zeros(1, dtype=torch.long, device=dev), torch.tensor([c - 2], device=dev), self.tree
                )
                tok, par, depth = _submitted(drafted)
            else:
                tok, par, depth = [], [], []
            _sync(dev)
            t1 = clock()
            start = tgt.length  # == c - 1
            ids = torch.tensor([seq[-1]] + tok, device=dev)
            pos = torch.tensor([c - 1] + [c - 1 + dd for dd in depth], device=dev)
            mask = _tree_mask(par, start, dev) if tok else None
            logits, aux = tgt.forward(ids, pos, mask)
            _sync(dev)
            t2 = clock()
            nodes, path, nxt = self._walk(logits, tok, par, max_new_tokens - new)
            new += _emit(st, seq, path, nxt, drafting=prop is not None)
            # keep the root and the accepted nodes' keys, in path order (their new positions c-1..)
            tgt.keep(start, [start] + [start + 1 + j for j in nodes])
            t3 = clock()
            st.verify_s += t2 - t1
            st.overhead_s += t3 - t2
            if prop is not None and nxt is not None and new < max_new_tokens and nxt not in self.eos_ids:
                rows = torch.tensor([0] + [1 + j for j in nodes], device=dev)
                prop.extend(torch.tensor(path + [nxt], device=dev), aux[rows])
                _sync(dev)
            st.draft_s += (t1 - t0) + (clock() - t3)
        out = seq[len(prompt) :]
        st.tokens = len(out)
        return out, st


def decode_many(
    decoder: SpeculativeDecoder, prompts: list[list[int]], *, max_new_tokens: int, on_done=None
) -> tuple[list[list[int]], DecodeStats]:
    total = DecodeStats()
    outs = []
    for p in prompts:
        out, st = decoder.generate(p, max_new_tokens=max_new_tokens)
        outs.append(out)
        total.add(st)
        if on_done is not None:
            on_done(out, st)
    return outs, total


def stats_summary(st: DecodeStats, *, depth: int | None, drafted_per_round: int | None) -> dict[str, Any]:
    """tokens/s, the time split and (with a drafter) tau and per-position acceptance."""
    from eyas.specdec.metrics import summarize

    out: dict[str, Any] = {
        "generated_tokens": st.tokens,
        "tokens_per_s": st.tokens / st.total_s if st.total_s else None,
        "time_s": {k: round(getattr(st, k), 4) for k in ("prefill_s", "draft_s", "verify_s", "overhead_s")}
        | {"total_s": round(st.total_s, 4)},
    }
    if depth is not None:
        m = summarize([st.accepted_per_round], depth=depth, drafted_per_round=drafted_per_round)
        out |= {
            k: m[k]
            for k in (
                "rounds",
                "accepted",
                "acceptance_length",
                "accepted_per_drafted",
                "per_position_acceptance",
                "accepted_length_histogram",
            )
        }
    return out


# ----------------------------------------------------------------------------------------------
# step costs and the speed-up they predict


PREDICTION_MAX_SPREAD = 0.2
"""Widest relative range, (high - low) / value, a predicted speed-up is reported with: wider, the timings
measured the machine's load rather than the engine's costs, so the figure is withheld."""


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    """(lower quartile, median, upper quartile) of `samples` (one sample: itself three times)."""
    import statistics

    if not samples:
        raise ValueError("no timing samples")
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    q1, q2, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, q2, q3


def costs_from_samples(parts: dict[str, list[float]], step: list[float]) -> dict[str, Any]:
    """Step costs from per-repeat timings: each part's and the target step's median (the figures the
    prediction uses), round_s = the parts' medians summed, and `quartiles_s`, the lower and upper quartile
    of round_s (the parts' quartiles summed) and of target_step_s: the spread the prediction carries."""
    q = {k: quartiles(v) for k, v in parts.items()}
    t = quartiles(step)
    return {
        **{k: v[1] for k, v in q.items()},
        "round_s": sum(v[1] for v in q.values()),
        "target_step_s": t[1],
        "quartiles_s": {
            "round_s": [sum(v[0] for v in q.values()), sum(v[2] for v in q.values())],
            "target_step_s": [t[0], t[2]],
        },
        "repeats": min(len(step), *(len(v) for v in parts.values())),
    }


def timing_spread(costs: dict[str, Any]) -> float | None:
    """The relative width, (high - low) / value, of the speed-up these costs predict for any tau (tau cancels):
    high = upper-quartile target step / lower-quartile round, low the other way round. None without quartiles."""
    qs = costs.get("quartiles_s")
    if not qs:
        return None
    (r_lo, r_hi), (t_lo, t_hi) = qs["round_s"], qs["target_step_s"]
    if min(r_lo, costs["round_s"], costs["target_step_s"]) <= 0:
        return float("inf")
    return (t_hi / r_lo - t_lo / r_hi) / (costs["target_step_s"] / costs["round_s"])


def settle_timings(
    measure, *, min_repeats: int, max_repeats: int, max_seconds: float, clock=time.perf_counter
) -> tuple[dict[str, list[float]], list[float]]:
    """Call measure() (-> ({part: seconds}, target step seconds), one repeat) at least `min_repeats` times
    and then until the prediction's spread (timing_spread) is half PREDICTION_MAX_SPREAD, `max_repeats` or
    `max_seconds` is reached: a quiet device stops early, a busy one gets more samples before the verdict."""
    parts: dict[str, list[float]] = {}
    step: list[float] = []
    t0 = clock()
    while True:
        got, s = measure()
        for k, v in got.items():
            parts.setdefault(k, []).append(v)
        step.append(s)
        n = len(step)
        if n >= max_repeats or (
            n >= min_repeats
            and (
                clock() - t0 >= max_seconds
                or timing_spread(costs_from_samples(parts, step)) <= PREDICTION_MAX_SPREAD / 2
            )
        ):
            return parts, step


@torch.no_grad()
def measure_step_costs(
    target,
    drafter: FunctionalDrafter,
    *,
    tree: TreeConfig,
    layer_ids: list[int],
    context: int = 512,
    repeats: int | None = None,
    seed: int = 0,
    max_seconds: float = 30.0,
) -> dict[str, Any]:
    """This (plain) engine's seconds per call, after a prefill of `context` random tokens, of: one draft
    round (the tree or chain from the root), the drafter's step-0 update for one accepted token + bonus,
    the verify forward of the root + `tree.tokens` drafted tokens (round_s = the three), and a
    target-only decode step (1 token). The host-side walk and cache compaction are left out.

    Each repeat times every part once, in turn, so a change of load touches the round and the target step
    alike; repeats go on until their spread settles (settle_timings: at least `repeats`, at most 8x that or
    `max_seconds`). The figures are medians; `quartiles_s` gives their spread.

    Token values do not change the arithmetic, so random ids measure the same costs as real text.
    The static engine's counterpart: speculative_static.measure_static_step_costs.
    """
    from eyas.specdec.generate import context_length

    context = max(2, min(context, context_length(target) - tree.tokens - 4))
    dec = SpeculativeDecoder(
        target, drafter, tree=tree, layer_ids=layer_ids, max_len=context + tree.tokens + 4, eos_ids=set()
    )
    tgt, prop, dev = dec.target, dec.proposer, dec.device
    g = torch.Generator().manual_seed(seed)
    vocab = int(target.get_input_embeddings().weight.shape[0])
    prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
    _, aux = tgt.forward(torch.tensor(prompt, device=dev), torch.arange(context, device=dev), None)
    prop.extend(torch.tensor(prompt[1:] + [prompt[0]], device=dev), aux)
    c = context + 1
    rows, t = torch.zeros(1, dtype=torch.long, device=dev), torch.tensor([c - 2], device=dev)
    repeats = repeats or (20 if dev.type == "cuda" else 5)  # CPU: a 60-token verify of a real target is ~0.5 s
    warmup = 2 if dev.type == "cuda" else 1

    def timed(fn) -> float:
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        return time.perf_counter() - t0

    drafted = build_tree(prop, rows, t, tree)
    tok, par, depth = _submitted(drafted)
    start = tgt.length
    ids_v = torch.tensor([prompt[0]] + tok, device=dev)
    pos_v = torch.tensor([c - 1] + [c - 1 + dd for dd in depth], device=dev)
    mask_v = _tree_mask(par, start, dev)
    ids_1, pos_1 = ids_v[:1], pos_v[:1]

    def verify():
        tgt.forward(ids_v, pos_v, mask_v)
        tgt.length = start

    def plain():
        tgt.forward(ids_1, pos_1, None)
        tgt.length = start

    n0 = prop.length

    def update():
        prop.extend(ids_v[:2], aux[:2])
        prop.length = n0

    calls = {"draft_s": lambda: build_tree(prop, rows, t, tree), "drafter_update_s": update, "verify_s": verify}

    def once():
        return {k: timed(fn) for k, fn in calls.items()}, timed(plain)

    for _ in range(warmup):
        once()
    parts, step = settle_timings(once, min_repeats=repeats, max_repeats=8 * repeats, max_seconds=max_seconds)
    return {"engine": "plain", "context": context, **costs_from_samples(parts, step)}


def predicted_speedup(tau: float | None, costs: dict[str, Any]) -> float | None:
    """tau tokens per round at round_s seconds, against one token per target step: tau * target_step_s
    / round_s, both from one engine (costs["engine"]). The plain engine's round leaves its host-side
    walk and compaction out, so its loop's measured speed-up falls below this where per-round overhead
    is large; the static engine's round is every step of its loop. Unchecked: see judge_prediction."""
    if tau is None:
        return None
    return tau * costs["target_step_s"] / costs["round_s"]


def judge_prediction(
    tau: float | None, costs: dict[str, Any], *, max_spread: float = PREDICTION_MAX_SPREAD
) -> dict[str, Any]:
    """The speed-up these costs predict, only where it can be stood behind: {"predicted_speedup_bs1": value or
    None, "predicted_speedup_bs1_range": [low, high] (from the timings' quartiles) or None, "withheld": why
    or None}. Withheld when (a) the range is wider than `max_spread` of the value (the timings measured load)
    or (b) the value exceeds tau: a round drafts, then verifies more tokens than a target step computes, so
    it cannot cost less than one; a prediction above tau says the timings are wrong, not that decoding is fast."""
    if tau is None:
        return {
            "predicted_speedup_bs1": None,
            "predicted_speedup_bs1_range": None,
            "withheld": "no drafting rounds, so no tau to predict from",
        }
    value = predicted_speedup(tau, costs)
    qs = costs.get("quartiles_s")
    rng = None
    if qs:
        (r_lo, r_hi), (t_lo, t_hi) = qs["round_s"], qs["target_step_s"]
        rng = [tau * t_lo / r_hi, tau * t_hi / r_lo] if r_lo > 0 else [0.0, float("inf")]
    spread = timing_spread(costs)
    why = None
    if value > tau:
        why = (
            f"the predicted {value:.2f}x exceeds tau {tau:.2f}: a round measured {costs['round_s']:.3g} s against "
            f"{costs['target_step_s']:.3g} s for one target step, which it cannot undercut; the timings are noise "
            "(a busy device?)"
        )
    elif spread is not None and spread > max_spread:
        why = (
            f"the step timings did not settle in {costs.get('repeats')} repeats: the predicted {value:.2f}x "
            f"lies anywhere in {rng[0]:.2f}x-{rng[1]:.2f}x (wider than {max_spread:.0%} of it); rerun on an idle device"
        )
    if why is not None:
        return {"predicted_speedup_bs1": None, "predicted_speedup_bs1_range": None, "withheld": why}
    return {"predicted_speedup_bs1": value, "predicted_speedup_bs1_range": rng, "withheld": None}


def prediction_engine(device: torch.device) -> str:
    """The batch-1 engine the prediction describes on `device`: `static` on CUDA, where it is the fast
    one (`eyas generate --engine static`: CUDA-graph steps, one host read a round, against the plain engine's
    eager launches), `plain` elsewhere: off CUDA the static engine runs the same kernels eagerly with attention
    over its whole preallocated cache, so it is the slower one there. The same rule picks
    `eyas generate --engine auto`'s engine (generate_run.resolve_engine)."""
    return "static" if torch.device(device).type == "cuda" else "plain"


def predict_for_modes(
    target,
    drafter: FunctionalDrafter,
    modes: dict[str, TreeConfig],
    taus: dict[str, float | None],
    *,
    layer_ids: list[int],
    context: int,
    engine: str | None = None,
) -> dict[str, dict[str, Any]]:
    """`eyas eval`'s predicted batch-1 speed-up per mode, from step costs measured on its device with
    `engine` (default: prediction_engine(the drafter's device)); step_costs_s["engine"] names the one
    measured.

    The prediction is judged (judge_prediction): one its timings cannot stand behind is withheld, with
    the reason in "withheld".

    A target neither engine can run (not Llama/Qwen-shaped: both run it through StaticLM's modules)
    gets {"skipped": why}, never an error: the prediction is an extra, the acceptance figures stand
    without it. For the same reason a static measurement that fails falls back to the plain engine's
    (step_costs_s["engine"] says "plain", `static_error` why).
    """
    from eyas.common import log
    from eyas.regen.static_lm import unsupported_reason
    from eyas.specdec.speculative_static import measure_static_step_costs  # imports this module: not at the top

    engine = engine or prediction_engine(drafter.device)
    if engine not in ("plain", "static"):
        raise ValueError(f"engine must be plain or static, got {engine!r}")
    why = unsupported_reason(target, context + 64)
    out: dict[str, dict[str, Any]] = {}
    for name, tree in modes.items():
        if why is not None:
            out[name] = {"skipped": why}
            continue
        kw = dict(tree=tree, layer_ids=layer_ids, context=context)
        fell_back = None
        if engine == "static":
            try:
                costs = measure_static_step_costs(target, drafter, **kw)
            except Exception as exc:  # noqa: BLE001  (a prediction from the other engine, named, beats none)
                fell_back = f"{type(exc).__name__}: {str(exc)[:300]}"
                log(f"eval: {name}: static-engine step costs failed ({fell_back}); predicting from the plain engine")
        if engine == "plain" or fell_back:
            costs = measure_step_costs(target, drafter, **kw)
        out[name] = {"step_costs_s": costs, **judge_prediction(taus.get(name), costs)}
        if out[name]["withheld"] and taus.get(name) is not None:
            log(f"eval: {name}: predicted speed-up withheld: {out[name]['withheld']}")
        if fell_back:
            out[name]["static_error"] = fell_back
    return out
