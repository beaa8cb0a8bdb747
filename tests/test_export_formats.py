"""`eyas export`: every key consumed by the engine's loader, identical logits after a rebuild, right layer ids.

The two loaders below are written from the engines' sources, not from eyas's code:
- SGLang `LlamaForCausalLMEagle3.load_weights` (python/sglang/srt/models/llama_eagle3.py): `d2t` becomes
  hot_token_id (+ arange), `t2d` is skipped; `.q_proj/.k_proj/.v_proj` -> `.qkv_proj` and
  `.gate_proj/.up_proj` -> `.gate_up_proj`; the name is used as is if it is a parameter, else with a
  `model.` prefix; anything still unknown is SILENTLY skipped (so the test must catch it).
- vLLM `Eagle3LlamaForCausalLM.load_weights` (vllm/model_executor/models/llama_eagle3.py): `t2d` skipped,
  `d2t` -> `draft_id_to_target_id`, names without `lm_head` get `model.`; then the inner model renames
  `midlayer.` -> `layers.0.` and stacks q/k/v and gate/up like SGLang; an unknown name is a KeyError.
The layer-id rules: SGLang captures `hidden_states + residual` before layer k + 1 for each id k
(`set_eagle3_layers_to_capture`: `[val + 1 for val in layer_ids]`), i.e. HF hidden_states[k + 1];
vLLM captures before layer i for each id i (`aux_hidden_state_layers`), i.e. HF hidden_states[i].
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from eyas.cli import app
from eyas.drafter.reader import read_drafter as load_draft_checkpoint
from eyas.specdec.functional import FunctionalDrafter

LAYERS = [1, 3, 4]
STACKED = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]
LAYER_PARAMS = [
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "hidden_norm.weight",
]
SGLANG_PARAMS = {
    "model.embed_tokens.weight",
    "model.fc.weight",
    "model.norm.weight",
    "lm_head.weight",
    *(f"model.midlayer.{p}" for p in LAYER_PARAMS),
}
VLLM_PARAMS = {
    "model.embed_tokens.weight",
    "model.fc.weight",
    "model.norm.weight",
    "lm_head.weight",
    "draft_id_to_target_id",
    *(f"model.layers.0.{p}" for p in LAYER_PARAMS),
}


def sglang_load(names):
    """-> (params loaded with their shard ids, names skipped silently)."""
    loaded, skipped = {}, []
    for name in names:
        if "d2t" in name:
            loaded["hot_token_id"] = [None]
            continue
        if "t2d" in name:
            continue
        for param, shard, sid in STACKED:
            if shard in name:
                name = name.replace(shard, param)
                target = name if name in SGLANG_PARAMS else f"model.{name}"
                (loaded.setdefault(target, []).append(sid) if target in SGLANG_PARAMS else skipped.append(name))
                break
        else:
            target = name if name in SGLANG_PARAMS else f"model.{name}"
            (loaded.setdefault(target, []).append(None) if target in SGLANG_PARAMS else skipped.append(name))
    return loaded, skipped


def vllm_load(names):
    loaded = {}
    for name in names:
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        for param, shard, sid in STACKED:  # noqa: B007 (sid is read after the loop)
            if shard in name:
                name = name.replace(shard, param)
                break
        else:
            sid = None
        if name not in VLLM_PARAMS:
            raise KeyError(name)  # vLLM: params_dict[name]
        loaded.setdefault(name, []).append(sid)
    return loaded


def _shards_complete(loaded, params):
    assert set(loaded) == params, (set(params) - set(loaded), set(loaded) - set(params))
    for name, shards in loaded.items():
        want = ["q", "k", "v"] if "qkv_proj" in name else [0, 1] if "gate_up" in name else [None]
        assert sorted(map(str, shards)) == sorted(map(str, want)), name


@pytest.fixture(scope="module")
def eyas_drafter(tiny_target_dir, tmp_path_factory):
    from eyas.drafter.model import DrafterConfig, Eagle3Drafter
    from eyas.target import load_target, model_identity

    target = load_target(tiny_target_dir)
    cfg = DrafterConfig.from_target_config(target.config, draft_vocab_size=300, aux_layer_ids=LAYERS)
    model = Eagle3Drafter(cfg)
    model.reset_parameters(seed=7)
    model.set_vocab(torch.arange(0, 3000, 10))
    model.init_from_target(target.get_input_embeddings().weight.detach())
    out = tmp_path_factory.mktemp("eyas_drafter")
    model.save(out, target=model_identity(tiny_target_dir))
    return out, model, target


def _export(src, fmt, out, *extra):
    res = CliRunner().invoke(app, ["export", "--drafter", str(src), "--format", fmt, "--out", str(out), *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


def _logits(drafter: FunctionalDrafter, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, drafter.config.vocab_size, (2, 9), generator=g)
    aux = torch.randn(2, 9, len(drafter.config.aux_layer_ids) * drafter.config.target_hidden_size, generator=g)
    out, _, _ = drafter.causal_forward(ids, drafter.fuse(aux), torch.arange(9).expand(2, 9) + 5)
    return drafter.logits(out), ids, aux


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_export_is_loadable_equivalent_and_captures_the_trained_layers(eyas_drafter, tmp_path, fmt):
    src, model, target = eyas_drafter
    summary = _export(src, fmt, tmp_path / fmt)
    out = tmp_path / fmt
    config = json.loads((out / "config.json").read_text())
    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))

    # 1. the engine's loader consumes every key and fills every parameter (each q/k/v and gate/up shard)
    if fmt == "sglang":
        loaded, skipped = sglang_load(weights)
        assert skipped == []
        _shards_complete({k: v for k, v in loaded.items() if k != "hot_token_id"}, SGLANG_PARAMS)
        assert "hot_token_id" in loaded
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["tie_word_embeddings"] is False
        assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 300 and config["vocab_size"] == 49152
    else:
        _shards_complete(vllm_load(weights), VLLM_PARAMS)
        assert config["architectures"] == ["Eagle3Speculator"] and config["speculators_model_type"] == "eagle3"
        assert config["norm_before_residual"] is False  # vLLM's reader would default it to True
        spec_cfg = config["speculators_config"]
        recorded = json.loads((src / "config.json").read_text())["target"]["path"]
        assert spec_cfg["verifier"]["name_or_path"] == recorded  # no Hub id known: the local path, with a warning
        assert config["eyas_verifier_path"] == recorded
        assert spec_cfg["verifier"]["architectures"] == ["LlamaForCausalLM"]
        assert spec_cfg["proposal_methods"][0]["speculative_tokens"] >= 1 and spec_cfg["algorithm"] == "eagle3"
        assert config["transformer_layer_config"]["num_hidden_layers"] == 1

    # 2. the Llama part parses with transformers as the engines do, to the drafter's shape
    from transformers import LlamaConfig

    llama = LlamaConfig.from_dict(config if fmt == "sglang" else config["transformer_layer_config"])
    assert (llama.hidden_size, llama.num_attention_heads, llama.num_key_value_heads, llama.intermediate_size) == (
        model.config.hidden_size,
        model.config.num_attention_heads,
        model.config.num_key_value_heads,
        model.config.intermediate_size,
    )
    assert llama.rope_parameters["rope_theta"] == pytest.approx(model.config.rope_parameters["rope_theta"])

    # 3. the ids written select the very tensors the drafter was trained on
    written = (
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        if fmt == "sglang"
        else config["eagle_aux_hidden_state_layer_ids"]
    )
    assert summary["aux_layer_ids_written"] == written
    captured_before = [k + 1 for k in written] if fmt == "sglang" else list(written)  # the engine's capture rule
    ids = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
    from eyas.target import forward_capture

    trained, _ = forward_capture(target, ids, None, layer_ids=model.config.aux_layer_ids)
    for a, layer in enumerate(captured_before):
        torch.testing.assert_close(hs[layer], trained[:, :, a], rtol=0, atol=0)

    # 4. rebuilt from the exported directory alone: identical logits
    original = FunctionalDrafter(*_spec_weights(src))
    rebuilt_ckpt = load_draft_checkpoint(out)
    assert rebuilt_ckpt.provenance.format == ("sglang" if fmt == "sglang" else "speculators")
    assert rebuilt_ckpt.config.aux_layer_ids == LAYERS
    rebuilt = FunctionalDrafter(rebuilt_ckpt.config, rebuilt_ckpt.weights)
    want, ids2, aux2 = _logits(original)
    got, _, _ = _logits(rebuilt)
    assert torch.equal(want, got)
    # ... and the training model agrees with both
    with torch.no_grad():
        _, ref = model.forward_step(ids2, model.project_aux(aux2), torch.arange(9).expand(2, 9) + 5)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(rebuilt_ckpt.weights["d2t"], model.d2t) and torch.equal(rebuilt_ckpt.weights["t2d"], model.t2d)


def _spec_weights(path):
    ck = load_draft_checkpoint(path)
    return ck.config, ck.weights


def test_export_refuses_an_existing_directory(eyas_drafter, tmp_path):
    src, _, _ = eyas_drafter
    out = tmp_path / "x"
    out.mkdir()
    res = CliRunner().invoke(app, ["export", "--drafter", str(src), "--format", "sglang", "--out", str(out)])
    assert res.exit_code == 2 and "--overwrite" in res.output
    _export(src, "sglang", out, "--overwrite")
    assert (out / "model.safetensors").is_file()


def test_export_overwrite_through_a_symlink_replaces_the_linked_export(eyas_drafter, tmp_path):
    """--out is a link to an earlier export: --overwrite rewrites the export it points to and keeps the link."""
    src, _, _ = eyas_drafter
    _export(src, "sglang", tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    _export(src, "sglang", tmp_path / "link", "--overwrite", "--weights-dtype", "bfloat16")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "link").resolve() == (tmp_path / "real").resolve()
    assert json.loads((tmp_path / "real" / "eyas_export.json").read_text())["dtype"] == "bfloat16"


def test_export_converts_between_engine_layouts_and_casts(eyas_drafter, tmp_path):
    src, model, _ = eyas_drafter
    _export(src, "sglang", tmp_path / "sgl", "--weights-dtype", "bfloat16")
    summary = _export(tmp_path / "sgl", "vllm", tmp_path / "vllm")  # SGLang layout in, speculators out
    assert summary["aux_layer_ids_written"] == LAYERS and summary["dtype"] == "bfloat16"
    a, b = load_draft_checkpoint(tmp_path / "sgl"), load_draft_checkpoint(tmp_path / "vllm")
    assert a.config.aux_layer_ids == b.config.aux_layer_ids == LAYERS
    for k in a.weights:
        assert torch.equal(a.weights[k], b.weights[k]), k
    assert a.weights["fc.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(a.weights["fc.weight"].float(), model.fc.weight, rtol=1e-2, atol=1e-3)


def test_bad_format_and_unknown_keys(eyas_drafter, tmp_path):
    src, _, _ = eyas_drafter
    res = CliRunner().invoke(app, ["export", "--drafter", str(src), "--format", "trtllm", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--format" in res.output
    # a foreign checkpoint with a wrong prefix must not load as random weights
    _export(src, "sglang", tmp_path / "sgl")
    from safetensors.torch import load_file, save_file

    w = load_file(str(tmp_path / "sgl" / "model.safetensors"))
    w["midlayers.0.mlp.down_proj.weight"] = w.pop("midlayer.mlp.down_proj.weight")
    save_file(w, str(tmp_path / "sgl" / "model.safetensors"))
    res = CliRunner().invoke(
        app, ["export", "--drafter", str(tmp_path / "sgl"), "--format", "vllm", "--out", str(tmp_path / "v")]
    )
    assert res.exit_code == 2 and "midlayers.0.mlp.down_proj.weight" in res.output


def test_export_refuses_a_drafter_the_engines_cannot_size(tiny_target_dir, tmp_path):
    """Both engines build fc for exactly 3 aux layers; a 2-layer drafter would fail to load there."""
    from eyas.drafter.model import DrafterConfig, Eagle3Drafter
    from eyas.target import load_target

    target = load_target(tiny_target_dir)
    model = Eagle3Drafter(DrafterConfig.from_target_config(target.config, draft_vocab_size=100, aux_layer_ids=[2, 4]))
    model.save(tmp_path / "d")
    res = CliRunner().invoke(
        app, ["export", "--drafter", str(tmp_path / "d"), "--format", "vllm", "--out", str(tmp_path / "o")]
    )
    assert res.exit_code == 2 and "exactly 3" in res.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("ours, written", [([2, 30, 58], [1, 29, 57]), ([3, 30, 58], [3, 30, 58])])
def test_deepseek_ids_follow_sglangs_deepseek_rule(ours, written):
    """SGLang's DeepSeek-V2/V3: `if layer_ids[0] == 1: +1 else as is` (deepseek_v2.py set_eagle3_layers_to_capture)."""
    from eyas.drafter.layouts import engine_layer_ids, eyas_layer_ids

    assert engine_layer_ids(ours, "sglang", model_type="deepseek_v3") == written
    captured = [k + 1 for k in written] if written[0] == 1 else written  # the engine's rule
    assert captured == ours
    assert eyas_layer_ids(written, "sglang", model_type="deepseek_v3") == ours
    assert engine_layer_ids(ours, "sglang", model_type="llama") == [i - 1 for i in ours]  # other models: always + 1
    assert eyas_layer_ids([i - 1 for i in ours], "sglang", model_type="llama") == ours


