"""What the SGLang tests share: the stand-in server on a tiny target, its prepared samples (the fixture
`sglang_prepared` in conftest.py), and the ways to make it misbehave (tests/test_sglang_*.py,
tests/test_verify_server.py)."""

from __future__ import annotations

import contextlib
import functools
import http.server
import threading
from pathlib import Path

import torch

from eyas.sglang.standin import StandinConfig, StandinServer

LENGTHS = [5, 12, 23, 40, 9, 31, 17, 26]
LAYERS = [2, 3, 4]  # eyas convention, on the 6-layer tiny target (default would be 2, 3, 3 -> repeats)


def make_prepared(tmp_path_factory, smol_tokenizer):
    """8 samples of random ids; samples 5 and 7 share a 20-token prefix with sample 3."""
    from eyas.data.prepared import write_prepared
    from eyas.target import tokenizer_hash

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(100, 40000, (n,), generator=g) for n in LENGTHS]
    seqs[5][:20] = seqs[3][:20]
    seqs[7][:20] = seqs[3][:20]
    out = tmp_path_factory.mktemp("prep") / "data"
    samples = [(f"s{i}", s.tolist(), [True] * len(s)) for i, s in enumerate(seqs)]
    write_prepared(out, {"train": samples, "eval": []}, {"tokenizer_hash": tokenizer_hash(smol_tokenizer)})
    return out


def serve(tiny_target_dir, tmp_path, **kw) -> StandinServer:
    kw.setdefault("layer_ids", LAYERS)
    return StandinServer(StandinConfig(target=tiny_target_dir, dump_dir=tmp_path / "dumps", **kw))


def check_store_against_reference(store, sglang_prepared, model, n=None):
    n = len(LENGTHS) if n is None else n
    from eyas.data.prepared import PreparedDataset
    from eyas.store.reader import StoreReader
    from eyas.target import forward_capture

    reader = StoreReader(store)
    split = PreparedDataset(sglang_prepared).split("train")
    assert sorted(reader.sample_ids) == sorted(split.ids[:n])
    for i in range(n):
        s = split[i]
        aux, final = reader.get(s.id, torch.float32)
        ref_aux, ref_final = forward_capture(model, s.input_ids[None], layer_ids=LAYERS)
        torch.testing.assert_close(aux, ref_aux[0], rtol=1e-2, atol=1e-2)  # stored as bf16
        torch.testing.assert_close(final, ref_final[0], rtol=1e-2, atol=1e-2)


def without_the_prefix_cap(srv):
    """The stand-in with the plugin's cap on eyas requests' prefix match not in effect (as on a server whose
    SGLang stopped calling the hooked methods), nor its release hook: eyas prompts are cached, and prefixes
    served, again. Returns a function putting both back."""
    from eyas.sglang.standin import PREFIX_CAP_TARGET, RELEASE_TARGET

    hooks = {t: srv.hooks.hooks.pop(t) for t in (PREFIX_CAP_TARGET, RELEASE_TARGET)}
    return lambda: srv.hooks.hooks.update(hooks)


def hide_the_prefix_cache(srv):
    """The stand-in made to say its radix cache is off and that nothing was cached (cached_tokens 0) while it
    serves prefixes, past the plugin's cap: only the plugin's own check can tell. Returns a function that
    makes the server truthful again (its radix cache on, the cap in effect)."""
    info, gen = srv.server_info, srv.generate
    put_back_the_cap = without_the_prefix_cap(srv)

    def lying_generate(body):
        code, obj = gen(body)
        if code == 200:
            obj["meta_info"]["cached_tokens"] = 0
        return code, obj

    srv.server_info = lambda: {**info(), "disable_radix_cache": True}
    srv.generate = lying_generate

    def truthful():
        srv.server_info, srv.generate = info, gen
        put_back_the_cap()

    return truthful


def verify_server_on(srv, **kw) -> dict:
    """`eyas verify-server` against `srv`; a typer command, so every option is passed (these defaults, then `kw`)."""
    from eyas.commands.verify_server import verify_server

    args = dict(
        url=srv.url,
        layers=None,
        dump_dir=None,
        cache_bypass="auto",
        target=None,
        prompt_tokens=24,
        tolerance=None,
        device="cpu",
        seed=0,
        dump_wait_s=10.0,
    )
    return verify_server(**{**args, **kw})


def run_model_runner_forward_elsewhere(monkeypatch, *, old_plugin: bool) -> None:
    """The plugin's ModelRunner.forward hook runs on another thread than the logits step: it sees the
    scheduler's batches but cannot give the rid-less replay batches their ids. `old_plugin`: a status
    without the `rid_less_forwards` counter (eyas before it was added)."""
    from eyas.sglang import plugin

    real, real_status = plugin._State.on_model_runner_forward, plugin._State.status

    def elsewhere(self, fb):
        t = threading.Thread(target=real, args=(self, fb))
        t.start(), t.join()

    def status(self):
        st = real_status(self)
        st["stats"].pop("rid_less_forwards")
        return st

    monkeypatch.setattr(plugin._State, "on_model_runner_forward", elsewhere)
    if old_plugin:
        monkeypatch.setattr(plugin._State, "status", status)


@contextlib.contextmanager
def plain_http_server(directory):
    """A stock `python -m http.server` on a free port: what a wrong --url often reaches (404 pages in HTML)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    handler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def spools() -> list[Path]:
    """The capture workers' spool directories there are (--sglang-procs)."""
    import tempfile

    return sorted(Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()).glob("eyas-spool-*"))
