"""`eyas generate` end to end: speculative decoding with a trained drafter against target-only decoding.

Stages: (1) check the options and read the prompts (bad input exits 2 before any model loads);
(2) load the target and the drafter (any layout) and check they belong together; (3) per turn of
every conversation, decode the prompt with the drafter and then, in the same process and through the
same loop with no drafter, target-only (the baseline; turn n+1 follows the drafter run's own answer);
(4) tokens/s of both, the speed-up, tau, per-position acceptance and the time split.

Time split (`time_s`, summed over turns): prefill_s = the prompt's target forward + the drafter's
step-0 pass over it; draft_s = building the draft tree + the drafter's step-0 update with the accepted
tokens; verify_s = the target forward over the root and every drafted token (mask and copies
included); overhead_s = the accept walk and the target cache compaction. Target-only runs have only
prefill_s and verify_s (one token a round) plus a little overhead_s.

Key trade-off: batch 1, the latency setting speculative decoding is for, on one of two engines
(--engine): `plain` (specdec/speculative.py, the reference) or `static` (specdec/speculative_static.py:
fixed shapes, on-device accept walk, CUDA graphs on CUDA; the default on CUDA, plain elsewhere). With
--batch-size B > 1 every turn's prompts are decoded B at a time by specdec/speculative_batched.py (greedy
only; static shapes, CUDA graphs on CUDA; --engine does not apply), both with the drafter and
target-only; each batch's time is shared by its rows, tokens/s counts every row's tokens, and a record's
`seconds` is its batch's. The drafter run
and the target-only run use the same engine and share every overhead, so the speed-up is the drafter's,
not the loop's. The static and batched engines' draft_s also holds the target cache compaction (it
runs in the same device step as the drafter's update). At temperature 0 the two runs must produce the
same tokens: a mismatch is reported (`greedy_mismatches`) and, in float32, fails the command (exit 1);
in bf16/fp16 a verify forward over many tokens rounds differently from a 1-token step, so a near-tie may
flip and it is only reported.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eyas.common import log, progress, warn_gpu_sized
from eyas.dtypes import MODEL_DTYPES, resolve_device_dtype, to_dtype
from eyas.errors import CheckFailed, EyasError
from eyas.specdec.replay import TreeConfig

SCHEMA = "eyas.generate/1"


@dataclass(kw_only=True)
class GenerateConfig:
    """Settings of one `eyas generate` run (the CLI's options)."""

    drafter: Path
    """Drafter directory: eyas, SGLang or vLLM/speculators layout."""
    target: str = "default"
    """Target model directory, or 'default' for the embedded SmolLM2-135M-Instruct."""
    prompts: str = "mtbench"
    """'mtbench' (80 questions, 2 turns) or a JSONL file of {"turns": [...]} / {"prompt": ...}."""
    max_new_tokens: int = 256
    """Tokens generated per turn (an EOS ends a turn earlier)."""
    mode: str = "tree"
    """'tree' (EAGLE-2 dynamic tree) or 'chain' (--chain-k tokens a round)."""
    chain_k: int = 7
    """Chain drafting: draft tokens per round."""
    tree_topk: int = 10
    """EAGLE-2 tree: children kept per node and nodes expanded per depth."""
    tree_depth: int = 6
    """EAGLE-2 tree: draft steps per round."""
    tree_tokens: int = 60
    """EAGLE-2 tree: draft tokens verified per round, root excluded."""
    temperature: float = 0.0
    """0 = greedy (output identical to the target's); > 0 = rejection sampling from the target's distribution."""
    seed: int = 0
    """Seed of the sampling generator (temperature > 0)."""
    baseline: bool = True
    """Also decode every prompt target-only, in the same loop, and report the speed-up."""
    warmup: int = 1
    """Prompts decoded once before timing starts (not counted)."""
    device: str = "auto"
    """'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1', ..."""
    model_dtype: str = "auto"
    """Dtype the target and drafter run in: 'auto' (bfloat16 on GPU, float32 on CPU), 'bfloat16', 'float16' or 'float32'."""
    limit: int | None = None
    """Decode only the first N conversations."""
    engine: str = "auto"
    """'plain' (the reference loop: dense masks, growing caches, the accept walk on the host) or 'static' (static shapes, the walk and the KV compaction on the device, CUDA graphs on CUDA; the same code eagerly on CPU, where it is slower than plain); 'auto': static on CUDA, plain elsewhere. Both produce the same tokens. Batch 1 only: --batch-size > 1 uses the batched engine."""
    batch_size: int = 1
    """Prompts decoded together (each turn's prompts in groups of this size; > 1: the batched engine, greedy only). Speculative and target-only decoding run at the same batch size."""
    allow_other_target: bool = False
    """Decode with an eyas drafter trained for another target (a deliberate transfer)."""

    def __post_init__(self):
        from eyas.config_checks import check_choice, check_device, check_number

        check_choice(self, "mode", ("tree", "chain"))
        check_choice(self, "engine", ("auto", "plain", "static"))
        check_number(self, "max_new_tokens", ge=1)
        check_number(self, "temperature", ge=0)
        check_number(self, "warmup", ge=0)
        check_number(self, "limit", ge=1, optional=True)
        check_number(self, "batch_size", ge=1)
        if self.batch_size > 1 and self.temperature > 0:
            raise EyasError(f"--temperature {self.temperature} needs --batch-size 1: batched decoding is greedy only")
        for name in ("chain_k", "tree_topk", "tree_depth", "tree_tokens"):
            check_number(self, name, ge=1)
        to_dtype(self.model_dtype, what="--model-dtype", allowed=MODEL_DTYPES, also=("auto",))
        check_device(self.device)
        try:
            self.tree()
        except ValueError as exc:
            raise EyasError(str(exc)) from None
        if self.prompts != "mtbench" and not Path(self.prompts).is_file():
            raise EyasError(f"--prompts {self.prompts}: not a file and not 'mtbench'")
        if not Path(self.drafter).is_dir():
            raise EyasError(
                f"--drafter {self.drafter} is not a directory (expected `eyas train`'s <out>/drafter or an "
                "`eyas export` directory)"
            )
        from eyas.common import check_safetensors_dir

        check_safetensors_dir(Path(self.drafter), what="--drafter")

    def tree(self) -> TreeConfig:
        if self.mode == "chain":
            return TreeConfig.chain(self.chain_k)
        return TreeConfig(topk=self.tree_topk, depth=self.tree_depth, tokens=self.tree_tokens)


def _turn_prompts(tokenizer, convs, answers: dict[tuple[int, int], str], turn: int):
    from eyas.specdec.generate import render

    out = []
    for i, c in enumerate(convs):
        if turn >= len(c.turns):
            continue
        msgs: list[dict[str, str]] = []
        for t in range(turn):
            msgs += [{"role": "user", "content": c.turns[t]}, {"role": "assistant", "content": answers[(i, t)]}]
        msgs.append({"role": "user", "content": c.turns[turn]})
        out.append((i, render(tokenizer, msgs)))
    return out


def resolve_engine(engine: str, device) -> str:
    """The batch-1 engine `--engine auto` means: static on CUDA (its CUDA graphs remove the per-token launch cost
    that dominates small targets), plain elsewhere (on a
    CPU the static engine attends over its whole preallocated cache every round and is the slower one)."""
    from eyas.specdec.speculative import prediction_engine  # eval's speed prediction follows the same rule

    return engine if engine != "auto" else prediction_engine(device)


def run_generate(cfg: GenerateConfig) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Decode everything; returns (summary, per-turn records). Writes nothing."""
    from eyas.defaults import resolve_target
    from eyas.specdec.generate import context_length, eos_ids_of, load_prompts
    from eyas.specdec.run import load_drafter_for
    from eyas.specdec.speculative import DecodeStats
    from eyas.specdec.speculative_static import MIN_CAPACITY
    from eyas.target import check_drafter_target, load_target, load_tokenizer, tokenizer_hash

    tree = cfg.tree()
    device, dtype = resolve_device_dtype(cfg.device, cfg.model_dtype, what_dtype="--model-dtype")
    engine = resolve_engine(cfg.engine, device)
    convs = load_prompts(cfg.prompts, limit=cfg.limit)  # a bad prompts file fails before any model loads
    from eyas.specdec.run import cpu_sized

    warn_gpu_sized(cfg, device, command="generate", shorter=cpu_sized(len(convs)))
    from eyas.drafter.reader import check_drafter_dir

    check_drafter_dir(cfg.drafter)  # and a drafter folder eval could not read
    t0 = time.perf_counter()
    target_path = resolve_target(cfg.target)
    tokenizer = load_tokenizer(target_path)
    check_drafter_target(cfg.drafter, target_path, tok_hash=tokenizer_hash(tokenizer), allow=cfg.allow_other_target)
    target = load_target(target_path, device=device, dtype=dtype)
    ckpt, drafter = load_drafter_for(target, Path(cfg.drafter), device=device, dtype=dtype)
    if tree.topk > ckpt.config.draft_vocab_size:
        raise EyasError(
            f"--tree-topk {tree.topk} exceeds the drafter's vocabulary of {ckpt.config.draft_vocab_size} tokens"
        )
    load_s = time.perf_counter() - t0
    eos = eos_ids_of(target, tokenizer)
    if not eos:
        raise EyasError("the target defines no eos_token_id; cannot tell where an answer ends")
    max_len = context_length(target)
    layer_ids = ckpt.config.aux_layer_ids
    capacity = 0
    spec = plain = None
    batched = cfg.batch_size > 1
    # the batched engine's rows: the batch size, or fewer when there are fewer conversations (the first
    # turn has the most prompts; an idle row costs as much as a live one)
    rows = min(cfg.batch_size, len(convs))

    def ensure(need: int):
        """(Re)build both decoders when a prompt needs longer caches than they hold (doubling, capped at
        the context): a 128K-context target must not get a 128K cache for 1K-token prompts."""
        nonlocal capacity, spec, plain
        if need <= capacity:
            return
        capacity = min(max_len, max(need, 2 * capacity, MIN_CAPACITY))
        # the static and batched engines preallocate (and, on CUDA, capture their graphs for) this
        # capacity: a rebuild costs a capture, hence the doubling
        spec = _decoder(cfg, target, drafter, tree, layer_ids, engine=engine, rows=rows, capacity=capacity, eos=eos)
        plain = (
            _decoder(cfg, target, None, None, [], engine=engine, rows=rows, capacity=capacity, eos=eos)
            if cfg.baseline
            else None
        )

    def decode(dec, group: list[list[int]], max_new: int):
        """-> (outputs, stats of the group, accepted counts per output); batch 1 goes through the batch-1 engines."""
        if batched:
            return dec.generate(group, max_new_tokens=max_new)
        out, st = dec.generate(group[0], max_new_tokens=max_new)
        return [out], st, [st.accepted_per_round]

    log(
        f"generate: drafter {cfg.drafter} ({ckpt.provenance.format}), {cfg.mode} {asdict(tree)}, "
        f"{len(convs)} conversations, temperature {cfg.temperature}, "
        + (f"batched engine, batch size {cfg.batch_size} ({rows} rows)" if batched else f"engine {engine}")
        + f", device {device} {str(dtype).replace('torch.', '')}"
    )

    room = max_len - cfg.max_new_tokens - tree.tokens - 1
    answers: dict[tuple[int, int], str] = {}
    spec_total, base_total = DecodeStats(), DecodeStats()
    records, mismatches, warm = [], 0, cfg.warmup
    n_turns = max(len(c.turns) for c in convs)
    bar = progress(sum(len(c.turns) for c in convs), "generate", "turn")
    batches = 0
    for turn in range(n_turns):
        prompts = _turn_prompts(tokenizer, convs, answers, turn)
        for i, ids in prompts:
            if len(ids) > room:
                raise EyasError(
                    f"prompt {convs[i].id} turn {turn + 1}: {len(ids)} prompt tokens + --max-new-tokens "
                    f"{cfg.max_new_tokens} + a round's {tree.tokens} draft tokens exceed the target's context "
                    f"of {max_len}; lower --max-new-tokens or drop the prompt"
                )
        for g in range(0, len(prompts), cfg.batch_size):
            group = prompts[g : g + cfg.batch_size]
            group_ids = [ids for _, ids in group]
            ensure(max(map(len, group_ids)) + cfg.max_new_tokens + tree.tokens + 1)
            while warm > 0:  # first calls pay one-time costs (allocator, kernels): keep them out of the timings
                decode(spec, group_ids, min(cfg.max_new_tokens, 16))
                if plain is not None:
                    decode(plain, group_ids, min(cfg.max_new_tokens, 16))
                warm -= 1
            outs, st, acc = decode(spec, group_ids, cfg.max_new_tokens)
            spec_total.add(st)
            batches += 1
            if plain is not None:
                bases, bst, _ = decode(plain, group_ids, cfg.max_new_tokens)
                base_total.add(bst)
            for r, (i, ids) in enumerate(group):
                out = outs[r]
                rec = {
                    "id": convs[i].id,
                    "turn": turn + 1,
                    "prompt_tokens": len(ids),
                    "generated_ids": out,
                    "accepted": acc[r],
                    "seconds": round(st.total_s, 4),
                }
                if plain is not None:
                    rec["baseline_seconds"] = round(bst.total_s, 4)
                    if cfg.temperature == 0 and bases[r] != out:
                        mismatches += 1
                        rec["baseline_generated_ids"] = bases[r]
                answers[(i, turn)] = tokenizer.decode(out, skip_special_tokens=True)
                rec["text"] = answers[(i, turn)]
                records.append(rec)
                bar.update(1)
    bar.close()

    summary = _summary(
        cfg,
        tree=tree,
        engine=engine,
        batched=batched,
        batches=batches,
        records=records,
        spec=spec,
        spec_total=spec_total,
        base_total=base_total,
        mismatches=mismatches,
        load_s=load_s,
        device=device,
        dtype=dtype,
    )
    return summary, records


def _decoder(
    cfg: GenerateConfig,
    target,
    drafter,
    tree: TreeConfig | None,
    layer_ids: list[int],
    *,
    engine: str,
    rows: int,
    capacity: int,
    eos,
):
    """A decoder of the run's engine with caches of `capacity` tokens: batched (`rows` rows) when --batch-size > 1,
    else the batch-1 `engine`; the drafter None decodes target-only."""
    from eyas.specdec.speculative import SpeculativeDecoder
    from eyas.specdec.speculative_batched import BatchedSpeculativeDecoder
    from eyas.specdec.speculative_static import StaticSpeculativeDecoder

    if cfg.batch_size > 1:
        return BatchedSpeculativeDecoder(
            target, drafter, tree=tree, layer_ids=layer_ids, max_len=capacity, eos_ids=eos, batch=rows
        )
    cls = StaticSpeculativeDecoder if engine == "static" else SpeculativeDecoder
    return cls(
        target,
        drafter,
        tree=tree,
        layer_ids=layer_ids,
        max_len=capacity,
        eos_ids=eos,
        temperature=cfg.temperature,
        seed=cfg.seed,
    )


def _summary(
    cfg: GenerateConfig,
    *,
    tree: TreeConfig,
    engine: str,
    batched: bool,
    batches: int,
    records: list[dict[str, Any]],
    spec,
    spec_total,
    base_total,
    mismatches: int,
    load_s: float,
    device,
    dtype,
) -> dict[str, Any]:
    """The run's summary from the decoders' summed stats (both runs' rates, tau, the speed-up), logged."""
    from eyas.specdec.speculative import stats_summary

    s = stats_summary(spec_total, depth=tree.depth, drafted_per_round=tree.tokens)
    summary: dict[str, Any] = {
        "schema": SCHEMA,
        "mode": cfg.mode,
        "engine": "batched" if batched else engine,
        "batch_size": cfg.batch_size,
        "batches": batches,
        "tree": asdict(tree),
        "temperature": cfg.temperature,
        "sequences": len(records),
        "prompt_tokens": spec_total.prompt_tokens,
        "generated_tokens": s["generated_tokens"],
        "tokens_per_s": s["tokens_per_s"],
        "acceptance_length": s["acceptance_length"],
        "per_position_acceptance": s["per_position_acceptance"],
        "accepted_per_drafted": s["accepted_per_drafted"],
        "rounds": s["rounds"],
        "time_s": s["time_s"],
        "load_s": round(load_s, 3),
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
    }
    if engine == "static" or batched:
        summary["cuda_graphs"] = spec.describe()["graphs"]  # [] on CPU, or where capture failed (graph_note says why)
        summary["graph_note"] = spec.describe()["graph_note"]
    if cfg.baseline:
        b = stats_summary(base_total, depth=None, drafted_per_round=None)
        summary["baseline_tokens_per_s"] = b["tokens_per_s"]
        summary["baseline_time_s"] = b["time_s"]
        summary["baseline_generated_tokens"] = b["generated_tokens"]
        summary["speedup"] = (
            (s["tokens_per_s"] / b["tokens_per_s"]) if s["tokens_per_s"] and b["tokens_per_s"] else None
        )
        if cfg.temperature == 0:
            summary["greedy_mismatches"] = mismatches
    tau = summary["acceptance_length"]
    log(
        f"generate: {summary['generated_tokens']} tokens, {summary['tokens_per_s'] or 0:.1f} tokens/s"
        + (
            f" vs {summary['baseline_tokens_per_s'] or 0:.1f} target-only (x{summary['speedup'] or 0:.2f})"
            if cfg.baseline
            else ""
        )
        + (f", tau {tau:.3f}" if tau is not None else ", no drafting rounds")
    )
    return summary


RECORD_KEYS = ("id", "turn", "generated_ids", "accepted")
"""Keys of every per-turn record `--out` holds: a file whose lines all carry them was written by eyas generate."""


def check_records_out(out: Path | None, *, overwrite: bool) -> None:
    """Refuse an --out that eyas must not write (before any model loads): a directory, a path under a file,
    an existing file without --overwrite, and, even with it, a file eyas generate did not write."""
    import json

    from eyas.common import check_out_file
    from eyas.locks import hold

    if out is None:
        return
    out = Path(out)
    check_out_file(out)
    hold(out)  # one writer of the records file
    if not out.exists():
        return
    if not overwrite:
        raise EyasError(f"--out {out} already exists: pass --overwrite to replace it, or choose another --out")
    try:
        with open(out, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    rec = None
                if not (isinstance(rec, dict) and all(k in rec for k in RECORD_KEYS)):
                    raise EyasError(
                        f"--overwrite: {out} is not an `eyas generate` records file (line {lineno} is not "
                        "a record); eyas never overwrites files it did not write: choose another --out"
                    )
    except OSError as exc:
        raise EyasError(f"--out {out}: cannot read it ({exc.strerror or exc})") from None


def generate_to(cfg: GenerateConfig, *, out: Path | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Run `eyas generate`; with `out`, write the per-turn records there as JSONL (atomically)."""
    import json

    from eyas.common import atomic_write_bytes

    check_records_out(out, overwrite=overwrite)
    summary, records = run_generate(cfg)
    if out is not None:
        atomic_write_bytes(out, "".join(json.dumps(r) + "\n" for r in records).encode())
        summary["out"] = str(out)
    # fp32: any difference is a bug. bf16/fp16: a 61-token verify forward and a 1-token step round
    # differently, and a near-tie can flip an argmax; the count is reported, not failed on
    if summary.get("greedy_mismatches") and summary["dtype"] == "float32":
        raise CheckFailed(
            f"{summary['greedy_mismatches']} greedy outputs differ from target-only decoding "
            "(a bug in the speculative loop, or a low-precision dtype's ties)",
            summary,
        )
    summary = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()}
    return summary
