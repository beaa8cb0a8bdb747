"""`eyas eval` end to end: greedy target answers, target features, replayed chain and tree decoding, report.

Stages, each timed: (1) load the target and the drafter (any layout) and check they belong together;
(2) generate the target's greedy answers to every turn, batched (or read an earlier evaluation's: --answers,
eyas/specdec/answers.py); (3) per batch of sequences (sorted by length, up to --replay-tokens tokens), one
target forward for the aux features, then the replay of every drafting mode; (4) metrics and the report.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.capture.batching import plan_batches
from eyas.common import log, require_finite, warn_gpu_sized
from eyas.dtypes import MODEL_DTYPES, resolve_device_dtype, to_dtype
from eyas.errors import EyasError
from eyas.specdec.metrics import DEFINITIONS, summarize
from eyas.specdec.replay import TreeConfig

SCHEMA = "eyas.eval/1"


def cpu_sized(conversations: int) -> dict[str, int]:
    """eval's and generate's options whose defaults are sized for a GPU, with the sizes `eyas demo` evaluates
    with on a CPU (--limit only where the prompts hold more conversations than that)."""
    return ({"limit": 4} if conversations > 4 else {}) | {"max_new_tokens": 48}


@dataclass(kw_only=True)
class EvalConfig:
    """Settings of one evaluation (the CLI's options)."""

    drafter: Path
    """Drafter directory: eyas (`eyas train` output), SGLang (LlamaForCausalLMEagle3) or vLLM/speculators
    (Eagle3Speculator) layout."""
    target: str = "default"
    """Target model directory (Hugging Face layout); `default` = embedded SmolLM2-135M-Instruct."""
    prompts: str = "mtbench"
    """`mtbench` (80 questions x 2 turns, the 2nd after the target's own 1st answer) or a JSONL file of
    {"turns": [...]} or {"prompt": "..."}."""
    max_new_tokens: int = 256
    """Greedy tokens generated per turn."""
    chain_k: int = 7
    """Chain drafting: draft tokens per round (0 = skip the chain)."""
    tree_topk: int = 10
    """EAGLE-2 tree: children kept per node and nodes expanded per depth."""
    tree_depth: int = 6
    """EAGLE-2 tree: draft steps per round (0 = skip the tree)."""
    tree_tokens: int = 60
    """EAGLE-2 tree: draft tokens submitted per round, root excluded."""
    device: str = "auto"
    """`auto` (cuda if available), `cpu`, `cuda`, `cuda:N`."""
    model_dtype: str = "auto"
    """Dtype the target and drafter run in: `auto` (bfloat16 on GPU, float32 on CPU), `bfloat16`, `float16`, `float32`."""
    limit: int | None = None
    """Evaluate only the first N conversations."""
    gen_batch_size: int = 160
    """Prompts per batched generate() call."""
    replay_tokens: int = 131072
    """Tokens (sequences x padded length) per replay batch; lower it if memory runs out."""
    allow_other_target: bool = False
    """Evaluate an eyas drafter against a target other than the one it was trained for (a deliberate transfer)."""
    answers: Path | None = None
    """An earlier `eyas eval` --out directory: replay on the target answers it recorded instead of generating them
    (drafters compared on the same answers): the same target, prompts and --max-new-tokens, a --limit up to its own."""

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.chain_k < 0 or self.tree_depth < 0:
            raise ValueError(f"--chain-k and --tree-depth must be >= 0, got {self.chain_k} and {self.tree_depth}")
        if self.chain_k == 0 and self.tree_depth == 0:
            raise ValueError("--chain-k 0 and --tree-depth 0 leave nothing to evaluate")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if self.gen_batch_size < 1 or self.replay_tokens < 1:
            raise ValueError("--gen-batch-size and --replay-tokens must be >= 1")
        to_dtype(self.model_dtype, what="--model-dtype", allowed=MODEL_DTYPES, also=("auto",))
        from eyas.config_checks import check_device, check_number

        for name in ("tree_topk", "tree_tokens"):
            check_number(self, name, ge=1)
        check_device(self.device)
        if self.prompts != "mtbench" and not Path(self.prompts).is_file():
            raise EyasError(f"--prompts {self.prompts}: not a file and not 'mtbench'")
        if self.answers is not None:
            self.answers = Path(self.answers)
            if not self.answers.is_dir():
                raise EyasError(f"--answers {self.answers}: not a directory (expected an `eyas eval` --out directory)")
        from eyas.config_checks import input_must_exist

        if not input_must_exist():  # `eyas pipeline`: the drafter is trained by an earlier stage
            return
        if not Path(self.drafter).is_dir():
            raise EyasError(
                f"--drafter {self.drafter} is not a directory (expected `eyas train`'s <out>/drafter or an "
                "`eyas export` directory)"
            )
        from eyas.common import check_safetensors_dir

        check_safetensors_dir(Path(self.drafter), what="--drafter")

    def modes(self) -> dict[str, TreeConfig]:
        out = {}
        if self.chain_k:
            out["chain"] = TreeConfig.chain(self.chain_k)
        if self.tree_depth:
            out["tree"] = TreeConfig(topk=self.tree_topk, depth=self.tree_depth, tokens=self.tree_tokens)
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_drafter_for(target, drafter_dir: Path, *, device, dtype):
    """(checkpoint, FunctionalDrafter) after checking the drafter against the target."""
    from eyas.drafter.reader import check_against_target, read_drafter
    from eyas.specdec.functional import FunctionalDrafter
    from eyas.target import num_layers_of

    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    ckpt = read_drafter(
        drafter_dir, target_layers=num_layers_of(target.config), target_model_type=getattr(text, "model_type", None)
    )
    check_against_target(ckpt.config, target.config, where=str(drafter_dir))
    embed = target.get_input_embeddings().weight.detach()
    if "embed_tokens.weight" in ckpt.weights and tuple(ckpt.weights["embed_tokens.weight"].shape) != tuple(embed.shape):
        raise EyasError(
            f"--drafter {drafter_dir}: embed_tokens {tuple(ckpt.weights['embed_tokens.weight'].shape)} "
            f"does not match the target's embedding {tuple(embed.shape)}"
        )
    drafter = FunctionalDrafter(ckpt.config, ckpt.weights, device=device, dtype=dtype, embed_tokens=embed)
    return ckpt, drafter


@torch.no_grad()
def replay_sequences(
    target,
    drafter,
    seqs,
    *,
    layer_ids: list[int],
    modes: dict[str, TreeConfig],
    replay_tokens: int,
    timings: dict[str, float],
) -> dict[str, list[list[int]]]:
    """Accepted counts per round, per sequence, per mode (sequences in input order)."""
    from eyas.common import progress
    from eyas.specdec.replay import DrafterProposer, replay_batch
    from eyas.target import forward_capture

    device = drafter.device
    results = {name: [None] * len(seqs) for name in modes}
    lengths = [len(s.ids) for s in seqs]
    groups = plan_batches(lengths, replay_tokens)
    bar = progress(len(seqs), "replay", "seq")
    for group in groups:
        L = max(lengths[i] for i in group)
        ids = torch.zeros(len(group), L, dtype=torch.long)
        for row, i in enumerate(group):
            ids[row, : lengths[i]] = torch.tensor(seqs[i].ids)
        ids = ids.to(device)
        t0 = time.perf_counter()
        aux, _ = forward_capture(target, ids, None, layer_ids=layer_ids)  # right padding: causal rows are exact
        aux = aux.flatten(2)
        _sync(device)
        timings["target_features_s"] = timings.get("target_features_s", 0.0) + time.perf_counter() - t0
        lens = torch.tensor([lengths[i] for i in group], device=device)
        plens = torch.tensor([len(seqs[i].prompt_ids) for i in group], device=device)
        for name, tree in modes.items():
            t0 = time.perf_counter()
            rounds = replay_batch(DrafterProposer(drafter), ids, aux, lengths_B=lens, prompt_lengths_B=plens, tree=tree)
            _sync(device)
            timings[f"replay_{name}_s"] = timings.get(f"replay_{name}_s", 0.0) + time.perf_counter() - t0
            for row, i in enumerate(group):
                results[name][i] = rounds[row]
        del aux
        bar.update(len(group))
    bar.close()
    return results


def mode_summary(name: str, tree: TreeConfig, rounds: list[list[int]], seqs) -> dict[str, Any]:
    s = summarize(rounds, depth=tree.depth, drafted_per_round=tree.tokens)
    s["settings"] = f"k={tree.depth}" if tree.is_chain else f"topk={tree.topk} depth={tree.depth} tokens={tree.tokens}"
    s["tree"] = asdict(tree)

    def by(key) -> dict[str, Any]:
        groups = sorted({key(q) for q in seqs}, key=str)
        return {
            str(g): {
                k: v
                for k, v in summarize(
                    [r for r, q in zip(rounds, seqs) if key(q) == g], depth=tree.depth, drafted_per_round=tree.tokens
                ).items()
                if k in ("acceptance_length", "rounds", "accepted")
            }
            for g in groups
        }

    if len({q.turn for q in seqs}) > 1:
        s["per_turn"] = by(lambda q: q.turn)
    if any(q.category for q in seqs):
        s["per_category"] = by(lambda q: q.category or "-")
    return s


def run_eval(cfg: EvalConfig) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run everything; returns (report, per-sequence records). Writes nothing."""
    from eyas.defaults import resolve_target
    from eyas.drafter.reader import check_drafter_dir
    from eyas.specdec.answers import answer_from, check_same_target, digest as answers_digest, read_answers
    from eyas.specdec.generate import conversation_turns, generate_conversations, load_prompts
    from eyas.target import (
        CONVENTION,
        check_drafter_target,
        load_target,
        load_tokenizer,
        model_identity,
        tokenizer_hash,
    )

    timings: dict[str, float] = {}
    device, dtype = resolve_device_dtype(cfg.device, cfg.model_dtype, what_dtype="--model-dtype")
    modes = cfg.modes()
    t0 = time.perf_counter()
    convs = load_prompts(cfg.prompts, limit=cfg.limit)  # a bad prompts file fails before any model loads
    check_drafter_dir(cfg.drafter)  # and so does a drafter without a usable config or weights
    recorded = read_answers(cfg.answers, max_new_tokens=cfg.max_new_tokens) if cfg.answers else None
    warn_gpu_sized(cfg, device, command="eval", shorter=cpu_sized(len(convs)))
    target_path = resolve_target(cfg.target)
    tokenizer = load_tokenizer(target_path)
    tok_hash, identity = tokenizer_hash(tokenizer), model_identity(target_path)  # each once: seconds for a big target
    check_drafter_target(cfg.drafter, target_path, tok_hash=tok_hash, allow=cfg.allow_other_target, identity=identity)
    if recorded:  # every mismatch of the recorded answers fails here, before the target loads
        check_same_target(recorded, {**identity, "tokenizer_hash": tok_hash}, target_path=target_path)
        seqs = conversation_turns(tokenizer, convs, answer_from(recorded))
    target = load_target(target_path, device=device, dtype=dtype)
    ckpt, drafter = load_drafter_for(target, Path(cfg.drafter), device=device, dtype=dtype)
    # NaN/Inf weights would draft garbage that is never accepted: tau 1.000 that looks like a result
    require_finite(
        ckpt.weights,
        what=f"--drafter {cfg.drafter}",
        hint="its training diverged or the file is damaged; evaluate another drafter or retrain",
    )
    spec = ckpt.config
    for tree in modes.values():
        if tree.topk > spec.draft_vocab_size:
            raise EyasError(
                f"--tree-topk {tree.topk} exceeds the drafter's vocabulary of {spec.draft_vocab_size} tokens"
            )
    timings["load_s"] = time.perf_counter() - t0
    log(
        f"eval: drafter {cfg.drafter} ({ckpt.provenance.format}, aux layers {spec.aux_layer_ids} {CONVENTION}), "
        f"{len(convs)} conversations, device {device} {str(dtype).replace('torch.', '')}"
    )

    t0 = time.perf_counter()
    if not recorded:
        seqs = generate_conversations(
            target, tokenizer, convs, max_new_tokens=cfg.max_new_tokens, batch_size=cfg.gen_batch_size
        )
        _sync(device)
        timings["generation_s"] = time.perf_counter() - t0
    generated = sum(len(s.generated_ids) for s in seqs)
    made = f"read from --answers {cfg.answers}" if recorded else f"generated in {timings['generation_s']:.1f}s"
    log(f"eval: {generated} answer tokens for {len(seqs)} sequences, {made}")

    t0 = time.perf_counter()
    rounds = replay_sequences(
        target,
        drafter,
        seqs,
        layer_ids=spec.aux_layer_ids,
        modes=modes,
        replay_tokens=cfg.replay_tokens,
        timings=timings,
    )
    timings["replay_total_s"] = time.perf_counter() - t0

    summaries = {name: mode_summary(name, tree, rounds[name], seqs) for name, tree in modes.items()}
    for name, s in summaries.items():
        if not s["rounds"]:
            log(f"eval: {name}: no drafting rounds (every answer ended after its first token)")
            continue
        log(
            f"eval: {name} ({s['settings']}): tau {s['acceptance_length']:.3f}, accepted/drafted "
            f"{s['accepted_per_drafted']:.3f}, {s['rounds']} rounds"
        )
    from eyas.specdec.generate import eos_ids_of
    from eyas.specdec.speculative import predict_for_modes

    t0 = time.perf_counter()  # batch-1 speed-up predicted from step costs measured here, with this device's engine
    context = sorted(len(s.ids) for s in seqs)[len(seqs) // 2]
    for name, p in predict_for_modes(
        target,
        drafter,
        modes,
        {n: s["acceptance_length"] for n, s in summaries.items()},
        layer_ids=spec.aux_layer_ids,
        context=context,
    ).items():
        summaries[name]["speed_prediction"] = p
    timings["step_costs_s"] = time.perf_counter() - t0
    eos = eos_ids_of(target, tokenizer)
    report = {
        "schema": SCHEMA,
        "drafter": {
            "path": str(Path(cfg.drafter).resolve()),
            "format": ckpt.provenance.format,
            "aux_layer_ids": spec.aux_layer_ids,
            "convention": CONVENTION,
            "source_layer_ids": ckpt.provenance.layer_ids,
            "spec": spec.to_dict(),
        },
        "target": identity,
        "tokenizer_sha256": tok_hash,
        "prompts": {"source": cfg.prompts, "conversations": len(convs), "limit": cfg.limit},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
        | {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "temperature": 0},
        "generation": {
            "sequences": len(seqs),
            "prompt_tokens": sum(len(s.prompt_ids) for s in seqs),
            "generated_tokens": generated,
            "ended_with_eos": sum(1 for s in seqs if s.generated_ids and s.generated_ids[-1] in eos),
            "answers": recorded.provenance() if recorded else None,  # None: generated here
            "answers_digest": answers_digest(seqs),
        },
        "modes": summaries,
        "definitions": DEFINITIONS,
        "timings": {k: round(v, 3) for k, v in timings.items()},
    }
    records = [
        {
            "id": s.id,
            "turn": s.turn,
            "category": s.category,
            "prompt_tokens": len(s.prompt_ids),
            "prompt_ids": s.prompt_ids,
            "generated_ids": s.generated_ids,
            **{f"accepted_{name}": rounds[name][i] for name in modes},
        }
        for i, s in enumerate(seqs)
    ]
    return report, records


def evaluate_to(out: str | Path, cfg: EvalConfig, *, overwrite: bool = False) -> dict[str, Any]:
    """Run the evaluation and write the report directory atomically; returns the CLI summary."""
    from eyas.common import atomic_directory, check_out_dir
    from eyas.specdec.report import write_report

    out = Path(out)
    check_out_dir(out, kind="eval", overwrite=overwrite, empty_ok=True)
    cfg.modes()  # validates the tree options before any work
    report, records = run_eval(cfg)
    with atomic_directory(out, overwrite=True, kind="eval") as tmp:  # never a half-written report
        write_report(tmp, report, records)
    summary = {
        "out": str(out),
        "sequences": report["generation"]["sequences"],
        "generated_tokens": report["generation"]["generated_tokens"],
        "timings": report["timings"],
    }
    for name, m in report["modes"].items():
        r4 = lambda x: None if x is None else round(x, 4)  # noqa: E731  (None: no rounds at all)
        summary[f"tau_{name}"] = r4(m["acceptance_length"])
        summary[f"accepted_per_drafted_{name}"] = r4(m["accepted_per_drafted"])
        pred = m.get("speed_prediction", {})
        summary[f"predicted_speedup_bs1_{name}"] = r4(pred.get("predicted_speedup_bs1"))
        if pred.get("predicted_speedup_bs1_range"):  # the spread of the timings behind it
            summary[f"predicted_speedup_bs1_{name}_range"] = [r4(x) for x in pred["predicted_speedup_bs1_range"]]
        if pred.get("withheld") and m["acceptance_length"] is not None:
            summary[f"predicted_speedup_bs1_{name}_withheld"] = pred["withheld"]
    return summary