def test_deepseek_first_layer_one_is_refused():
    from eyas.drafter.layouts import engine_layer_ids
    from eyas.errors import EyasError

    with pytest.raises(EyasError, match="layer 1 first"):
        engine_layer_ids([1, 30, 58], "sglang", model_type="deepseek_v3")


def test_vllm_verifier_is_a_hub_id_and_the_local_path_is_kept(eyas_drafter, tmp_path):
    """`vllm serve <export>` serves speculators_config.verifier.name_or_path: it must be a Hub repository id."""
    src, _, _ = eyas_drafter
    recorded = json.loads((src / "config.json").read_text())["target"]["path"]
    _export(src, "vllm", tmp_path / "a", "--verifier", "HuggingFaceTB/SmolLM2-135M-Instruct")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert cfg["eyas_verifier_path"] is None
    # a local target directory: the id comes from its config's _name_or_path, the path is kept beside it
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps({"_name_or_path": "org/model-1.5B", "architectures": ["Qwen2ForCausalLM"]})
    )
    _export(src, "vllm", tmp_path / "b", "--verifier", str(target))
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"] == {
        "name_or_path": "org/model-1.5B",
        "architectures": ["Qwen2ForCausalLM"],
    }
    assert cfg["eyas_verifier_path"] == str(target.resolve()) != recorded
    res = CliRunner().invoke(
        app,
        [
            "export",
            "--drafter",
            str(src),
            "--format",
            "vllm",
            "--out",
            str(tmp_path / "c"),
            "--verifier",
            "not a/valid id",
        ],
    )
    assert res.exit_code == 2 and "--verifier" in res.output

    # an existing directory without config.json is no verifier: refused before the drafter is read
    empty = tmp_path / "empty"
    empty.mkdir()
    res = CliRunner().invoke(
        app,
        ["export", "--drafter", str(src), "--format", "vllm", "--out", str(tmp_path / "d"), "--verifier", str(empty)],
    )
    assert res.exit_code == 2 and "a directory without config.json" in res.output and "OWNER/NAME" in res.output
    assert not (tmp_path / "d").exists()
    from eyas.errors import EyasError
    from eyas.export.formats import export_drafter

    with pytest.raises(EyasError, match="a directory without config.json"):
        export_drafter(src, "vllm", tmp_path / "d", verifier=str(empty))


