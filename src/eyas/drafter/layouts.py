"""The three on-disk layouts of an EAGLE-3 drafter (their files, weight keys and layer ids) and what a reader
makes of any of them. Reading them is drafter/reader.py, writing them drafter/writer.py.

Layouts (everything is read into one `DrafterConfig` plus weights keyed by SGLang's names, which are
eyas's own; `Provenance` records where they came from):

| | eyas (`eyas train`) | SGLang (`LlamaForCausalLMEagle3`) | vLLM / speculators (`Eagle3Speculator`) |
|---|---|---|---|
| config | `{"schema": "eyas.drafter/1", "drafter": DrafterConfig}` | Llama fields at top level | Llama fields in `transformer_layer_config` |
| layer keys | `midlayer.*` | `midlayer.*` | `layers.0.*` |
| aux layer ids | `aux_layer_ids`, hf-input | `eagle_config.eagle_aux_hidden_state_layer_ids`, id k = OUTPUT of layer k | top-level `eagle_aux_hidden_state_layer_ids`, hf-input |
| residual | the raw feature | the raw feature | `norm_before_residual` (absent = true) |
| full vocabulary | d2t = 0, t2d all true | no d2t/t2d (`hot_token_id` stays None) | no d2t/t2d (no `draft_id_to_target_id` then) |

Layer ids. eyas's convention ("hf-input"): id i = the INPUT to decoder layer i = Hugging Face
`output_hidden_states[i]`; vLLM uses the same. SGLang's id k is the OUTPUT of layer k, captured before
layer k + 1, so Llama & co write i - 1; its DeepSeek-V2/V3 models add the 1 only when the first id
is 1 (and use the ids as they are otherwise). `engine_layer_ids` / `eyas_layer_ids` are the one
conversion and its inverse; `default_aux_layer_ids` (2, N//2, N-3) and `check_layer_ids` (1..N-1,
the ids both engines can capture) are the one default and the one range check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eyas.errors import EyasError

if TYPE_CHECKING:
    from eyas.drafter.model import DrafterConfig

CONVENTION = "hf-input"  # id i = input to decoder layer i = output_hidden_states[i]
ENGINES = ("sglang", "vllm")
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25")  # Kimi wraps DeepSeek-V3 (same rule)
SCHEMA = "eyas.drafter/1"
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"

# The weight keys of one EAGLE-3 draft layer, SGLang naming (= eyas's Eagle3Drafter state_dict).
LAYER_KEYS = (
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
)
REQUIRED_KEYS = ("fc.weight", *LAYER_KEYS, "norm.weight", "lm_head.weight")
OPTIONAL_KEYS = ("embed_tokens.weight", "d2t", "t2d")
# Present in some speculators checkpoints, never used at inference.
IGNORED_KEYS = ("verifier_norm.weight", "verifier_lm_head.weight")


# ----------------------------------------------------------------------------------------------
# layer ids


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high: the inputs to layers 2, N//2 and N-3."""
    if num_layers < 4:
        raise EyasError(f"the target has {num_layers} layers; EAGLE-3's default aux layers need at least 4")
    return [2, num_layers // 2, num_layers - 3]


def check_layer_ids(layer_ids: Sequence[int], num_layers: int, *, what: str = "aux layer ids") -> list[int]:
    """Aux ids must be inputs to existing layers after the first: 1 <= i <= N-1 (0 is the embeddings,
    which neither engine can capture; N would be the final output). Returns them as ints."""
    ids = [int(i) for i in layer_ids]
    bad = [i for i in ids if not 1 <= i < num_layers]
    if not ids or bad:
        raise EyasError(
            f"{what}: ids {ids} {'include ' + str(bad) + ', ' if bad else 'are empty, '}expected inputs to decoder "
            f"layers 1..{num_layers - 1} of a {num_layers}-layer target (convention {CONVENTION})"
        )
    return ids


def engine_layer_ids(ours: Sequence[int], engine: str, *, model_type: str | None = None) -> list[int]:
    """eyas ids (input of layer i) -> the ids `engine` is configured with.

    vLLM: the same. SGLang: id k = output of layer k, so i - 1; for DeepSeek-V2/V3 recent SGLang adds
    the 1 only when the first id is 1 (older SGLang always adds it): ours starting at 2 is written
    i - 1 (right under both rules), any other first id as is (the recent rule), and a first id of 1
    cannot be expressed at all.
    """
    ours = [int(i) for i in ours]
    if engine == "vllm":
        return ours
    if engine != "sglang":
        raise ValueError(f"engine {engine!r}: expected one of {ENGINES}")
    bad = [i for i in ours if i < 1]
    if bad:
        raise EyasError(
            f"aux layer id(s) {bad} (input to layer 0 = the embeddings) cannot be written in SGLang's "
            "convention (id = output of a layer)"
        )
    if model_type in DEEPSEEK_TYPES and ours and ours[0] != 2:
        if ours[0] == 1:
            raise EyasError(
                f"aux layer ids {ours}: no SGLang id list makes its DeepSeek models capture the input of "
                "layer 1 first (a first id of 1 is shifted to 2, a first id of 0 is kept as 0); train "
                "with another low layer (the default is 2)"
            )
        return ours
    return [i - 1 for i in ours]


def eyas_layer_ids(ids: Sequence[int], engine: str, *, model_type: str | None = None) -> list[int]:
    """The inverse of `engine_layer_ids`: ids as `engine` reads them -> eyas ids (input of layer i)."""
    ids = [int(k) for k in ids]
    if engine == "vllm":
        return ids
    if engine != "sglang":
        raise ValueError(f"engine {engine!r}: expected one of {ENGINES}")
    if model_type in DEEPSEEK_TYPES and ids and ids[0] != 1:
        return ids
    return [k + 1 for k in ids]


# ----------------------------------------------------------------------------------------------
# what was read


@dataclass(kw_only=True)
class Provenance:
    """Where a drafter was read from (kept apart from the config: it does not change the model)."""

    format: str = "eyas"
    """Layout it was read from: eyas, sglang or speculators."""
    layer_ids: list[int] | None = None
    """Layer ids exactly as written in the source config (its own convention), if any."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DraftCheckpoint:
    config: DrafterConfig
    weights: dict[str, torch.Tensor]  # SGLang key names, CPU tensors; d2t int64 and t2d bool always present
    path: Path
    provenance: Provenance
