"""Checks before any training step: the run folder, the options against the target's config, and a store against
the target (its manifest, and its states against a forward of the target)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from eyas.common import log
from eyas.errors import EyasError


def claim_out(cfg) -> tuple[Path, Path]:
    """Hold --out (one writer of the run folder; under torchrun, rank 0 holds it for the job) and refuse to replace
    a finished run or another run's checkpoints without --overwrite or --resume; (out, out/drafter)."""
    from eyas.locks import hold
    from eyas.train.checkpoint import latest_checkpoint

    out = Path(cfg.out)
    hold(out)
    final_dir = out / "drafter"
    if final_dir.exists() and not cfg.overwrite and cfg.resume is None:
        raise EyasError(
            f"{final_dir} already exists (a finished run): pass --overwrite, --resume auto, or another --out"
        )
    if not cfg.overwrite and cfg.resume is None and (earlier := latest_checkpoint(out / "checkpoints")) is not None:
        raise EyasError(
            f"--out {out} holds another run's checkpoints ({earlier.name}); a new run would replace them: "
            "pass --resume auto to continue that run, --overwrite to start over, or choose another --out"
        )
    return out, final_dir


def check_options_fit_target(
    target: str | Path, *, aux_layers: list[int] | None = None, draft_vocab: int | None = None, tcfg=None
) -> None:
    """--aux-layers and --draft-vocab against the target's config (`tcfg`, else read from its config.json;
    no weights), so a run that cannot fit fails before any model loads (train, and the demo before its stages)."""
    from eyas.drafter.layouts import check_layer_ids
    from eyas.target import num_layers_of

    if tcfg is None:
        from transformers import AutoConfig

        from eyas.defaults import resolve_target

        tcfg = AutoConfig.from_pretrained(resolve_target(target))
    text = tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg
    if aux_layers:
        check_layer_ids(aux_layers, num_layers_of(tcfg), what=f"--aux-layers (target {target})")
    vocab = int(text.vocab_size)
    if draft_vocab is not None and draft_vocab > vocab:
        raise EyasError(
            f"--draft-vocab {draft_vocab} exceeds the vocabulary of target {target} ({vocab} tokens); "
            f"pass at most {vocab}"
        )


def check_store(man: dict, path, *, n_layers: int, hidden: int, tok_hash: str, target_id: dict) -> None:
    from eyas.store.format import manifest_fields_problem
    from eyas.target import CONVENTION

    if (problem := manifest_fields_problem(man, Path(path))) is not None:
        raise EyasError(problem)
    if int(man.get("hidden_size", -1)) != hidden:
        raise EyasError(
            f"store {path} holds hidden size {man.get('hidden_size')}, target has {hidden}: "
            "it was captured from another model; pass the matching --target or capture again"
        )
    if man.get("convention", CONVENTION) != CONVENTION:
        raise EyasError(f"store {path}: layer convention {man.get('convention')!r}, expected {CONVENTION!r}")
    ids = list(man.get("aux_layer_ids") or [])
    if not ids or max(ids) >= n_layers:
        raise EyasError(
            f"store {path} holds aux layers {ids}, which do not fit a target with {n_layers} layers: "
            "it was captured from another model"
        )
    if man.get("tokenizer_hash") and man["tokenizer_hash"] != tok_hash:
        raise EyasError(
            f"store {path} was captured with another tokenizer (hash {man['tokenizer_hash'][:12]}) than "
            f"the target's ({tok_hash[:12]}); pass the matching --target or capture again"
        )
    t = man.get("target") or {}
    if t.get("config_sha256") and t["config_sha256"] != target_id["config_sha256"]:
        raise EyasError(
            f"store {path} was captured from target {t.get('path')} whose config differs from "
            f"{target_id['path']}; pass the matching --target or capture again"
        )
    if t.get("weights_index_sha256") and t["weights_index_sha256"] != target_id["weights_index_sha256"]:
        log(f"warning: store {path} was captured from a target whose weight files differ from {target_id['path']}")


def check_store_layers(reader, split, target_dir: Path, dev: torch.device, *, bf16: bool, is_main: bool) -> None:
    """Refuse a store whose states are other layers than its manifest names (store.invariants.layer_ids_problem):
    a forward of a few tokens, skipped where the target would not fit beside training (a huge target's store is
    checked by `eyas verify` only)."""
    import gc

    from eyas.store.invariants import layer_ids_problem
    from eyas.target import load_target

    weights = sum(f.stat().st_size for f in Path(target_dir).glob("*.safetensors"))
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if weights > free // 2:  # the target would crowd out training: leave the check to verify
        if is_main:
            log(
                f"store layer check: skipped (target weights {weights >> 20} MiB, {free >> 20} MiB free on {dev.type}); "
                "`eyas verify` checks the store's layers"
            )
        return
    model = load_target(target_dir, device=dev, dtype=torch.bfloat16 if bf16 else torch.float32)
    try:
        problem = layer_ids_problem(reader, split, model)
    finally:
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if problem is not None:
        raise EyasError(problem)