@pytest.mark.parametrize(
    "option, value, field", [("--verifier", "foo/bar", "verifier"), ("--speculative-tokens", "3", "speculative_tokens")]
)
def test_vllm_only_options_are_refused_with_another_format(eyas_drafter, tmp_path, option, value, field):
    """Only the vllm format reads them: given with sglang they are refused (CLI and [export]), not dropped."""
    from eyas.errors import EyasError
    from eyas.pipeline import ExportOptions

    src, _, _ = eyas_drafter
    res = CliRunner().invoke(
        app, ["export", "--drafter", str(src), "--format", "sglang", "--out", str(tmp_path / "o"), option, value]
    )
    assert res.exit_code == 2 and f"{option} only applies to --format vllm" in res.output
    assert "--format sglang" in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
    typed = int(value) if field == "speculative_tokens" else value
    with pytest.raises(
        EyasError,
        match=rf"^{field} {typed!r}: only applies to the vllm format, and formats = "
        rf"\['sglang'\]; add \"vllm\" to formats or drop {field}$",
    ):
        ExportOptions(formats=["sglang"], **{field: typed})
    assert getattr(ExportOptions(formats=["sglang", "vllm"], **{field: typed}), field) == typed


def test_speculative_tokens_default_to_5_in_the_vllm_export(eyas_drafter, tmp_path):
    """Left out, the vllm export writes 5; given, its value; the sglang export needs none."""
    src, _, _ = eyas_drafter
    _export(src, "sglang", tmp_path / "s")  # not given: nothing to refuse
    for out, extra, n in ((tmp_path / "v5", [], 5), (tmp_path / "v3", ["--speculative-tokens", "3"], 3)):
        _export(src, "vllm", out, *extra)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == n


