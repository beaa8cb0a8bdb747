"""The parts `eyas train` builds before its first step, in the order train/loop.py `_train` calls them: the target's
description, the data (offline store or online target), the drafter's config, the samples' statistics, the drafter
and its draft vocabulary, the batches and schedule length, the optimizer and schedule, the run's identity and the
resume; and the online state cache, decided after the first step."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.common import log
from eyas.errors import EyasError
from eyas.train.checks import check_options_fit_target, check_store, check_store_layers
from eyas.train.optim import default_lr, default_optimizer, lr_lambda, make_optimizer


def default_tokens_per_batch(device: torch.device) -> int:
    """Packed tokens per micro-batch on CUDA when --tokens-per-batch is not given: the fastest
    measured for SmolLM2 online on a 141 GB GPU, 32,768 on GPUs with less than 64 GiB (its peak memory is a third)."""
    total = torch.cuda.get_device_properties(device).total_memory
    return 131072 if total >= 64 * 2**30 else 32768


@dataclass
class Target:
    """The target model as training sees it, from its config and tokenizer (its weights are not loaded here)."""

    dir: Path
    config: Any
    tok_hash: str
    identity: dict
    n_layers: int
    hidden: int
    vocab_size: int


def describe_target(cfg) -> Target:
    """The target's config, tokenizer hash and identity; the options are checked against its config."""
    from transformers import AutoConfig

    from eyas.defaults import resolve_target
    from eyas.target import load_tokenizer, model_identity, num_layers_of, tokenizer_hash

    target_dir = resolve_target(cfg.target)
    tcfg = AutoConfig.from_pretrained(target_dir)
    tok_hash = tokenizer_hash(load_tokenizer(target_dir))
    target_id = model_identity(target_dir)
    text = tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg
    n_layers, hidden = num_layers_of(tcfg), int(text.hidden_size)
    check_options_fit_target(target_dir, aux_layers=cfg.aux_layers, draft_vocab=cfg.draft_vocab, tcfg=tcfg)
    return Target(
        dir=target_dir,
        config=tcfg,
        tok_hash=tok_hash,
        identity=target_id,
        n_layers=n_layers,
        hidden=hidden,
        vocab_size=int(text.vocab_size),
    )


@dataclass
class Data:
    """The training and eval sources and what the drafter takes from the target. Online, the sources are made by
    `drafter_config` (they need the aux layers it picks): until then `train_src` is None and `split`/`eval_split`
    are the prepared dataset's; `tensors` (embed, lm_head, final_norm) go once the drafter holds them."""

    train_src: Any
    eval_src: Any
    split: Any
    eval_split: Any
    aux_ids: list[int] | None
    tensors: dict | None
    fingerprint: dict
    target_model: Any = None


def build_data(cfg, tgt: Target, d, *, bf16: bool) -> Data:
    """Offline: the store's sources (checked against the target; eval from --eval-store or held out of the store).
    Online: the prepared dataset and the target, loaded on the device."""
    data = _store_data(cfg, tgt, d, bf16=bf16) if cfg.store is not None else _online_data(cfg, tgt, d, bf16=bf16)
    n_train = len(data.train_src) if data.train_src is not None else len(data.split)
    if n_train == 0:
        raise EyasError(f"the training split is empty ({cfg.store or cfg.data}); prepare/capture some samples first")
    return data


