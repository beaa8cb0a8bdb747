"""Exports load in the peers' own draft classes, use every key, and give eyas's draft logits.

- SGLang layout -> SpecForge 0.2.0 `LlamaForCausalLMEagle3` (the class SpecForge trains and SGLang's
  layout is named after), through its `from_pretrained`.
- vLLM layout -> speculators 0.9.0 `Eagle3DraftModel` (the speculators format vLLM reads), through
  its `from_pretrained`.

Both packages are installed by scripts/setup.sh with --no-deps (their declared dependencies pin
other torch / SGLang versions and pull in training services). The draft classes need only what eyas
already has, except that speculators' model module imports its training-data module, which imports
`openai` and `hs_connectors` at the top without using them for the model: where those are absent the
test supplies empty placeholder modules for the import. A test whose package is missing is skipped
with the reason.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import pytest
import torch

LAYERS = [1, 3, 4]
T = 9


class _Placeholder(types.ModuleType):
    """A stand-in package: any attribute is an empty class, any submodule another placeholder."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Placeholder(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def _import_or_skip(module: str, *, placeholders: tuple[str, ...] = ()):
    """Import `module` (or skip, printing why); `placeholders` are stood in for while it imports, if absent."""
    absent = [name for name in placeholders if importlib.util.find_spec(name) is None]
    finder = _PlaceholderFinder(absent)
    sys.meta_path.append(finder)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        reason = f"{module} is not importable here ({exc}); install it with `pip install --no-deps` (scripts/setup.sh)"
        print(reason, file=sys.stderr)
        pytest.skip(reason)
    finally:
        sys.meta_path.remove(finder)
        for name in [m for m in sys.modules if m.split(".")[0] in absent]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def exported(tiny_target_dir, tmp_path_factory):
    """An eyas drafter (300-token draft vocabulary, non-trivial d2t) exported to both layouts."""
    from eyas.drafter.model import DrafterConfig, Eagle3Drafter
    from eyas.export.formats import export_drafter
    from eyas.target import load_target, model_identity

    target = load_target(tiny_target_dir)
    model = Eagle3Drafter(DrafterConfig.from_target_config(target.config, draft_vocab_size=300, aux_layer_ids=LAYERS))
    model.reset_parameters(seed=11)
    model.set_vocab(torch.arange(0, 3000, 10))
    model.init_from_target(target.get_input_embeddings().weight.detach())
    root = tmp_path_factory.mktemp("interop")
    model.save(root / "eyas", target=model_identity(tiny_target_dir))
    for fmt in ("sglang", "vllm"):
        export_drafter(root / "eyas", fmt, root / fmt)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (2, T), generator=g)
    aux = torch.randn(2, T, model.config.fc_in_features, generator=g)
    with torch.no_grad():
        _, want = model.forward_step(ids, model.project_aux(aux), torch.arange(T).expand(2, T))
    return root, model, ids, aux, want


def _file_keys(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def test_specforge_loads_the_sglang_export_with_every_key_and_equal_logits(exported):
    root, model, ids, aux, want = exported
    mod = _import_or_skip("specforge.modeling.draft.llama3_eagle")
    peer, info = mod.LlamaForCausalLMEagle3.from_pretrained(
        str(root / "sglang"), output_loading_info=True, torch_dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = peer.state_dict()
    for key, tensor in _file_keys(root / "sglang").items():  # every key written is a parameter, loaded as is
        assert torch.equal(state[key], tensor), key
    assert torch.equal(peer.d2t, model.d2t) and torch.equal(peer.t2d, model.t2d)
    # transformers 5's from_pretrained leaves SpecForge's non-persistent RoPE caches uninitialised (it builds
    # on the meta device); rebuild them from the loaded config exactly as the class's __init__ does
    peer.midlayer.self_attn._init_rope()
    with torch.no_grad():
        emb = peer.embed_input_ids(ids)
        feature = peer.project_hidden_states(aux)
        mask = mod.prepare_decoder_attention_mask(torch.ones(2, T, dtype=torch.bool), (2, T), feature, 0)
        hidden = peer.midlayer(
            input_emb=emb,
            hidden_states=feature,
            cache_hidden=None,
            attention_mask=mask,
            position_ids=torch.arange(T).expand(2, T),
        )
        got = peer.compute_logits(hidden)  # lm_head(norm(.)) over the draft vocabulary
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_speculators_loads_the_vllm_export_with_every_key_and_equal_logits(exported):
    root, model, ids, aux, want = exported
    mod = _import_or_skip("speculators.models.eagle3", placeholders=("openai", "hs_connectors"))
    peer = mod.Eagle3DraftModel.from_pretrained(str(root / "vllm"), torch_dtype=torch.float32)
    assert peer.config.norm_before_residual is False
    assert list(peer.target_layer_ids) == LAYERS  # hf-input, as written
    state = peer.state_dict()
    for key, tensor in _file_keys(root / "vllm").items():
        assert torch.equal(state[key], tensor), key
    tl = peer.config.transformer_layer_config
    tl._attn_implementation = "eager"  # flex attention is a GPU training path; eager takes a dense mask
    pos = torch.arange(T).expand(2, T)
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(2, 1, T, T)
    with torch.no_grad():
        feature = peer.fc(aux)
        x = torch.cat([peer.embed_tokens(ids), feature], dim=-1)
        cos_sin = peer.rotary_emb(x, pos)
        hidden = peer.layers[0](x, attention_mask=causal, position_ids=pos, position_embeddings=cos_sin)
        got = peer.lm_head(peer.norm(hidden))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