def test_export_refuses_a_training_runs_drafter_folder(eyas_drafter, tmp_path):
    """`train`'s <out>/drafter has no marker of its own but is eyas's: refused as part of the run, not as the user's."""
    import shutil

    from eyas.common import write_marker

    src, _, _ = eyas_drafter
    run = tmp_path / "run"
    shutil.copytree(src, run / "drafter")
    (run / "metrics.jsonl").write_text('{"step": 2}\n')
    write_marker(run, kind="train")
    before = {p.name: p.read_bytes() for p in (run / "drafter").iterdir()}
    for extra in ([], ["--overwrite"]):
        res = CliRunner().invoke(
            app,
            ["export", "--drafter", str(run / "drafter"), "--format", "sglang", "--out", str(run / "drafter"), *extra],
        )
        assert res.exit_code == 2, res.output
        assert "is the `drafter` folder of the eyas `train` output" in res.output
        assert "did not create" not in res.output and len(res.output.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in (run / "drafter").iterdir()} == before


def test_full_vocabulary_drafter_exports_without_vocab_maps(tiny_target_dir, tmp_path):
    """Draft vocab == target vocab: SGLang leaves hot_token_id None, vLLM has no draft_id_to_target_id."""
    from safetensors.torch import load_file

    from eyas.drafter.model import DrafterConfig, Eagle3Drafter
    from eyas.target import load_target

    target = load_target(tiny_target_dir)
    vocab = target.config.vocab_size
    model = Eagle3Drafter(DrafterConfig.from_target_config(target.config, draft_vocab_size=vocab, aux_layer_ids=LAYERS))
    model.reset_parameters(seed=1)
    model.save(tmp_path / "d")
    for fmt in ("sglang", "vllm"):
        summary = _export(tmp_path / "d", fmt, tmp_path / fmt)
        weights = load_file(str(tmp_path / fmt / "model.safetensors"))
        assert summary["full_vocab"] is True and "d2t" not in weights and "t2d" not in weights
        if fmt == "sglang":
            loaded, skipped = sglang_load(weights)
            assert skipped == [] and "hot_token_id" not in loaded
        else:
            _shards_complete(vllm_load(weights), VLLM_PARAMS - {"draft_id_to_target_id"})
        back = load_draft_checkpoint(tmp_path / fmt)  # read back: the identity map is restored
        assert not back.weights["d2t"].any() and bool(back.weights["t2d"].all())