def _store_data(cfg, tgt: Target, d, *, bf16: bool) -> Data:
    from eyas.train.data import StoreSource, open_store, read_target_tensors, store_order

    dev = d.device
    reader, split, man = open_store(cfg.store, prepared=cfg.data)
    # -- 3. checks before any step --
    check_store(man, cfg.store, n_layers=tgt.n_layers, hidden=tgt.hidden, tok_hash=tgt.tok_hash, target_id=tgt.identity)
    check_store_layers(reader, split, tgt.dir, dev, bf16=bf16, is_main=d.is_main)
    aux_ids = list(man["aux_layer_ids"])
    order = store_order(reader, split)
    state_dtype = torch.bfloat16 if bf16 else torch.float32
    if cfg.eval_store is not None:
        ereader, esplit, eman = open_store(cfg.eval_store)
        check_store(
            eman,
            cfg.eval_store,
            n_layers=tgt.n_layers,
            hidden=tgt.hidden,
            tok_hash=tgt.tok_hash,
            target_id=tgt.identity,
        )
        eval_src = StoreSource(
            ereader,
            esplit,
            store_order(ereader, esplit)[: cfg.eval_samples],
            max_length=cfg.max_length,
            dtype=state_dtype,
        )
        train_order = order
    else:
        g = torch.Generator().manual_seed(cfg.seed + 7)
        perm = torch.randperm(len(order), generator=g).tolist()
        n_hold = min(cfg.eval_samples, len(order) // 10)
        held = set(perm[:n_hold])
        train_order = [o for i, o in enumerate(order) if i not in held]
        eval_src = (
            StoreSource(reader, split, [order[i] for i in perm[:n_hold]], max_length=cfg.max_length, dtype=state_dtype)
            if n_hold
            else None
        )
        log(f"offline: no --eval-store; holding out {n_hold} of {len(order)} store samples for eval")
    train_src = StoreSource(reader, split, train_order, max_length=cfg.max_length, dtype=state_dtype)
    fingerprint = {"store": man.get("prepared", {}).get("fingerprint"), "samples": len(train_order)}
    return Data(
        train_src=train_src,
        eval_src=eval_src,
        split=split,
        eval_split=None,
        aux_ids=aux_ids,
        tensors=read_target_tensors(tgt.dir),
        fingerprint=fingerprint,
    )


def _online_data(cfg, tgt: Target, d, *, bf16: bool) -> Data:
    from eyas.data.prepared import PreparedDataset
    from eyas.target import load_target

    ds = PreparedDataset(cfg.data)
    if ds.tokenizer_hash and ds.tokenizer_hash != tgt.tok_hash:
        raise EyasError(
            f"--data {cfg.data} was tokenised with another tokenizer (hash {ds.tokenizer_hash[:12]}) "
            f"than target {tgt.dir} ({tgt.tok_hash[:12]}); run `eyas prepare --target {cfg.target}` again"
        )
    split = ds.split("train")
    target_model = load_target(tgt.dir, device=d.device, dtype=torch.bfloat16 if bf16 else torch.float32)
    for p in target_model.parameters():
        p.requires_grad_(False)
    tensors = {
        "embed": target_model.get_input_embeddings().weight.detach(),
        "lm_head": target_model.get_output_embeddings().weight.detach(),
    }
    norm = getattr(getattr(target_model, "model", None), "norm", None)
    if norm is not None:
        tensors["final_norm"] = norm.weight.detach()
    return Data(
        train_src=None,
        eval_src=None,
        split=split,
        eval_split=ds.split("eval") if "eval" in ds.split_names else None,
        aux_ids=None,
        tensors=tensors,
        fingerprint={"data": split.fingerprint, "samples": len(split)},
        target_model=target_model,
    )


def drafter_config(cfg, tgt: Target, data: Data):
    """The drafter's config from the target's (offline: on the store's aux layers). Online, the sources are made
    here, on the aux layers it picked."""
    from eyas.drafter.model import DrafterConfig
    from eyas.train.data import OnlineSource

    if cfg.store is not None and cfg.aux_layers and list(cfg.aux_layers) != data.aux_ids:
        raise EyasError(
            f"--aux-layers {cfg.aux_layers} differs from the store's {data.aux_ids}; offline training uses "
            "the layers the store holds (drop --aux-layers or capture those layers)"
        )
    try:
        wider = {"intermediate_size": cfg.draft_intermediate_size} if cfg.draft_intermediate_size else {}
        dcfg = DrafterConfig.from_target_config(
            tgt.config, draft_vocab_size=cfg.draft_vocab, aux_layer_ids=data.aux_ids or cfg.aux_layers, **wider
        )
    except EyasError:
        raise
    except ValueError as exc:  # DrafterConfig names the field; say which target it came from
        raise EyasError(f"target {tgt.dir}: cannot build a drafter config ({exc})") from exc
    if cfg.store is None:
        data.aux_ids = dcfg.aux_layer_ids
        data.train_src = OnlineSource(
            data.split,
            list(range(len(data.split))),
            model=data.target_model,
            layer_ids=data.aux_ids,
            max_length=cfg.max_length,
        )
        esplit = data.eval_split
        data.eval_src = (
            OnlineSource(
                esplit,
                list(range(min(len(esplit), cfg.eval_samples))),
                model=data.target_model,
                layer_ids=data.aux_ids,
                max_length=cfg.max_length,
            )
            if esplit is not None and len(esplit)
            else None
        )
    if data.tensors["embed"].shape != (tgt.vocab_size, dcfg.hidden_size):
        raise EyasError(
            f"target {tgt.dir}: embedding {tuple(data.tensors['embed'].shape)} does not match its config "
            f"(vocab {tgt.vocab_size} x hidden {dcfg.hidden_size})"
        )
    return dcfg


@dataclass
class Samples:
    """Per-sample figures of the training split, read once before training (the items themselves are not kept)."""

    counts: Any
    """Assistant tokens per target id (the draft vocabulary's counts)."""
    den_table: Any
    """[n, K] loss-mask positions per sample and TTT step (the loss normalisers' terms)."""
    lengths: list[int]
    item_ids: list[str]


def scan_samples(cfg, train_src, vocab_size: int) -> Samples:
    """Read every training sample's ids and loss mask once; refuse a split with nothing to learn."""
    from eyas.drafter.vocab import count_assistant_tokens

    train_items = [train_src.item(i) for i in range(len(train_src))]
    counts = count_assistant_tokens(train_items, vocab_size)
    den_table = step_counts([it.loss_mask for it in train_items], cfg.ttt_steps)
    lengths = [int(it.input_ids.shape[0]) for it in train_items]
    item_ids = [it.id for it in train_items]
    del train_items
    if int(counts.sum()) == 0:
        if max(lengths) >= cfg.max_length:  # samples were cut: the assistant turns may lie past the cut
            raise EyasError(
                f"--max-length {cfg.max_length} leaves no loss-masked (assistant) tokens in the training "
                f"split ({cfg.store or cfg.data}): samples are cut to their first {cfg.max_length} tokens, "
                "before any answer; raise --max-length"
            )
        raise EyasError(
            f"the training split has no loss-masked (assistant) tokens ({cfg.store or cfg.data}); nothing to learn"
        )
    return Samples(counts=counts, den_table=den_table, lengths=lengths, item_ids=item_ids)


def build_drafter(cfg, dcfg, data: Data, counts, dev: torch.device, *, bf16: bool):
    """The draft vocabulary (from the assistant tokens' counts), the drafter on `dev` (seeded weights, embedding and
    optionally head and final norm from the target) and the teacher's head weights (scaled by the temperature).
    The target's tensors are dropped from `data` here."""
    from eyas.drafter.model import Eagle3Drafter
    from eyas.drafter.vocab import build_draft_vocab

    tensors = data.tensors
    vocab = build_draft_vocab(counts, dcfg.draft_vocab_size)
    drafter = Eagle3Drafter(dcfg)
    drafter.reset_parameters(seed=cfg.seed)
    drafter.set_vocab(vocab.used)
    drafter.init_from_target(
        tensors["embed"].float().cpu(),
        tensors["lm_head"].float().cpu() if cfg.init_head else None,
        tensors.get("final_norm").float().cpu() if cfg.init_head and "final_norm" in tensors else None,
    )
    drafter.to(dev)
    head_w = tensors["lm_head"]
    if cfg.teacher_temperature != 1.0:  # the teacher's logits / T: the head scaled once (its argmax unchanged)
        head_w = head_w.float() / cfg.teacher_temperature
    head_w = head_w.to(dev, torch.bfloat16 if bf16 else torch.float32)
    data.tensors = tensors = None
    return drafter, vocab, head_w


def log_drafter(cfg, d, *, bf16: bool, dcfg, ttt_cfg, drafter, vocab, samples: Samples, vocab_size: int) -> None:
    """The packed attention kernel (checked against the exact one on CUDA), how the TTT weights are cast, the draft
    vocabulary and the drafter's size."""
    dev = d.device
    if dev.type == "cuda" and cfg.attention == "fast":
        from eyas.packing import check_varlen_kernel, pick_varlen_kernel

        err = check_varlen_kernel(dev, torch.bfloat16 if bf16 else torch.float32)
        if d.is_main:
            probe = torch.empty(1, 1, 1, dcfg.head_dim, device=dev, dtype=torch.bfloat16 if bf16 else torch.float32)
            log(f"packed attention kernel: {pick_varlen_kernel(probe)} (check vs exact: max |diff| {err:.4f})")
    if bf16 and not cfg.fsdp and d.is_main:  # (FSDP2 keeps bf16 parameters: nothing to cast)
        once = ttt_cfg.cast_once_for(dcfg.hidden_size)
        log(
            f"TTT weights: {'cast to bf16 once a forward, gradients summed inside the matmuls' if once else 'cast by each step'}"
            f" ({'set' if cfg.ttt_cast_once is not None else f'default for hidden size {dcfg.hidden_size}'})"
        )
    if d.is_main:
        counts = samples.counts
        log(
            f"draft vocab: {vocab.size} of {vocab_size} target ids, coverage {vocab.coverage():.4f} of "
            f"{int(counts.sum())} assistant tokens; drafter {drafter.num_trainable_params() / 1e6:.1f}M trainable params"
        )


@dataclass
class Batches:
    """How steps are cut: micro-batches by tokens (packed) or by samples, the plan over ranks and accumulation, the
    run's length in steps and its warmup."""

    tokens_per_batch: int | None
    batch_size: int
    plan: Any
    total: int
    warmup: int


def build_batches(cfg, d, lengths: list[int], n_train: int) -> Batches:
    from eyas.train.plans import Plan, TokenPlan

    dev = d.device
    tokens_per_batch = cfg.tokens_per_batch or (
        default_tokens_per_batch(dev) if dev.type == "cuda" and cfg.batch_size is None else None
    )
    batch_size = cfg.batch_size or 1
    if tokens_per_batch is not None:
        tokens_per_batch = max(tokens_per_batch, min(cfg.max_length, max(lengths)))
        plan = TokenPlan(
            lengths=lengths, tokens_per_batch=tokens_per_batch, accum=cfg.grad_accum, world=d.world, seed=cfg.seed
        )
    else:
        plan = Plan(n=n_train, micro_batch=batch_size, accum=cfg.grad_accum, world=d.world, seed=cfg.seed)
    if d.is_main:
        unit = f"{tokens_per_batch} tokens" if tokens_per_batch else f"{batch_size} samples"
        log(f"batches: {unit} per micro-batch (packed rows), {plan.steps_per_epoch} steps per epoch")
    total = cfg.steps or max(1, math.ceil(cfg.epochs * plan.steps_per_epoch))
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, total // 50)
    return Batches(tokens_per_batch=tokens_per_batch, batch_size=batch_size, plan=plan, total=total, warmup=warmup)


def open_resume(cfg, ckdir: Path) -> tuple[Path | None, dict | None]:
    """The checkpoint --resume names (`auto`: the latest in `ckdir`, None when there is none) and its contents."""
    from eyas.train import checkpoint as ck

    resume_path = (ck.latest_checkpoint(ckdir) if cfg.resume == "auto" else Path(cfg.resume)) if cfg.resume else None
    return resume_path, ck.load_checkpoint(resume_path) if resume_path is not None else None


@dataclass
class Optim:
    name: str
    lr: float
    opt: Any
    sched: Any


def build_optimizer(cfg, module, hidden_size: int, state: dict | None, d, batches: Batches) -> Optim:
    """The optimizer (--optimizer, else a resumed run's, else the default for the drafter's width), its peak
    learning rate and the warmup + cosine schedule."""
    dev = d.device
    optimizer = cfg.optimizer or (
        state["identity"]["optimizer"] if state is not None else default_optimizer(hidden_size, fsdp=cfg.fsdp)
    )
    lr = default_lr(hidden_size, optimizer) if cfg.lr is None else cfg.lr
    if d.is_main:
        why = "set" if cfg.optimizer else "the checkpoint's" if state is not None else "default"
        log(f"optimizer: {optimizer} ({why}), peak lr {lr:g} ({'set' if cfg.lr is not None else 'default'})")
    opt = make_optimizer(
        module, optimizer, lr=lr, weight_decay=cfg.weight_decay, fused=dev.type == "cuda" and not cfg.fsdp
    )
    warmup, total = batches.warmup, batches.total
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, warmup=warmup, total=total, min_ratio=cfg.min_lr_ratio)
    )
    return Optim(name=optimizer, lr=lr, opt=opt, sched=sched)


