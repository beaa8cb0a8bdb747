"""lab/variants/eagle31.py: EAGLE-3.1 patched into eyas for one run.

Checked against a re-implementation of SGLang 0.5.17's LlamaForCausalLMEagle3 written from its source
(`SGLangDraft` below), fed the SGLang export: the training unroll (padded and packed), the model's own drafting
steps and eval's decoding drafter give SGLang's logits step by step. Also: the export's config keys and weights,
a pipeline run through the entry point (trains, evaluates, exports) on regenerate/prepare folders copied
from another workdir, and eyas unchanged once the patch is undone.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from eyas.drafter.model import DrafterCache, DrafterConfig, Eagle3Drafter
from eyas.errors import EyasError
from lab.tests.conftest import smoke_sets, variant_pipeline
from lab.variants import eagle31
from lab.variants.eagle31 import Variant, patched

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS = [Variant(), Variant(fc_norm="concat"), Variant(fc_norm=None), Variant(norm_output=False)]
T, K = 12, 3  # tokens of the test sequence, draft steps compared
AUX_SCALES = (0.05, 1.0, 20.0)  # the low/mid/high states at very different scales: the fc norms matter


# ----------------------------------------------------------------------------- SGLang, re-implemented


class SGLangDraft:
    """SGLang 0.5.17's LlamaForCausalLMEagle3 (sglang/srt/models/llama_eagle3.py) on one sequence, in float64:

    - config: `fc_norm` or `use_aux_norm` (top level) -> one RMSNorm(target_hidden_size) per aux state;
      `norm_before_fc` (eagle_config first, then top level) -> one RMSNorm over the concatenation; `norm_output`;
      the aux count from `num_aux_hidden_states`, else eagle_config's layer ids, else 3;
    - weights as `load_weights` names them: `midlayer` -> `layers.0`, `aux_norm_low|mid|high` -> `fc_norm.0|1|2`,
      `d2t` -> hot token ids, `t2d` dropped, a norm the config builds but the file lacks stays at ones;
    - LlamaModel.forward: a state wider than the embedding (the target's) goes through input_norm, then fc_norm per
      chunk, then fc; the first decoder layer: residual = that feature, cat(input_layernorm(embed),
      hidden_norm(feature)), attention with RoPE (neox), post_attention_layernorm as add-then-norm, the MLP, then
      `norm(hidden, residual)`: add, then norm; logits from the normed sum, and the state handed to the next step
      is the normed sum under norm_output, else the sum.
    `forward` extends a key/value cache: each new token attends to every cached key and the new ones up to itself.
    """

    LEGACY = {
        "midlayer": "layers.0",
        "aux_norm_low": "fc_norm.0",
        "aux_norm_mid": "fc_norm.1",
        "aux_norm_high": "fc_norm.2",
    }

    def __init__(self, export_dir: Path, **flags):
        cfg = json.loads((export_dir / "config.json").read_text())
        eagle = cfg.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        self.A = cfg.get("num_aux_hidden_states") or (len(ids) if ids else 3)
        self.norm_before_fc = bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False)))
        self.fc_norm = bool(cfg.get("fc_norm") or cfg.get("use_aux_norm", False))
        self.norm_output = bool(cfg.get("norm_output", False))
        for name, value in flags.items():  # what SGLang would compute had the config said otherwise
            setattr(self, name, value)
        self.eps, self.H, self.KV = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.d = cfg.get("head_dim") or cfg["hidden_size"] // self.H
        self.inv_freq = 1.0 / cfg["rope_theta"] ** (torch.arange(0, self.d, 2, dtype=torch.float64) / self.d)
        width = cfg.get("target_hidden_size") or cfg["hidden_size"]
        self.p: dict[str, torch.Tensor] = {}
        for name, t in load_file(str(export_dir / "model.safetensors")).items():
            for legacy, new in self.LEGACY.items():
                if legacy in name:
                    name = name.replace(legacy, new)
            if "d2t" in name:
                self.hot_token_id = t + torch.arange(t.shape[0])
                continue
            if "t2d" in name:
                continue
            self.p[name.removeprefix("model.")] = t.double()
        if self.norm_before_fc:
            self.p.setdefault("input_norm.weight", torch.ones(self.A * width, dtype=torch.float64))
        if self.fc_norm:
            for i in range(self.A):
                self.p.setdefault(f"fc_norm.{i}.weight", torch.ones(width, dtype=torch.float64))
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def rope(self, x, pos):  # x [n, heads, d]
        f = pos[:, None].double() * self.inv_freq
        cos, sin = torch.cat([f.cos(), f.cos()], -1)[:, None], torch.cat([f.sin(), f.sin()], -1)[:, None]
        half = self.d // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def forward(self, ids, pos, hidden):
        """ids [n], pos [n], hidden [n, A*Dt] (the target's states) or [n, D] (the last step's) -> (logits, state)."""
        p, L, n = self.p, "layers.0.", ids.shape[0]
        embeds = p["embed_tokens.weight"][ids]
        if hidden.shape[-1] != embeds.shape[-1]:
            if self.norm_before_fc:
                hidden = self.rms(hidden, p["input_norm.weight"])
            if self.fc_norm:
                hidden = torch.cat(
                    [self.rms(c, p[f"fc_norm.{i}.weight"]) for i, c in enumerate(hidden.chunk(self.A, dim=-1))], -1
                )
            hidden = hidden @ p["fc.weight"].T
        residual = hidden
        x = torch.cat(
            [self.rms(embeds, p[L + "input_layernorm.weight"]), self.rms(hidden, p[L + "hidden_norm.weight"])], -1
        )
        q = (x @ p[L + "self_attn.q_proj.weight"].T).view(n, self.H, self.d)
        k = (x @ p[L + "self_attn.k_proj.weight"].T).view(n, self.KV, self.d)
        v = (x @ p[L + "self_attn.v_proj.weight"].T).view(n, self.KV, self.d)
        q, k = self.rope(q, pos), self.rope(k, pos)
        self.keys.append(k)
        self.values.append(v)
        ks = torch.cat(self.keys).repeat_interleave(self.H // self.KV, dim=1)
        vs = torch.cat(self.values).repeat_interleave(self.H // self.KV, dim=1)
        S = ks.shape[0]
        scores = torch.einsum("nhd,shd->hns", q, ks) / math.sqrt(self.d)
        scores = scores.masked_fill(~torch.ones(n, S, dtype=torch.bool).tril(S - n), float("-inf"))
        o = torch.einsum("hns,shd->nhd", scores.softmax(-1), vs).reshape(n, self.H * self.d)
        residual = o @ p[L + "self_attn.o_proj.weight"].T + residual
        x = self.rms(residual, p[L + "post_attention_layernorm.weight"])
        mlp = (F.silu(x @ p[L + "mlp.gate_proj.weight"].T) * (x @ p[L + "mlp.up_proj.weight"].T)) @ p[
            L + "mlp.down_proj.weight"
        ].T
        residual = mlp + residual
        to_logits = self.rms(residual, p["norm.weight"])
        return to_logits @ p["lm_head.weight"].T, (to_logits if self.norm_output else residual)

    def chain(self, ids, aux_TF, t: int, steps: int) -> torch.Tensor:
        """[steps, V] logits of drafting after position t: the draft extend over positions 0..t (tokens x_1..x_{t+1}
        with the target's states), then one token a step (x_{t+1+k} at position t+k) fed the state it returned."""
        self.keys, self.values = [], []
        logits, state = self.forward(ids[1 : t + 2], torch.arange(t + 1), aux_TF[: t + 1].double())
        out, state = [logits[t]], state[t : t + 1]
        for k in range(1, steps):
            logits, state = self.forward(ids[t + 1 + k : t + 2 + k], torch.tensor([t + k]), state)
            out.append(logits[0])
        return torch.stack(out)


# ----------------------------------------------------------------------------- eyas, each path


def make_drafter(seed: int = 0) -> Eagle3Drafter:
    """A small drafter (target width 24 != draft width 32, 40 of 60 ids) with every weight random, norms included."""
    cfg = DrafterConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=60,
        draft_vocab_size=40,
        target_hidden_size=24,
        aux_layer_ids=[1, 2, 3],
        target_num_layers=6,
        rms_norm_eps=1e-5,
    )
    m = Eagle3Drafter(cfg)
    m.reset_parameters(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    m.set_vocab(torch.sort(torch.randperm(60, generator=g)[:40]).values)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2 and name != "embed_tokens.weight":
                p.mul_(10)  # larger than the init: attention patterns matter
            elif p.dim() == 1:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return m.eval()


def inputs(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 60, (T,), generator=g)
    aux = torch.randn(T, 3, 24, generator=g) * torch.tensor(AUX_SCALES)[:, None]
    return ids, aux


def ttt_logits(m, ids, aux) -> torch.Tensor:
    """[K, T, V] the padded training unroll's logits."""
    from eyas.drafter.ttt import ttt_unroll

    return torch.stack(
        [m.compute_logits(h)[0] for _, h in ttt_unroll(m, ids[None], aux[None], steps=K, attention="reference")]
    )


def packed_logits(m, ids, aux) -> torch.Tensor:
    """[K, T, V] the packed unroll's logits (the path `eyas train` runs)."""
    from eyas.drafter.ttt import PackedUnroll
    from eyas.packing import Segments

    u = PackedUnroll(m, ids, Segments.from_lengths([T]), aux, steps=K)
    return torch.stack([m.compute_logits(u.step(k))[0] for k in range(K)])


def model_chain(m, ids, aux, t) -> torch.Tensor:
    """[K, V] Eagle3Drafter.forward_step with a cache, fed its own returned state."""
    cache = DrafterCache()
    h, logits = m.forward_step(
        ids[None, 1 : t + 2], m.project_aux(aux[None, : t + 1]), torch.arange(t + 1)[None], cache=cache
    )
    out, h = [logits[0, t]], h[:, t : t + 1]
    for k in range(1, K):
        h, logits = m.forward_step(ids[None, t + 1 + k : t + 2 + k], h, torch.tensor([[t + k]]), cache=cache)
        out.append(logits[0, 0])
    return torch.stack(out)


def functional_chain(fd, ids, aux_TF, t) -> torch.Tensor:
    """[K, V] eval's FunctionalDrafter: step 0 over the prefix, then one draft token a step."""
    out0, keys, values = fd.step0(ids[None, : t + 2], aux_TF[None, : t + 2])
    out, feat = [fd.logits(out0[0, t])], out0[:, t : t + 1]
    for k in range(1, K):
        q, kk, vv, res = fd.qkv(ids[None, t + 1 + k : t + 2 + k], feat, torch.tensor([[t + k]]))
        keys, values = torch.cat([keys, kk], 2), torch.cat([values, vv], 2)
        feat = fd.finish(fd.attend(q, keys, values), res)
        out.append(fd.logits(feat[0, 0]))
    return torch.stack(out)


def export(m, tmp: Path, fmt: str = "sglang") -> Path:
    from eyas.export.formats import export_drafter

    if not (tmp / "eyas" / "config.json").exists():
        m.save(tmp / "eyas")
    export_drafter(tmp / "eyas", fmt, tmp / fmt)
    return tmp / fmt


def _close(got, want):
    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "variant",
    [None, *VARIANTS],
    ids=lambda v: (
        "eagle3" if v is None else f"{v.fc_norm or 'no-fc-norm'}-{'norm-output' if v.norm_output else 'prenorm'}"
    ),
)
def test_every_eyas_path_computes_what_sglang_serves_from_the_export(variant, tmp_path):
    """Training (padded and packed unroll), the model's drafting steps and eval's decoding drafter read from the
    SGLang export give, step by step, the logits of SGLang's forward on that export (unpatched eyas: plain EAGLE-3,
    which calibrates the re-implementation); the variant's function differs from EAGLE-3's on the same weights."""
    from eyas.drafter.reader import read_drafter
    from eyas.specdec.functional import FunctionalDrafter

    ids, aux = inputs()
    aux_TF = aux.flatten(-2)
    with patched(variant) if variant else contextlib.nullcontext(), torch.no_grad():
        m = make_drafter()
        sgl = export(m, tmp_path)
        ttt, packed = ttt_logits(m, ids, aux), packed_logits(m, ids, aux)
        ckpt = read_drafter(sgl)
        fd = FunctionalDrafter(ckpt.config, ckpt.weights)
        ours = {t: (model_chain(m, ids, aux, t), functional_chain(fd, ids, aux_TF, t)) for t in (0, 4, 8)}
    ref = SGLangDraft(sgl)
    assert (ref.fc_norm, ref.norm_before_fc, ref.norm_output) == (
        (False, False, False)
        if variant is None
        else (variant.fc_norm == "per-aux", variant.fc_norm == "concat", variant.norm_output)
    )
    for t, (chain, functional) in ours.items():
        want = ref.chain(ids, aux_TF, t, K)
        for k in range(K):
            _close(ttt[k, t], want[k])
            _close(packed[k, t], want[k])
        _close(chain, want)
        _close(functional, want)
        if variant is not None:  # the same weights through EAGLE-3: another function
            plain = SGLangDraft(sgl, fc_norm=False, norm_before_fc=False, norm_output=False).chain(ids, aux_TF, t, K)
            assert not torch.allclose(plain, want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v.fc_norm}-{v.norm_output}")
def test_eyas_own_equivalences_hold_under_the_patch(variant):
    """The product's tests of the training path, run on patched drafters: the unroll equals drafting with a cache,
    the fast attention's loss and gradients equal the reference's, and the packed loss and gradients (the variant's
    norms included) equal the padded reference's."""
    from tests import test_drafter_ttt, test_train_packed

    with patched(variant):
        test_drafter_ttt.test_unroll_equals_chain_drafting_with_a_cache()
        test_drafter_ttt.test_fast_and_reference_loss_and_grads_agree()
        test_train_packed.test_packed_loss_and_grads_equal_padded_reference("fast", 0)
        test_train_packed.test_packed_loss_and_grads_equal_padded_reference("reference", 1 << 20)


def test_compiled_training_step_equals_the_eager_one():
    """`compile_drafter` (what `eyas train` does on CUDA) compiles the patched pieces (finish with the final norm,
    the head on normed states, the rows' selection): the packed loss and every gradient, the fc norms' included,
    equal the eager drafter's."""
    from eyas.drafter.ttt import TTTConfig, live_positions, packed_teacher, supervised_rows, ttt_loss_packed
    from eyas.drafter.ttt.unroll import compile_drafter
    from eyas.packing import Segments

    g = torch.Generator().manual_seed(5)
    lengths = [9, 14, 6]
    seg = Segments.from_lengths(lengths)
    N = seg.total
    ids = torch.randint(0, 60, (N,), generator=g)
    mask = torch.rand(N, generator=g) > 0.3
    aux = torch.randn(N, 3, 24, generator=g) * torch.tensor(AUX_SCALES)[:, None]
    final, head = torch.randn(N, 32, generator=g), torch.randn(60, 32, generator=g) * 0.7
    rows = supervised_rows(mask, seg.ends_N, K)
    out = {}
    with patched():
        for compiled in (False, True):
            m = make_drafter().train()
            used = m.used_target_ids()
            t2d = m.t2d.clone()
            if compiled:
                compile_drafter(m)
            teacher = packed_teacher(final, head, head[used], used, t2d)
            o = ttt_loss_packed(
                m,
                input_ids_N=ids,
                seg=seg,
                rows=rows,
                aux_NAD=aux,
                teacher=teacher,
                cfg=TTTConfig(steps=K),
                denominators=torch.tensor([float(len(r)) for r in rows]),
                live=live_positions(rows, N),
            )
            o.loss.backward()
            out[compiled] = (
                o.loss.detach(),
                {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None},
            )
    (l0, g0), (l1, g1) = out[False], out[True]
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
    assert set(g0) == set(g1) and {f"fc_norm.{i}.weight" for i in range(3)} | {"norm.weight"} <= set(g0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-4, rtol=1e-4, msg=n)


@pytest.mark.parametrize("variant", [Variant(), Variant(fc_norm="concat")], ids=["per-aux", "concat"])
def test_exports_carry_the_config_keys_and_norm_weights_the_engines_read(variant, tmp_path):
    with patched(variant):
        m = make_drafter()
        sgl, vllm = export(m, tmp_path, "sglang"), export(m, tmp_path, "vllm")
    want = {f"fc_norm.{i}.weight" for i in range(3)} if variant.fc_norm == "per-aux" else {"input_norm.weight"}
    for fmt, out in (("sglang", sgl), ("speculators", vllm)):
        cfg = json.loads((out / "config.json").read_text())
        assert eagle31.engine_flags(cfg, fmt) == variant.engine_fields()
        assert {k: cfg[k] for k in ("fc_norm", "norm_before_fc", "norm_output")} == variant.engine_fields()
        w = load_file(str(out / "model.safetensors"))
        assert want <= set(w) and not ({"fc_norm.0.weight", "input_norm.weight"} - want) & set(w)
        for k in want:
            assert torch.equal(w[k], m.state_dict()[k].float()), k
        assert want <= set(json.loads((out / "eyas_export.json").read_text())["weights"]["keys"])
    assert json.loads((tmp_path / "eyas" / "config.json").read_text())["lab_variant"] == variant.marker()
    cfg = json.loads((sgl / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["target_hidden_size"] == 24
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert w[next(iter(want))].shape == ((24,) if variant.fc_norm == "per-aux" else (72,))


def _patch_targets():
    from eyas import pipeline
    from eyas.drafter import reader, writer
    from eyas.drafter.model import Eagle3Drafter, MidLayer
    from eyas.drafter.ttt import unroll
    from eyas.specdec.functional import FunctionalDrafter

    owners = {
        "Eagle3Drafter": Eagle3Drafter,
        "MidLayer": MidLayer,
        "FunctionalDrafter": FunctionalDrafter,
        "reader": reader,
        "writer": writer,
        "unroll": unroll,
        "pipeline": pipeline,
    }
    names = {
        "Eagle3Drafter": ("__init__", "project_aux", "compute_logits"),
        "MidLayer": ("finish",),
        "FunctionalDrafter": ("fuse", "finish", "logits"),
        "unroll": ("normed_rows",),
        "pipeline": ("fingerprint",),
        "reader": ("canonical_weights", "check_shapes", "_eyas_config", "_config_from_sglang", "_speculators_layer"),
        "writer": ("write_eyas", "sglang_config", "vllm_config"),
    }
    return {(o, n): owners[o].__dict__[n] for o, ns in names.items() for n in ns}


def test_the_patch_is_undone_and_each_eyas_refuses_the_others_drafters(tmp_path):
    """After the block (also one that raised) every patched attribute is the original object again, and a new
    drafter is plain EAGLE-3; the unpatched eyas refuses the variant's drafters (unknown weights), the patched one
    refuses plain drafters and those of another variant; patches do not nest."""
    from eyas import pipeline
    from eyas.drafter.reader import read_drafter

    before = _patch_targets()
    plain_keys = set(make_drafter().state_dict())
    fp = pipeline.fingerprint("train", pipeline.ExportOptions(), "in")
    with patched() as v:
        assert eagle31.active() == v
        assert _patch_targets() != before
        assert pipeline.fingerprint("train", pipeline.ExportOptions(), "in") != fp
        original = before[("pipeline", "fingerprint")]
        assert pipeline.fingerprint("eval", pipeline.ExportOptions(), "in") == original(
            "eval", pipeline.ExportOptions(), "in"
        )  # (eval and export follow the train stage's fingerprint)
        with pytest.raises(RuntimeError, match="already patched"), patched():
            pass
        m = make_drafter()
        assert set(m.state_dict()) == plain_keys | {f"fc_norm.{i}.weight" for i in range(3)}
        sgl = export(m, tmp_path / "variant")
    with pytest.raises(ValueError, match="boom"), patched():
        raise ValueError("boom")
    assert _patch_targets() == before and eagle31.active() is None
    assert pipeline.fingerprint("train", pipeline.ExportOptions(), "in") == fp
    plain = make_drafter()
    assert set(plain.state_dict()) == plain_keys and "_output_norm" not in plain.midlayer.__dict__

    with pytest.raises(EyasError, match="fc_norm"):
        read_drafter(sgl)
    with pytest.raises(EyasError, match="unexpected"):
        Eagle3Drafter.load(tmp_path / "variant" / "eyas")
    plain_sgl = export(plain, tmp_path / "plain")
    read_drafter(plain_sgl)
    with patched():
        read_drafter(sgl)
        Eagle3Drafter.load(tmp_path / "variant" / "eyas")
        with pytest.raises(EyasError, match="config flags"):
            read_drafter(plain_sgl)
        with pytest.raises(EyasError, match="lab_variant None"):
            read_drafter(tmp_path / "plain" / "eyas")
    with patched(Variant(fc_norm="concat")), pytest.raises(EyasError, match="lab_variant"):
        read_drafter(tmp_path / "variant" / "eyas")


def test_the_entry_point_trains_evaluates_and_exports_on_copied_stages(tmp_path, tiny_target_dir):
    """`python lab/variants/eagle31.py pipeline ...` on a workdir whose regenerate/ and prepared/ were copied from
    an unpatched base run: both are skipped, the variant trains (its norms move off their
    ones), eval reports a tau, and the exports carry the variant; the unpatched eyas refuses them."""
    from eyas.drafter.reader import read_drafter

    _, run, stderr = variant_pipeline(
        tmp_path, "eagle31", until="prepare", sets=smoke_sets(tiny_target_dir, "train.seed=3")
    )
    assert "lab variant eagle31 (fc_norm=per-aux, norm_output=True)" in stderr
    drafter = run / "train" / "drafter"
    assert json.loads((drafter / "config.json").read_text())["lab_variant"] == Variant().marker()
    w = load_file(str(drafter / "model.safetensors"))
    assert all(not torch.equal(w[f"fc_norm.{i}.weight"], torch.ones_like(w[f"fc_norm.{i}.weight"])) for i in range(3))
    for fmt in ("sglang", "vllm"):
        cfg = json.loads((run / "export" / fmt / "config.json").read_text())
        assert (cfg["fc_norm"], cfg["norm_before_fc"], cfg["norm_output"]) == (True, False, True)
        assert "fc_norm.2.weight" in load_file(str(run / "export" / fmt / "model.safetensors"))
    with pytest.raises(EyasError):
        read_drafter(run / "export" / "sglang")
    with patched():
        assert set(read_drafter(run / "export" / "sglang").weights) >= {f"fc_norm.{i}.weight" for i in range(3)}


def test_entry_point_options():
    assert eagle31.parse_args(["pipeline", "x.toml"]) == (Variant(), ["pipeline", "x.toml"])
    assert eagle31.parse_args(["--fc-norm", "concat", "--no-norm-output", "eval", "--help"]) == (
        Variant(fc_norm="concat", norm_output=False),
        ["eval", "--help"],
    )
    assert eagle31.parse_args(["--fc-norm=none", "train"])[0] == Variant(fc_norm=None)
    with pytest.raises(SystemExit):
        eagle31.parse_args(["--fc-norm", "both", "train"])
    with pytest.raises(SystemExit):
        eagle31.parse_args(["--fc-norm", "per-aux"])
    with pytest.raises(ValueError):
        Variant(fc_norm=None, norm_output=False)
