"""The target model: loading, identity hashes, and the hidden states EAGLE-3 learns from.

Layer-id convention used everywhere inside eyas ("hf-input"): id i = the INPUT to decoder layer i =
`output_hidden_states[i]` (index 0 = embeddings). This is vLLM's convention; SGLang's ids are
ours minus one (id k = OUTPUT of layer k). The default ids, the valid range and the conversion to
each engine's ids are in eyas.drafter.layouts.

Shape legend: B batch, T tokens, D hidden size, A number of aux layers, V vocab.

`forward_capture` is the fast path: forward pre-hooks on the chosen decoder layers and a forward hook
on the final norm, running the base model only (no lm_head, no list of all layers). The independent
reference path used by `eyas verify` is `reference_hidden_states`: `output_hidden_states=True` on
the full causal LM, one sample at a time.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from eyas.drafter.layouts import CONVENTION  # noqa: F401  (id i = input to decoder layer i; re-exported)
from eyas.errors import EyasError


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def num_layers_of(config) -> int:
    return int(_text_config(config).num_hidden_layers)


def hidden_size_of(config) -> int:
    return int(_text_config(config).hidden_size)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    from eyas.defaults import resolve_target

    path = resolve_target(path)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises many types here
        raise EyasError(f"target `{path}`: cannot load a tokenizer ({type(exc).__name__}: {exc})") from exc
    return tok


def load_target(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Load a causal LM from a local HF directory ('default' = the embedded SmolLM2), eval mode."""
    from transformers import AutoModelForCausalLM

    from eyas.defaults import resolve_target

    path = resolve_target(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except Exception as exc:
        raise EyasError(f"target `{path}`: cannot load the model ({type(exc).__name__}: {exc})") from exc
    return model.to(device).eval()


WEIGHT_SAMPLE_BYTES = 64  # bytes hashed at the start, middle and end of every tensor
WEIGHT_SAMPLES_PER_FILE = 4096  # most tensors sampled per weight file (huge MoE files: a spread subset)


def _sampled_weight_bytes(f: Path, h) -> None:
    """Feed `h` a few bytes of every tensor of one weight file (reads KBs, not the whole file).

    safetensors: the start, middle and end of each tensor's data (all tensors while a file holds at
    most WEIGHT_SAMPLES_PER_FILE of them, else an evenly spread subset). A checkpoint with the same
    config and shapes but other weights (one layer perturbed by 1%) changes nearly every byte of the
    tensors it touches, so it changes the hash. Other formats: 64 chunks at evenly spaced offsets.
    """
    size = f.stat().st_size
    with open(f, "rb") as fh:
        if f.suffix == ".safetensors":
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
            spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
            step = max(1, -(-len(spans) // WEIGHT_SAMPLES_PER_FILE))
            points = []
            for a, b in spans[::step]:
                a, b = 8 + n + a, 8 + n + b
                points += sorted({a, max(a, (a + b) // 2 - WEIGHT_SAMPLE_BYTES // 2), max(a, b - WEIGHT_SAMPLE_BYTES)})
            take = [(p, WEIGHT_SAMPLE_BYTES) for p in points]
        else:
            take = [(size * i // 64, 4096) for i in range(64)]
        for offset, length in take:
            fh.seek(offset)
            h.update(fh.read(length))


def model_identity(path: str | Path) -> dict[str, Any]:
    """Path plus hashes of config.json, of the weights' index, and of sampled weight bytes.

    - config_sha256: config.json's bytes;
    - weights_index_sha256: file names and sizes, and each safetensors header (names, dtypes, shapes);
    - weights_sample_sha256: a few bytes of every tensor (see _sampled_weight_bytes), so that another
      checkpoint of the same architecture (a fine-tune, a perturbed copy) is told apart. Cost: about
      3 x 64 bytes read per tensor, milliseconds for a small model, seconds for a 1 TB one.
    """
    from eyas.defaults import resolve_target

    path = resolve_target(path, known_type=False)  # hashes only: loading the model is where its type must be known
    config_bytes = (path / "config.json").read_bytes()
    h = hashlib.sha256()
    sampled = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
        if f.suffix == ".safetensors":
            with open(f, "rb") as fh:  # the safetensors header is the index: names, dtypes, shapes, offsets
                n = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(n))
        sampled.update(f.name.encode() + str(f.stat().st_size).encode())
        _sampled_weight_bytes(f, sampled)
    return {
        "path": str(path.resolve()),
        "config_sha256": hashlib.sha256(config_bytes).hexdigest(),
        "weights_index_sha256": h.hexdigest(),
        "weights_sample_sha256": sampled.hexdigest(),
    }


IDENTITY_PARTS = (
    ("config_sha256", "config.json"),
    ("weights_index_sha256", "weight files"),
    ("weights_sample_sha256", "weights"),
    ("tokenizer_hash", "tokenizer"),
)


def identity_differences(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The IDENTITY_PARTS, by name, on which two target identities differ (a part either lacks is not compared)."""
    return [what for key, what in IDENTITY_PARTS if recorded.get(key) and now.get(key) and recorded[key] != now[key]]


def check_drafter_target(
    drafter: str | Path,
    target: str | Path,
    *,
    tok_hash: str | None = None,
    allow: bool = False,
    option: str = "--target",
    identity: dict[str, Any] | None = None,
) -> None:
    """Refuse `target` when it is not the target the eyas drafter at `drafter` was trained for (the identity its
    config.json records: config, weight files, sampled weight bytes, tokenizer), before any model loads; with
    `allow` (a deliberate transfer) say so and go on. Drafters of other layouts record no target: nothing to compare.
    `identity`: model_identity(target), where the caller has it already."""
    from eyas.common import log

    try:
        recorded = json.loads((Path(drafter) / "config.json").read_text()).get("target")
    except (OSError, ValueError, AttributeError):
        return
    if not isinstance(recorded, dict) or not recorded:
        return
    try:
        now = {**(identity or model_identity(target)), "tokenizer_hash": tok_hash}
    except EyasError:  # not a model directory (a verifier's bare config): nothing to compare; loading it says more
        return
    differ = identity_differences(recorded, now)
    if not differ:
        return
    said = (
        f"--drafter {drafter} was trained for target {recorded.get('path')}, not {option} {target} (their "
        f"{', '.join(differ)} differ)"
    )
    if allow:
        log(f"warning: {said}; going on (--allow-other-target)")
        return
    raise EyasError(
        f"{said}: pass the target it was trained for, or --allow-other-target to use it with this one deliberately"
    )


def tokenizer_hash(tokenizer) -> str:
    """Hash of the vocabulary, special tokens and chat template: equal hashes tokenise identically."""
    vocab = sorted(tokenizer.get_vocab().items())
    payload = {
        "vocab": vocab,
        "special": sorted(map(str, tokenizer.all_special_tokens)),
        "chat_template": getattr(tokenizer, "chat_template", None),
        "class": type(tokenizer).__name__.replace("Fast", ""),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _decoder_parts(model):
    """(layers, final_norm) of a Hugging Face causal LM."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    norm = getattr(base, "norm", None)
    if layers is None or norm is None:
        raise EyasError(
            f"{type(model).__name__}: cannot find decoder `layers` and final `norm`; eyas supports "
            "Hugging Face decoder-only models laid out as model.layers / model.norm"
        )
    return base, layers, norm


def run_hooked(
    model, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None, *, layer_ids: list[int], put
) -> None:
    """One base-model forward (no lm_head) calling `put(slot, hidden_BTD)` as states appear.

    Slot a < A receives the input to decoder layer layer_ids[a] (a forward pre-hook), slot A the
    final norm's output. The one hook mechanism behind `forward_capture` and the capture fast path
    (capture/hooks.py), which gathers each slot straight into its stored layout.
    """
    base, layers, norm = _decoder_parts(model)
    final = len(layer_ids)

    def pre_hook(slot):
        def hook(module, args, kwargs):
            put(slot, args[0] if args else kwargs["hidden_states"])

        return hook

    def norm_hook(module, args, output):
        put(final, output[0] if isinstance(output, tuple) else output)

    handles = []
    try:
        for slot, i in enumerate(layer_ids):
            handles.append(layers[i].register_forward_pre_hook(pre_hook(slot), with_kwargs=True))
        handles.append(norm.register_forward_hook(norm_hook))
        base(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False)
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def forward_capture(
    model, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None, *, layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the base model once; return (aux_BTAD, final_BTD) for the given layer ids.

    aux_BTAD[:, :, a] is the input to decoder layer layer_ids[a] (pre-norm residual stream);
    final_BTD is the output of the final norm (teacher logits = lm_head(final_BTD)).
    """
    captured: dict[int, torch.Tensor] = {}
    run_hooked(model, input_ids_BT, attention_mask_BT, layer_ids=layer_ids, put=captured.__setitem__)
    aux_BTAD = torch.stack([captured[a] for a in range(len(layer_ids))], dim=2)
    return aux_BTAD, captured[len(layer_ids)]


@torch.no_grad()
def reference_hidden_states(
    model, input_ids_T: torch.Tensor, *, layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The independent slow path: one unbatched sample, `output_hidden_states`, eager.

    Returns (aux_TAD, final_TD). Hugging Face's last hidden_states entry is already post-norm.
    """
    out = model(input_ids=input_ids_T[None], output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    aux_TAD = torch.stack([hs[i][0] for i in layer_ids], dim=1)
    return aux_TAD, hs[-1][0]