def run_identity(
    cfg, *, ttt_cfg, dcfg, global_batch: int, fingerprint: dict, vocab_used: torch.Tensor, optimizer: str
) -> dict:
    """What a checkpoint must match to be resumed by this run."""
    ttt_id = asdict(ttt_cfg) | {"attention": None}  # the attention kernel does not change what is computed
    identity = {
        "drafter": dcfg.to_dict(),
        "ttt": ttt_id,
        "global_batch": global_batch,
        "data": fingerprint,
        "seed": cfg.seed,
        "draft_vocab_sha": vocab_sha(vocab_used),
        "teacher_temperature": cfg.teacher_temperature,
        "optimizer": optimizer,
    }
    return identity


def resume(
    cfg, state: dict | None, resume_path: Path | None, ckdir: Path, *, identity: dict, module, optim: Optim, d
) -> int:
    """Restore model, optimizer, schedule and RNG from `state` (checked against `identity`); the step to start at."""
    from eyas.train import checkpoint as ck

    start = 0
    if cfg.resume and state is None:
        log(f"--resume auto: no checkpoint in {ckdir}; starting from step 0")
    elif state is not None:
        ck.check_identity(state["identity"], identity, resume_path)
        ck.restore(state, model=module, optimizer=optim.opt, scheduler=optim.sched)
        start = int(state["step"])
        if d.is_main:
            log(f"resumed from {resume_path} at step {start}")
    return start


