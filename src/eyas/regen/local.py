"""In-process regeneration engines for a transformers target.

`StaticEngine` (the fast path): a fixed batch of B rows over `StaticLM`'s static KV cache. Each
loop iteration (1) refills finished rows with new prompts (packed without padding), (2) runs
`sync_every` decode steps, each one CUDA-graph replay on GPU (eager on CPU), with all per-row
bookkeeping (position, token count, stop test, output buffer) done on the device, and (3) reads
back one small tensor to learn which rows finished. Continuous refill keeps the batch full across
turns: an answer read back is delivered while the next chunk runs, the driver queues that
conversation's next turn at once, and it enters the batch at the next refill. Decode attention
reads each row's own keys (per-row lengths, one graph for all of them); where the Triton kernel is
unavailable it falls back to SDPA over a span bucket covering every row (one graph per bucket).
Host work (detokenising answers, the driver's next turns, rendering prompts) runs while a decode
chunk is in flight instead of with the device idle.
`stats()` reports occupancy, attention efficiency and the prefill/decode/host time split.

`GenerateEngine` (fallback and reference): static batches through Hugging Face `generate`, for
architectures `StaticLM` does not support, and the baseline the benchmark and tests compare with.

Both render prompts with the target's chat template (`add_generation_prompt=True`) and count a
prompt that leaves no room for an answer within `max_len` as a context overflow.

Shape legend: B batch rows, N rows being prefilled, T packed prompt tokens, C output columns, V vocab.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from eyas.common import log
from eyas.regen.attention import BLOCK_N
from eyas.regen.requests import CONTEXT_OVERFLOW, Deliver, Pull, Request, Result
from eyas.regen.sampling import Sampling, choose, vocab_keys
from eyas.regen.static_lm import StaticLM, unsupported_reason


def stop_ids(model, tokenizer) -> list[int]:
    """End-of-answer ids: the generation config's eos ids (what `generate` stops on) plus the tokenizer's."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError("the target defines no end-of-sequence token (generation_config / tokenizer eos_token_id)")
    return sorted(ids)


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` + the assistant header, with the target's own chat template."""
    text = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class _Prepared:
    req: Request
    ids: list[int]
    limit: int


class _LocalBase:
    def __init__(self, model, tokenizer, *, sampling: Sampling, max_len: int, stop: list[int] | None = None):
        """`stop`: the end-of-answer ids, where the caller knows them (else the model's and tokenizer's); an engine
        given no tokenizer answers only prompts already rendered (StaticEngine.answer_ids)."""
        self.model, self.tokenizer, self.sampling, self.max_len = model, tokenizer, sampling, max_len
        self.stop = sorted(stop) if stop is not None else stop_ids(model, tokenizer)
        self.device = next(model.parameters()).device
        self.new_tokens = 0
        self.requests = 0
        self.pending: list[_Prepared] = []

    def _admit(self, reqs: list[Request], deliver: Deliver, *, front: bool = False) -> None:
        """Render each request; overflowing prompts are answered at once as failures. `front`:
        queue them ahead of the requests already pending (next turns of running conversations)."""
        ready: list[_Prepared] = []
        for req in reqs:
            ids = render_prompt(self.tokenizer, req.messages)
            room = self.max_len - len(ids)
            if room < 1:
                deliver(
                    Result(
                        req.key,
                        prompt_tokens=len(ids),
                        failure=CONTEXT_OVERFLOW,
                        detail=f"prompt of {len(ids)} tokens leaves no room within max_len {self.max_len}",
                    )
                )
                continue
            ready.append(_Prepared(req, ids, min(req.max_new_tokens, room)))
        self.pending = ready + self.pending if front else self.pending + ready

    def _result(self, p: _Prepared, tokens: list[int]) -> Result:
        ended = bool(tokens) and tokens[-1] in self.stop
        body = tokens[:-1] if ended else tokens
        self.new_tokens += len(tokens)
        self.requests += 1
        text = self.tokenizer.decode(body, skip_special_tokens=True) if self.tokenizer is not None else ""
        return Result(
            p.req.key,
            text=text,
            prompt_tokens=len(p.ids),
            new_tokens=len(tokens),
            truncated=not ended,
            token_ids=body,
            end_id=tokens[-1] if ended else None,
        )


class StaticEngine(_LocalBase):
    """Batched decode over a static KV cache with continuous refill; CUDA graphs on GPU."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        sampling: Sampling,
        max_len: int,
        batch: int,
        max_new_tokens: int,
        use_graphs: bool | None = None,
        sync_every: int | None = None,
        prefill_tokens: int | None = None,
        refill_min: int | None = None,
        min_span: int = 256,
        prefetch: int | None = None,
        attention: str = "auto",
        prefill: str = "auto",
        stop: list[int] | None = None,
    ):
        super().__init__(model, tokenizer, sampling=sampling, max_len=max_len, stop=stop)
        on_cuda = self.device.type == "cuda"
        # The cache length is rounded up to a multiple of 64 so every attention span keeps the key
        # axis aligned for the fused kernels; answers still end within max_len (see _admit).
        self.lm = StaticLM(model, batch=batch, max_len=-(-max_len // 64) * 64, attention=attention, prefill=prefill)
        self.batch = batch
        self.use_graphs = on_cuda if use_graphs is None else use_graphs
        self.sync_every = sync_every or (8 if on_cuda else 1)
        # Packed prompt tokens per prefill call (no padding): bounds the activations of one call.
        self.prefill_tokens = prefill_tokens or (65536 if on_cuda else 2048)
        # On GPU, refill once an eighth of the rows are free: a prefill is an eager forward, so
        # refilling row by row would cost more than the decode steps those rows sit idle.
        self.refill_min = refill_min or (max(1, batch // 8) if on_cuda else 1)
        # Requests rendered ahead (while the device decodes), so a refill never waits on the tokenizer:
        # a whole batch, because answers cut at the limit finish together (a batch started at once
        # frees at once).
        self.prefetch = prefetch if prefetch is not None else batch
        self.cols = max_new_tokens + 1  # last column is where finished rows write (discarded)
        dev = self.device
        self.vkeys_V = vocab_keys(self.lm.lm_head.out_features, dev)
        self.stop_E = torch.tensor(self.stop, dtype=torch.long, device=dev)
        self.tok_B = torch.zeros(batch, dtype=torch.long, device=dev)
        self.pos_B = torch.zeros(batch, dtype=torch.long, device=dev)
        self.seed_B = torch.zeros(batch, dtype=torch.long, device=dev)
        self.ngen_B = torch.zeros(batch, dtype=torch.long, device=dev)
        self.limit_B = torch.ones(batch, dtype=torch.long, device=dev)
        self.done_B = torch.ones(batch, dtype=torch.bool, device=dev)  # every row starts free
        self.out_BC = torch.zeros(batch, self.cols, dtype=torch.long, device=dev)
        # Per-row attention (triton): one graph, every row reads its own keys. SDPA: one graph per
        # span bucket (powers of two from min_span up to the cache), the smallest covering all rows.
        self.per_row = self.lm.attention == "triton"
        self.spans = [self.lm.max_len] if self.per_row else self._spans(self.lm.max_len, min_span)
        self.graphs: dict[int, Any] = {}
        self.steps = 0
        self.span_steps: dict[int, int] = {}  # decode steps run per span
        self.capture_s = 0.0
        self._ngen = [1] * batch
        # Occupancy counters, accumulated on the device inside the step (no extra syncs): active
        # rows per step, keys those rows need (pos + 1), and keys attention reads (per-row lengths
        # rounded up to the kernel's tile, or rows x span).
        self.active_rows_1 = torch.zeros(1, dtype=torch.long, device=dev)
        self.needed_keys_1 = torch.zeros(1, dtype=torch.long, device=dev)
        self.read_keys_1 = torch.zeros(1, dtype=torch.long, device=dev)
        self.attended_keys = 0
        self.prefill_calls = self.prefill_rows = self.prefill_tokens_seen = 0
        self.decode_tokens = 0  # tokens produced by decode steps (a prefill produces each answer's first)
        self.time_s = {"prefill": 0.0, "decode": 0.0, "host": 0.0, "host_overlapped": 0.0}
        self.capture_error: str | None = None
        if self.use_graphs:
            try:
                self._capture_all()
            except Exception as exc:  # keep going eagerly: slower, still correct, and reported
                self.graphs.clear()
                self.use_graphs = False
                self.capture_error = f"{type(exc).__name__}: {exc}"
                log(f"regen: CUDA graph capture failed ({self.capture_error}); decoding eagerly")

    @staticmethod
    def _spans(max_len: int, min_span: int) -> list[int]:
        spans, s = [], min_span
        while s < max_len:
            spans.append(s)
            s *= 2
        return spans + [max_len]

    # -- one decode step, all on the device ------------------------------------------------------
    def _step(self, span: int) -> None:
        active_B = ~self.done_B
        # A free row reads one key (its slot's first; the result is discarded), not its old length.
        len_B = torch.where(active_B, self.pos_B + 1, 1)
        logits_BV = self.lm.decode(self.tok_B, self.pos_B, len_B, span=span)
        nxt_B = choose(logits_BV, sampling=self.sampling, seed_B=self.seed_B, pos_B=self.pos_B, vkeys_V=self.vkeys_V)
        self.active_rows_1.add_(active_B.sum())
        self.needed_keys_1.add_(((self.pos_B + 1) * active_B).sum())
        if self.per_row:
            self.read_keys_1.add_(((len_B + BLOCK_N - 1) // BLOCK_N * BLOCK_N).sum())
        col_B = torch.where(active_B, self.ngen_B, self.cols - 1)
        self.out_BC.scatter_(1, col_B[:, None], nxt_B[:, None])
        self.ngen_B.add_(active_B.long())
        stop_B = (nxt_B[:, None] == self.stop_E[None, :]).any(-1) | (self.ngen_B >= self.limit_B)
        self.done_B.logical_or_(active_B & stop_B)
        self.pos_B.add_((~self.done_B).long())
        self.tok_B.copy_(torch.where(active_B, nxt_B, self.tok_B))

    @torch.no_grad()
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (every row is free: writes go to discarded slots)
            for span in self.spans:
                self._step(span)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for span in sorted(self.spans, reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._step(span)
            self.graphs[span] = graph
        torch.cuda.synchronize()
        for c in (self.active_rows_1, self.needed_keys_1, self.read_keys_1):  # the warm-up steps are not work
            c.zero_()
        self.capture_s = time.perf_counter() - t0
        log(
            f"regen: captured {len(self.graphs)} decode graph(s) ({self.lm.attention} attention, spans {self.spans}) "
            f"in {self.capture_s:.1f} s"
        )

    # -- refill ----------------------------------------------------------------------------------
    def _prefill(self, rows: list[int], items: list[_Prepared], deliver: Deliver, host: dict) -> None:
        """Prefill `items` into `rows`, packed without padding, in calls of at most prefill_tokens."""
        start = 0
        while start < len(items):
            end, tokens = start + 1, len(items[start].ids)
            while end < len(items) and tokens + len(items[end].ids) <= self.prefill_tokens:
                tokens += len(items[end].ids)
                end += 1
            self._prefill_group(rows[start:end], items[start:end], host)
            start = end

    def _prefill_group(self, rows: list[int], items: list[_Prepared], host: dict) -> None:
        dev = self.device
        lens = [len(p.ids) for p in items]
        self.prefill_calls += 1
        self.prefill_rows += len(items)
        self.prefill_tokens_seen += sum(lens)
        ids_T = torch.tensor([t for p in items for t in p.ids], dtype=torch.long).to(dev, non_blocking=True)
        meta = torch.tensor([lens, rows, [p.req.seed for p in items], [p.limit for p in items]], dtype=torch.long).to(
            dev, non_blocking=True
        )
        lens_N, rows_N, seed_N, limit_N = meta
        logits_NV = self.lm.prefill(rows, ids_T, lens)
        first_N = choose(logits_NV, sampling=self.sampling, seed_B=seed_N, pos_B=lens_N - 1, vkeys_V=self.vkeys_V)
        done_N = (first_N[:, None] == self.stop_E[None, :]).any(-1) | (limit_N <= 1)
        self.tok_B[rows_N] = first_N
        self.pos_B[rows_N] = lens_N
        self.seed_B[rows_N] = seed_N
        self.limit_B[rows_N] = limit_N
        self.ngen_B[rows_N] = 1
        self.out_BC[rows_N, 0] = first_N
        self.done_B[rows_N] = done_N
        # No read-back here: a row answered by its first token is already done on the device and
        # is collected at the next read-back like any other finished row.
        for row, p in zip(rows, items):
            host[row] = p
            self._ngen[row] = 1

    # -- the loop --------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, pull: Pull, deliver: Deliver) -> None:
        """Refill -> launch sync_every steps -> (host work while they run) -> read back.

        Host work (delivering answers, which makes the driver queue next turns, and rendering
        prompts ahead) runs while the device decodes; on GPU it is hidden behind the chunk. An
        answer read back is delivered during the next chunk, and its next turn is rendered then:
        it joins the batch at the next refill, as any new conversation."""
        host: dict[int, _Prepared] = {}  # row -> request decoding there
        finished: list[tuple[_Prepared, list[int]]] = []  # read back, not yet delivered
        clock, t = time.perf_counter, self.time_s

        def deliver_finished() -> None:
            """Deliver the answers read back, then pull at once what they made ready (each answer
            has at most one next turn; the driver hands out next turns before new conversations)
            and queue it first, so a conversation's next turn takes the next free row."""
            batch, finished[:] = list(finished), []
            for p, toks in batch:
                deliver(self._result(p, toks))
            if batch:
                self._admit(pull(len(batch)), deliver, front=True)

        while True:
            free = [r for r in range(self.batch) if r not in host]
            if free and (len(free) >= self.refill_min or not host):
                t0 = clock()
                if len(self.pending) < len(free):  # the prefetch fell short: render now, device idle
                    deliver_finished()
                    self._admit(pull(len(free) - len(self.pending)), deliver)
                take, self.pending = self.pending[: len(free)], self.pending[len(free) :]
                t1 = clock()
                t["host"] += t1 - t0
                if take:
                    self._prefill(free[: len(take)], take, deliver, host)
                t["prefill"] += clock() - t1
            if not host:
                t0 = clock()
                deliver_finished()
                if not self.pending:
                    more = pull(self.batch)  # deliveries may have produced next turns
                    if not more:
                        t["host"] += clock() - t0
                        return
                    self._admit(more, deliver)
                t["host"] += clock() - t0
                continue
            t0 = clock()
            span = self._span_for(host)
            for _ in range(self.sync_every):
                if self.use_graphs:
                    self.graphs[span].replay()
                else:
                    self._step(span)
            self.steps += self.sync_every
            self.span_steps[span] = self.span_steps.get(span, 0) + self.sync_every
            if not self.per_row:
                self.attended_keys += self.sync_every * self.batch * span
            t1 = clock()
            deliver_finished()
            if len(self.pending) < self.prefetch:
                self._admit(pull(self.prefetch - len(self.pending)), deliver)
            t2 = clock()
            state = torch.stack([self.done_B.long(), self.ngen_B]).cpu()
            done, ngen = state[0].tolist(), state[1].tolist()
            self.decode_tokens += sum(ngen[r] - self._ngen[r] for r in host)
            self._ngen = ngen
            rows = [r for r in host if done[r]]
            if rows:
                out = self.out_BC[torch.tensor(rows, device=self.device)].cpu().tolist()
                finished.extend((host.pop(r), row_out[: ngen[r]]) for r, row_out in zip(rows, out))
            t["decode"] += (t1 - t0) + (clock() - t2)
            t["host_overlapped"] += t2 - t1

    def answer_ids(self, prompts: list[list[int]], limit: int, *, answered: Deliver | None = None) -> list[list[int]]:
        """Answers to prompts already rendered (ids), in input order, each ending with its end-of-answer id where
        one ended it; at most `limit` tokens, which must fit within max_len after every prompt. `answered` sees
        each Result as it comes back (progress)."""
        if any(len(ids) + limit > self.max_len for ids in prompts):
            raise ValueError(
                f"a prompt of {max(map(len, prompts))} tokens + {limit} new exceeds max_len {self.max_len}"
            )
        out: list[list[int] | None] = [None] * len(prompts)

        def deliver(res: Result) -> None:
            out[res.key[0]] = res.token_ids + ([res.end_id] if res.end_id is not None else [])
            if answered is not None:
                answered(res)

        self.pending = [
            _Prepared(Request(key=(i, 0), messages=[], max_new_tokens=limit, seed=0), list(ids), limit)
            for i, ids in enumerate(prompts)
        ]
        self.run(lambda n: [], deliver)
        if any(x is None for x in out):
            raise RuntimeError("the static engine returned fewer answers than it was given prompts")
        return out  # type: ignore[return-value]

    def _span_for(self, host: dict[int, _Prepared]) -> int:
        """The smallest captured span covering every active row for the next sync_every steps (SDPA
        attention; per-row attention has one span, the whole cache, and reads each row's own keys).

        After ngen generated tokens a row feeds position len(prompt) + ngen - 1; it never passes
        len(prompt) + limit - 1 (< max_len). ngen is as of the last read-back (1 right after prefill),
        so the bound holds without a sync."""
        if self.per_row:
            return self.spans[0]
        need = max(
            min(len(p.ids) + max(self._ngen[r], 1) - 1 + self.sync_every, len(p.ids) + p.limit) for r, p in host.items()
        )
        return next((s for s in self.spans if s >= need), self.spans[-1])

    def stats(self) -> dict[str, Any]:
        """How full the batch was and where the time went (the summary's `engine_stats`).

        occupancy: active rows / batch, averaged over decode steps. attention_efficiency: keys the
        active rows need (position + 1) / keys attention read (per-row lengths rounded up to the
        kernel's tile, or rows x span with SDPA). host_s: host work with the device idle;
        host_overlapped_s: host work while a decode chunk runs (hidden on GPU; on CPU decode is
        synchronous, so it is not). prefill_tok_s: prompt tokens per prefill second;
        decode_tok_s: generated tokens per decode second (decode_s includes the read-backs)."""
        slots = self.steps * self.batch
        t = self.time_s
        read = int(self.read_keys_1.item()) if self.per_row else self.attended_keys
        return {
            "batch": self.batch,
            "decode_attention": self.lm.attention,
            "prefill_attention": self.lm.prefill_kind,
            "decode_steps": self.steps,
            "occupancy": round(int(self.active_rows_1.item()) / slots, 4) if slots else None,
            "attention_efficiency": round(int(self.needed_keys_1.item()) / read, 4) if read else None,
            "span_steps": {str(k): v for k, v in sorted(self.span_steps.items())},
            "requests": self.requests,
            "new_tokens": self.new_tokens,
            "decode_tokens": self.decode_tokens,
            "prefill_calls": self.prefill_calls,
            "prefill_rows": self.prefill_rows,
            "prefill_tokens": self.prefill_tokens_seen,
            "prefill_padding": 0.0 if self.prefill_calls else None,
            **{f"{k}_s": round(v, 3) for k, v in t.items()},
            "prefill_tok_s": round(self.prefill_tokens_seen / t["prefill"], 1) if t["prefill"] > 0 else None,
            "decode_tok_s": round(self.decode_tokens / t["decode"], 1) if t["decode"] > 0 else None,
            "decode_ms_per_step": round(1e3 * t["decode"] / self.steps, 3) if self.steps else None,
            "host_us_per_token": round(1e6 * t["host"] / self.new_tokens, 2) if self.new_tokens else None,
            "host_overlapped_us_per_token": round(1e6 * t["host_overlapped"] / self.new_tokens, 2)
            if self.new_tokens
            else None,
        }

    def describe(self) -> dict[str, Any]:
        return {
            "engine": "static",
            "cuda_graphs": self.use_graphs,
            "sync_every": self.sync_every,
            "graph_capture_s": round(self.capture_s, 2),
            "capture_error": self.capture_error,
            "spans": self.spans,
            **self.lm.describe(),
        }


class GenerateEngine(_LocalBase):
    """Static batches (sorted by prompt length, left-padded) through Hugging Face `generate`."""

    def __init__(self, model, tokenizer, *, sampling: Sampling, max_len: int, batch: int):
        super().__init__(model, tokenizer, sampling=sampling, max_len=max_len)
        self.batch = batch
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop[0]

    @torch.no_grad()
    def generate_batch(self, items: list[_Prepared]) -> list[list[int]]:
        """Generated ids per item (including the stop token when one was produced)."""
        L = max(len(p.ids) for p in items)
        ids = torch.full((len(items), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), L), dtype=torch.long)
        for n, p in enumerate(items):
            ids[n, L - len(p.ids) :] = torch.tensor(p.ids)
            mask[n, L - len(p.ids) :] = 1
        kwargs: dict[str, Any] = dict(do_sample=False)
        if not self.sampling.greedy:
            kwargs = dict(do_sample=True, temperature=self.sampling.temperature, top_p=self.sampling.top_p, top_k=0)
            torch.manual_seed(items[0].req.seed)
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            max_new_tokens=max(p.limit for p in items),
            eos_token_id=self.stop,
            pad_token_id=self.pad_id,
            **kwargs,
        )[:, L:].tolist()
        results = []
        for p, row in zip(items, out):
            row = row[: p.limit]
            for j, t in enumerate(row):
                if t in self.stop:
                    row = row[: j + 1]
                    break
            results.append(row)
        return results

    def run(self, pull: Pull, deliver: Deliver) -> None:
        while True:
            if len(self.pending) < self.batch:
                self._admit(pull(self.batch - len(self.pending)), deliver)
            if not self.pending:
                more = pull(self.batch)
                if not more:
                    return
                self._admit(more, deliver)
                continue
            self.pending.sort(key=lambda p: len(p.ids))
            take, self.pending = self.pending[: self.batch], self.pending[self.batch :]
            for p, toks in zip(take, self.generate_batch(take)):
                deliver(self._result(p, toks))

    def describe(self) -> dict[str, Any]:
        return {"engine": "generate", "batch": self.batch, "max_len": self.max_len}


@torch.no_grad()
def reference_generate(
    model, ids: list[int], *, sampling: Sampling, seed: int, limit: int, stop: list[int]
) -> list[int]:
    """The slow reference: one sequence, no cache, the full forward of Hugging Face at every step,
    the same token choice. StaticEngine must produce exactly these ids (tests)."""
    device = next(model.parameters()).device
    vkeys = vocab_keys(model.get_output_embeddings().out_features, device)
    seq, out = list(ids), []
    while len(out) < limit:
        logits = model(input_ids=torch.tensor([seq], device=device), use_cache=False).logits[:, -1].float()
        pos = torch.tensor([len(seq) - 1], device=device)
        tok = int(
            choose(logits, sampling=sampling, seed_B=torch.tensor([seed], device=device), pos_B=pos, vkeys_V=vkeys)[0]
        )
        out.append(tok)
        seq.append(tok)
        if tok in stop:
            break
    return out


def make_local_engine(
    model,
    tokenizer,
    *,
    sampling: Sampling,
    max_len: int,
    batch: int,
    max_new_tokens: int,
    engine: str = "auto",
    **static_kwargs,
):
    """`engine`: 'static' (error if unsupported), 'generate', or 'auto' (static when supported)."""
    if engine not in ("auto", "static", "generate"):
        raise ValueError(f"--engine must be auto, static, generate or server, got {engine!r}")
    reason = unsupported_reason(model, max_len)
    if engine == "generate" or (engine == "auto" and reason is not None):
        if engine == "auto":
            log(f"regen: the static-cache engine does not support this target ({reason}); using transformers generate")
        return GenerateEngine(model, tokenizer, sampling=sampling, max_len=max_len, batch=batch)
    if reason is not None:
        raise ValueError(f"--engine static: {reason}; use --engine generate")
    return StaticEngine(
        model,
        tokenizer,
        sampling=sampling,
        max_len=max_len,
        batch=batch,
        max_new_tokens=max_new_tokens,
        **static_kwargs,
    )