def start_state_cache(
    cfg, src, ids: list[str], lengths: list[int], *, hidden: int, dev: torch.device, epochs: float, log_it: bool
) -> None:
    """After the first step (its memory peak measured): give the online source a StateCache when
    asked (--cache-states) or, by default, when the run reads its samples more than once and the
    cache fits on the GPU beside that peak (10% and 4 GiB to spare)."""
    from eyas.train.data import StateCache

    A, D = len(src.layer_ids), hidden
    dtype = next(src.model.parameters()).dtype
    need = StateCache.bytes_needed(lengths, n_aux=A, hidden=D, dtype=dtype)
    what = f"{need / 1e9:.1f} GB for {len(ids):,} samples"
    why = None
    if cfg.cache_states is None and epochs <= 1:
        why = "the run reads each sample once"
    elif dev.type == "cuda":
        torch.cuda.synchronize(dev)
        total = torch.cuda.get_device_properties(dev).total_memory
        peak = torch.cuda.max_memory_reserved(dev)
        room = total - int(peak * 1.1) - (4 << 30)
        if need > room:
            why = f"{what} do not fit beside the first step's {peak / 1e9:.1f} GB on {total / 1e9:.0f} GB"
            if cfg.cache_states:
                raise EyasError(f"--cache-states: {why}; drop it or lower --tokens-per-batch")
    elif cfg.cache_states is None:
        why = "off by default on the CPU (--cache-states turns it on)"
    if why is not None:
        if log_it:
            log(f"state cache: off ({why})")
        return
    src.cache = StateCache(ids, lengths, n_aux=A, hidden=D, dtype=dtype, device=dev)
    if log_it:
        log(f"state cache: on, {what}: after the first epoch the target runs only for samples not yet seen")


def vocab_sha(used: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(used.numpy().tobytes()).hexdigest()[:16]


def step_counts(masks, K: int):
    """[n, K] float64 numpy: loss-mask positions of each sample at each TTT step (m_{t+2+k} summed),
    the per-sample terms of the loss normalisers."""
    import numpy as np

    out = np.zeros((len(masks), K), dtype=np.float64)
    for i, m in enumerate(masks):
        c = m.to(torch.int64).flip(0).cumsum(0).flip(0)  # c[j] = sum(m[j:])
        for k in range(K):
            out[i, k] = float(c[2 + k]) if 2 + k < c.shape[0] else 0.0
    return out
