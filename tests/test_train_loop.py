"""`eyas train` on CPU: offline == online, resume == uninterrupted, bad input stops before step 1."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

from eyas.errors import EyasError

AUX = [1, 3, 4]
VOCAB_CAP = 512  # the tiny target's lm_head only scores ids < 512, so its argmax is in the draft vocab


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _samples(n: int, prefix: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = int(torch.randint(10, 30, (1,), generator=g))
        ids = torch.randint(0, 300, (T,), generator=g).tolist()
        p = int(torch.randint(2, T // 2, (1,), generator=g))
        out.append((f"{prefix}{i}", ids, [False] * p + [True] * (T - p)))
    return out


def write_store(path: Path, target_dir: Path, prep_dir: Path, split_name: str, *, aux=AUX, tok_hash=None, hidden=None):
    from eyas.data.prepared import PreparedDataset
    from eyas.store.writer import StoreSpec, StoreWriter
    from eyas.target import forward_capture, load_target, model_identity

    model = load_target(target_dir)
    split = PreparedDataset(prep_dir).split(split_name)
    spec = StoreSpec(
        aux_layer_ids=aux,
        hidden_size=hidden or model.config.hidden_size,
        dtype="fp32",
        target=model_identity(target_dir),
        tokenizer_hash=tok_hash,
        model_dtype="fp32",
        prepared={"path": str(prep_dir), "split": split_name, "fingerprint": split.fingerprint},
    )
    with StoreWriter(path, spec) as w:
        for s in split:
            aux_BTAD, final = forward_capture(model, s.input_ids[None], layer_ids=aux)
            if hidden:
                aux_BTAD, final = aux_BTAD[..., :hidden], final[..., :hidden]
            w.add(s.id, aux_BTAD[0], final[0])
        w.close(complete=True)
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory, smol_tokenizer):
    """A tiny target, a prepared dataset (16 train / 4 eval), and stores of both splits."""
    from conftest import make_tiny_target
    from safetensors.torch import load_file, save_file

    from eyas.data.prepared import write_prepared
    from eyas.target import tokenizer_hash

    root = tmp_path_factory.mktemp("train_world")
    target = make_tiny_target(root / "target", smol_tokenizer)
    wf = target / "model.safetensors"
    sd = load_file(str(wf))
    sd["lm_head.weight"][VOCAB_CAP:] = 0
    sd["lm_head.weight"][:VOCAB_CAP] *= 40  # a confident teacher (random init gives near-uniform logits)
    save_file(sd, str(wf), metadata={"format": "pt"})
    th = tokenizer_hash(smol_tokenizer)
    prep = write_prepared(
        root / "prep", {"train": _samples(16, "t", 0), "eval": _samples(4, "e", 1)}, {"tokenizer_hash": th}
    )
    store = write_store(root / "store", target, prep, "train", tok_hash=th)
    eval_store = write_store(root / "eval_store", target, prep, "eval", tok_hash=th)
    return {"root": root, "target": target, "prep": prep, "store": store, "eval_store": eval_store, "tok_hash": th}


def _cfg(world, out, **kw):
    from eyas.train.loop import TrainConfig

    base = dict(
        target=str(world["target"]),
        out=out,
        steps=3,
        batch_size=2,
        draft_vocab=VOCAB_CAP,
        lr=3e-3,
        warmup_steps=1,
        max_length=64,
        eval_samples=4,
        device="cpu",
        aux_layers=AUX,
    )
    base.update(kw)
    return TrainConfig(**base)


def _train_records(out: Path):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' not in x]


def test_offline_and_online_give_the_same_loss(world, tmp_path):
    from eyas.train.loop import run

    off = run(_cfg(world, tmp_path / "off", store=world["store"], eval_store=world["eval_store"], steps=2))
    on = run(_cfg(world, tmp_path / "on", data=world["prep"], steps=2))
    r_off, r_on = _train_records(tmp_path / "off"), _train_records(tmp_path / "on")
    assert r_off[0]["loss"] > 0.5  # a real loss, not a masked-out zero
    for a, b in zip(r_off, r_on):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        assert a["acc_per_step"] == pytest.approx(b["acc_per_step"])
    assert off["eval"]["acceptance_length"] == pytest.approx(on["eval"]["acceptance_length"], rel=1e-6)
    assert off["vocab"]["coverage"] == 1.0
    # the saved drafter loads and its config records the aux layers and target
    from eyas.drafter.model import Eagle3Drafter

    d = Eagle3Drafter.load(tmp_path / "on" / "drafter")
    assert d.config.aux_layer_ids == AUX and d.config.draft_vocab_size == VOCAB_CAP
    assert (tmp_path / "on" / "curves.png").stat().st_size > 1000


def test_resume_reproduces_the_uninterrupted_run(world, tmp_path):
    from eyas.train.loop import run

    full = tmp_path / "full"
    run(_cfg(world, full, data=world["prep"], steps=5, batch_size=2, grad_accum=2, eval_every=0))
    part = tmp_path / "part"
    run(_cfg(world, part, data=world["prep"], steps=5, batch_size=2, grad_accum=2, save_every=2))
    # simulate a kill during step 5's checkpoint write: step 5's checkpoint is a torn temp file, no
    # final drafter, and metrics.jsonl already holds step 5 (plus a torn line) that the resume must not repeat
    ck5 = part / "checkpoints" / "step-000005.safetensors"
    stale = part / "checkpoints" / ".step-000005.safetensors.abc123.tmp"
    stale.write_bytes(ck5.read_bytes()[:100])
    ck5.unlink()
    import shutil

    shutil.rmtree(part / "drafter")
    with open(part / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    run(_cfg(world, part, data=world["prep"], steps=5, batch_size=2, grad_accum=2, resume="auto"))
    assert not stale.exists()
    a, b = _train_records(full), _train_records(part)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    # a rerun of the finished run reports the finished run's figures, not nulls
    again = run(_cfg(world, part, data=world["prep"], steps=5, batch_size=2, grad_accum=2, resume="auto"))
    assert again["final_loss"] == pytest.approx(b[-1]["loss"])
    assert [r["step"] for r in _train_records(part)] == [1, 2, 3, 4, 5]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6), x["step"]
    # it learns something (step 0's loss: the reachability mask, align_topk, leaves it whole)
    assert a[-1]["loss_per_step"][0] < a[0]["loss_per_step"][0]
    from safetensors.torch import load_file

    wa, wb = (
        load_file(str(full / "drafter" / "model.safetensors")),
        load_file(str(part / "drafter" / "model.safetensors")),
    )
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=1e-6)


def test_checkpoint_from_another_config_is_refused(world, tmp_path):
    from eyas.train.loop import run

    out = tmp_path / "r"
    run(_cfg(world, out, data=world["prep"], steps=1))
    with pytest.raises(EyasError, match="another configuration"):
        run(_cfg(world, out, data=world["prep"], steps=2, ttt_steps=3, resume="auto"))


def test_overwrite_starts_over_without_the_old_runs_checkpoints(world, tmp_path):
    from eyas.common import marker_kind
    from eyas.train.loop import run

    out = tmp_path / "r"
    run(_cfg(world, out, data=world["prep"], steps=2, save_every=1))
    assert marker_kind(out) == "train"
    (out / "NOTES.txt").write_text("mine")
    run(_cfg(world, out, data=world["prep"], steps=1, ttt_steps=2, overwrite=True))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001.safetensors"]
    assert [r["step"] for r in _train_records(out)] == [1]
    s = run(_cfg(world, out, data=world["prep"], steps=3, ttt_steps=2, resume="auto"))  # resumes the new run
    assert s["steps"] == 3 and (out / "NOTES.txt").read_text() == "mine"


def test_a_new_run_never_replaces_a_killed_runs_checkpoints(world, tmp_path):
    """A killed run (checkpoints, no drafter) and a new run in its folder without --resume or --overwrite: refused,
    its checkpoints left as they were."""
    import shutil

    from eyas.train.loop import run

    out = tmp_path / "r"
    run(_cfg(world, out, data=world["prep"], steps=2, save_every=1))
    shutil.rmtree(out / "drafter")
    before = {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()}
    with pytest.raises(
        EyasError,
        match=r"holds another run's checkpoints \(step-000002.safetensors\); a new run would "
        r"replace them: pass --resume auto to continue that run, --overwrite",
    ):
        run(_cfg(world, out, data=world["prep"], steps=2, lr=1e-2))
    assert {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()} == before


@pytest.mark.parametrize("damage", ["low_bits", "garbage"])
def test_resume_refuses_a_checkpoint_changed_after_it_was_written(world, tmp_path, damage):
    """The lowest bit of 1,024 floats flipped, or 64 KB overwritten with garbage: --resume auto names the checkpoint
    as damaged (exit 2), before any step and without blaming the store."""
    import shutil

    import numpy as np

    from eyas.train.loop import run

    out = tmp_path / "r"
    run(_cfg(world, out, data=world["prep"], steps=2, save_every=1))
    shutil.rmtree(out / "drafter")
    ck2 = out / "checkpoints" / "step-000002.safetensors"
    data = bytearray(ck2.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # the tensors' bytes
    if damage == "low_bits":
        words = np.frombuffer(data, dtype=np.uint8, count=4096, offset=start).copy().view(np.uint32)
        words ^= 1
        data[start : start + 4096] = words.view(np.uint8).tobytes()
    else:
        data[start : start + 65536] = np.random.default_rng(0).integers(0, 256, 65536, dtype=np.uint8).tobytes()
    ck2.write_bytes(bytes(data))
    with pytest.raises(
        EyasError,
        match=rf"checkpoint {re.escape(str(ck2))} is damaged: its tensors do not match the "
        r"checksum",
    ) as err:
        run(_cfg(world, out, data=world["prep"], steps=3, resume="auto"))
    assert "store" not in str(err.value)


def _copy_store(world, tmp_path, name="store"):
    import shutil

    return Path(shutil.copytree(world["store"], tmp_path / name))


@pytest.mark.parametrize("checksum", ["stale", "updated"])
def test_train_refuses_a_store_whose_manifest_names_other_layers(world, tmp_path, checksum):
    """aux_layer_ids edited in manifest.json (the states stay layers 1, 3, 4): with fields_sha256 left stale the edit
    shows in the checksum; with it updated, the states themselves contradict the named layers. Both exit 2."""
    from eyas.store.format import manifest_fields_sha256
    from eyas.train.loop import run

    store = _copy_store(world, tmp_path)
    man = json.loads((store / "manifest.json").read_text())
    man["aux_layer_ids"] = [a + 1 for a in AUX]
    if checksum == "updated":
        man["fields_sha256"] = manifest_fields_sha256(man)
    (store / "manifest.json").write_text(json.dumps(man))
    cfg = _cfg(world, tmp_path / "r", store=store, aux_layers=None, steps=1)
    pattern = (
        "do not match their checksum fields_sha256: the manifest was edited"
        if checksum == "stale"
        else r"aux slot 0 is listed as layer 2 in manifest.json, but its states are layer 1's"
    )
    with pytest.raises(EyasError, match=pattern):
        run(cfg)
    assert not (tmp_path / "r" / "drafter").exists()


def test_train_refuses_prepared_tokens_changed_after_capture(world, tmp_path):
    """The store's prepared split with one token id changed (meta.json untouched): training from the store stops."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from eyas.train.loop import run

    prep = Path(shutil.copytree(world["prep"], tmp_path / "prep"))
    arrays = load_file(str(prep / "train.safetensors"))
    arrays["input_ids"][3] += 1
    save_file(arrays, str(prep / "train.safetensors"))
    with pytest.raises(EyasError, match=r"split `train` .*does not match its fingerprint in meta.json"):
        run(_cfg(world, tmp_path / "r", store=world["store"], data=prep, aux_layers=None, steps=1))


def test_train_finds_a_moved_prepared_dataset_through_data(world, tmp_path):
    """A store moved with its prepared dataset: the error names --data, and --data with the new place trains."""
    import shutil

    from eyas.train.loop import run

    store = _copy_store(world, tmp_path)
    prep = Path(shutil.copytree(world["prep"], tmp_path / "prep"))
    man = json.loads((store / "manifest.json").read_text())
    moved = tmp_path / "moved_prep"
    man_path = Path(man["prepared"]["path"])
    assert man_path == Path(world["prep"]).resolve()
    shutil.move(str(prep), moved)
    man["prepared"]["path"] = str(tmp_path / "gone")  # (as if the original place were gone)
    from eyas.store.format import manifest_fields_sha256

    man["fields_sha256"] = manifest_fields_sha256(man)
    (store / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(EyasError, match=r"is not there; pass its new location \(--data\)"):
        run(_cfg(world, tmp_path / "r", store=store, aux_layers=None, steps=1))
    s = run(_cfg(world, tmp_path / "r2", store=store, data=moved, aux_layers=None, steps=1))
    assert s["steps"] == 1


def _interrupt_at_step(monkeypatch, n: int, signum=None):
    """Send `signum` (SIGINT) to this process during step `n` (1-based), as Ctrl-C or a job scheduler would."""
    import signal

    from eyas.train import loop

    calls, real = [], loop._clip

    def clip(*a, **k):  # runs once a step, before the step's stats are reduced
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), signum or signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(loop, "_clip", clip)


def test_interrupt_saves_the_step_and_resume_equals_the_uninterrupted_run(world, tmp_path, monkeypatch):
    """SIGINT mid-run (no --save-every): the step in progress finishes, its checkpoint is written, the run
    stops saying how to continue, and `--resume auto` from there gives the uninterrupted run's losses."""
    import signal

    from eyas.errors import Interrupted
    from eyas.train.loop import run

    kw = dict(data=world["prep"], steps=5, batch_size=2, grad_accum=2)
    full = tmp_path / "full"
    run(_cfg(world, full, **kw))
    part = tmp_path / "part"
    _interrupt_at_step(monkeypatch, 2)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(
        Interrupted,
        match=r"stopped after step 2 of 5, saved in .*step-000002\.safetensors; rerun the "
        r"same command with --resume auto to continue from there",
    ):
        run(_cfg(world, part, **kw))
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are restored
    assert sorted(p.name for p in (part / "checkpoints").iterdir()) == ["step-000002.safetensors"]
    assert not (part / "drafter").exists()
    monkeypatch.undo()
    run(_cfg(world, part, resume="auto", **kw))
    a, b = _train_records(full), _train_records(part)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6), x["step"]


def test_each_record_says_how_long_the_host_waited_for_its_statistics(world, tmp_path, monkeypatch):
    """host_wait_s: the seconds the host waited for a step's statistics, within the step's own time, read at once
    and one step late; a read slowed by 50 ms shows in it."""
    from eyas.train import loop, prefetch

    for every in (1, 0):  # a checkpoint every step reads each step's statistics at once
        out = tmp_path / f"save{every}"
        loop.run(_cfg(world, out, data=world["prep"], steps=3, batch_size=2, save_every=every))
        recs = _train_records(out)
        assert [r["step"] for r in recs] == [1, 2, 3]
        assert all(0 <= r["host_wait_s"] <= r["step_s"] for r in recs), recs
    real = prefetch.HostCopies.get

    def slow(self):  # a GPU that is 50 ms behind the host at each deferred read
        time.sleep(0.05)
        return real(self)

    monkeypatch.setattr(prefetch.HostCopies, "get", slow)
    out = tmp_path / "slow"
    loop.run(_cfg(world, out, data=world["prep"], steps=3, batch_size=2))
    recs = _train_records(out)
    assert recs[0]["host_wait_s"] >= 0.05 and recs[1]["host_wait_s"] >= 0.05  # read one step late: steps 1 and 2
    assert recs[2]["host_wait_s"] < 0.05  # the last step's statistics are read at once


def test_the_heads_chunk_size_changes_no_record(world, tmp_path, monkeypatch):
    """The heads' work in chunks of 5 rows or of the default gives the same records (the
    chunks' sums in another order: equal to float rounding)."""
    from eyas.drafter.ttt import unroll
    from eyas.train import loop

    seen, real = [], unroll.ttt_loss_packed

    def spy(*a, **k):
        seen.append(k["chunk_rows"])
        return real(*a, **k)

    monkeypatch.setattr(unroll, "ttt_loss_packed", spy)
    recs = {}
    module = loop.PackedTTTModule
    for rows in (5, loop.HEAD_CHUNK_ROWS):
        monkeypatch.setattr(loop, "PackedTTTModule", lambda *a, rows=rows, **k: module(*a, chunk_rows=rows, **k))
        seen.clear()
        loop.run(_cfg(world, tmp_path / str(rows), data=world["prep"], steps=3, tokens_per_batch=96, batch_size=None))
        assert seen and set(seen) == {rows}  # every step's and the evaluation's head calls
        recs[rows] = _train_records(tmp_path / str(rows))
    small, default = recs.values()
    for a, b in zip(small, default, strict=True):
        assert a["loss_per_step"] == pytest.approx(b["loss_per_step"], rel=1e-5)
        assert a["acc_per_step"] == b["acc_per_step"] and a["supervised_tokens"] == b["supervised_tokens"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_a_stop_skips_the_evaluation_due_at_its_step_and_a_second_signal_stops_at_once(world, tmp_path, monkeypatch):
    """SIGTERM during step 2 of 4 with an evaluation due at step 2: the run saves step 2 and stops without
    evaluating first. Two SIGTERMs in one step: the second stops the run at once, with no checkpoint of the step
    and a message that says what a rerun does."""
    import signal

    from eyas.errors import Interrupted
    from eyas.train.loop import run

    kw = dict(data=world["prep"], steps=4, batch_size=2, eval_every=2)
    one = tmp_path / "one"
    _interrupt_at_step(monkeypatch, 2, signal.SIGTERM)
    with pytest.raises(Interrupted, match=r"stopped after step 2 of 4, saved in .*step-000002\.safetensors"):
        run(_cfg(world, one, **kw))
    lines = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if not r.get("eval")] == [1, 2]
    assert not [r for r in lines if r.get("eval")]  # the evaluation due at step 2 did not run
    monkeypatch.undo()

    from eyas.train import loop

    calls, real = [], loop._clip

    def clip(*a, **k):  # two SIGTERMs during step 2, as a scheduler that repeats its stop, or a second `kill`
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(loop, "_clip", clip)
    two = tmp_path / "two"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as exc:
        run(_cfg(world, two, **kw))
    assert str(exc.value) == "no training step was saved, so a rerun starts from step 0"
    assert not list((two / "checkpoints").glob("*.safetensors"))
    assert signal.getsignal(signal.SIGTERM) is before


def test_compile_workers_start_with_the_stop_signals_ignored(monkeypatch):
    """start_compile_workers_shielded: the worker processes torch starts there ignore SIGINT and SIGTERM (a
    signal to the whole process group leaves them alive while the run finishes its step), and this process's
    handlers are as before. torch's pool start is replaced by a plain child process (this machine has no Triton,
    so torch starts no pool here); the child inherits the dispositions as inductor's sidecar does."""
    import signal
    import subprocess
    import sys

    import torch._inductor.async_compile as ac

    from eyas.train.loop import start_compile_workers_shielded

    children = []

    def warm():
        children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))

    monkeypatch.setattr(ac, "maybe_warm_pool", warm)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    start_compile_workers_shielded()
    (child,) = children
    try:
        assert {s: signal.getsignal(s) for s in before} == before
        time.sleep(0.5)  # (the child's interpreter has started)
        ignored = int(
            next(
                x for x in Path(f"/proc/{child.pid}/status").read_text().splitlines() if x.startswith("SigIgn:")
            ).split()[1],
            16,
        )
        assert ignored >> (signal.SIGTERM - 1) & 1 and ignored >> (signal.SIGINT - 1) & 1
        child.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert child.poll() is None  # still running
    finally:
        child.kill()
        child.wait()


GROUP_SIGTERM = """
import os, signal, sys, time
import torch
from torch._inductor.async_compile import AsyncCompile
from eyas.train.loop import start_compile_workers_shielded
if sys.argv[1] == "shielded":
    start_compile_workers_shielded()
seen = []
signal.signal(signal.SIGTERM, lambda *a: seen.append(1))  # a run asked to stop finishes its step
torch.compile(lambda x: (x * 2).sin())(torch.randn(64, device="cuda"))
t = time.time()
while not AsyncCompile.use_process_pool():  # (inductor sends compiles to its workers once they are ready)
    assert time.time() - t < 120, "the compile workers were not ready in 120 s"
    time.sleep(0.5)
os.killpg(0, signal.SIGTERM)  # as `timeout` or a scheduler's preemption: to the whole process group
time.sleep(2)
torch.compile(lambda x: (x + 3).cos() * x)(torch.randn(96, device="cuda"))  # a compile after it (the final evaluation's)
print("finished", len(seen))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compile workers build Triton kernels)")
def test_a_compile_after_a_process_group_sigterm_finishes(tmp_path):
    """The hang start_compile_workers_shielded prevents, with torch inductor's real compile workers: once they are
    ready, a SIGTERM to the process group, caught by the run (which finishes its step), then a compile. Shielded,
    the compile finishes. Unshielded (`python <script> plain`), the workers die and, by torch's code, the compile's
    jobs never come back: the parent keeps both ends of the workers' pipes open, so their end reads as no EOF (a
    SmolLM2 run under `timeout 120` hung so on an H200). Two earlier forms of this script that sent the signal
    before the workers were ready ended unshielded too: inductor compiled in its own process then."""
    import subprocess
    import sys

    script = tmp_path / "group_sigterm.py"
    script.write_text(GROUP_SIGTERM)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    p = subprocess.run(
        [sys.executable, str(script), "shielded"],
        start_new_session=True,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "finished 1"


def test_deferred_statistics_give_the_same_records_and_stop_at_once_in_one_process(world, tmp_path, monkeypatch):
    """Each step's statistics read after the next step is queued give the same records (loss, accuracies, learning
    rate, gradient norm, tokens) as reading them at once (a checkpoint every step does); in one process a stop asked during
    step 2 is read with step 2's statistics at once, so the run stops after step 2 with its checkpoint and every
    record up to it, and resumes to the same losses (several ranks stop a step later: tests/test_train_ddp.py)."""
    from eyas.errors import Interrupted
    from eyas.train import loop

    kw = dict(data=world["prep"], steps=5, batch_size=2, grad_accum=2)
    loop.run(_cfg(world, tmp_path / "now", save_every=1, **kw))
    loop.run(_cfg(world, tmp_path / "late", **kw))
    now, late = _train_records(tmp_path / "now"), _train_records(tmp_path / "late")
    keys = ("step", "loss_per_step", "acc_per_step", "lr", "tokens", "padded_tokens", "supervised_tokens")
    assert [[r[k] for k in keys] for r in late] == [[r[k] for k in keys] for r in now]
    assert [r["grad_norm"] for r in late] == pytest.approx([r["grad_norm"] for r in now], rel=1e-6)
    part = tmp_path / "part"
    _interrupt_at_step(monkeypatch, 2)
    with pytest.raises(Interrupted, match=r"stopped after step 2 of 5, saved in .*step-000002\.safetensors"):
        loop.run(_cfg(world, part, **kw))
    assert [r["step"] for r in _train_records(part)] == [1, 2]
    monkeypatch.undo()
    loop.run(_cfg(world, part, resume="auto", **kw))
    assert [r["loss"] for r in _train_records(part)] == pytest.approx([r["loss"] for r in now], rel=1e-6)


def test_interrupt_before_the_first_step_does_not_claim_a_resume(world, tmp_path, monkeypatch):
    import eyas.drafter.vocab
    from eyas.errors import Interrupted
    from eyas.train.loop import run

    def ctrl_c(*a, **k):  # Ctrl-C while the run is still being set up
        raise KeyboardInterrupt

    monkeypatch.setattr(eyas.drafter.vocab, "build_draft_vocab", ctrl_c)
    with pytest.raises(KeyboardInterrupt) as exc:
        run(_cfg(world, tmp_path / "early", data=world["prep"]))
    assert isinstance(exc.value, Interrupted)
    assert str(exc.value) == "no training step was saved, so a rerun starts from step 0"
    # a resumed run interrupted the same way names the checkpoint a rerun continues from
    monkeypatch.undo()
    run(_cfg(world, tmp_path / "r", data=world["prep"], steps=1))
    monkeypatch.setattr(eyas.drafter.vocab, "build_draft_vocab", ctrl_c)
    with pytest.raises(
        Interrupted,
        match=r"the latest checkpoint is .*step-000001\.safetensors \(step 1\); rerun the "
        r"same command to continue from it",
    ):
        run(_cfg(world, tmp_path / "r", data=world["prep"], steps=2, resume="auto"))


def test_interrupt_through_the_cli_says_how_to_continue(world, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from eyas.cli import app

    _interrupt_at_step(monkeypatch, 1)
    r = CliRunner().invoke(
        app,
        [
            "train",
            "--target",
            str(world["target"]),
            "--data",
            str(world["prep"]),
            "--out",
            str(tmp_path / "cli"),
            "--steps",
            "50",
            "--draft-vocab",
            str(VOCAB_CAP),
            "--aux-layers",
            "1,3,4",
            "--device",
            "cpu",
            "--ttt-steps",
            "2",
            "--max-length",
            "64",
        ],
    )
    assert r.exit_code == 130, r.output
    assert "interrupted: stopped after step 1 of 50, saved in " in r.stderr and "--resume auto" in r.stderr


def test_options_that_do_not_fit_the_target_fail_before_it_loads(world, tmp_path, monkeypatch):
    import eyas.target
    from eyas.train.loop import run

    def boom(*a, **k):
        raise AssertionError("the target was loaded before the bad option was refused")

    monkeypatch.setattr(eyas.target, "load_target", boom)
    with pytest.raises(
        EyasError,
        match=r"^--aux-layers \(target .*\): ids \[1, 3, 9\] include \[9\], expected inputs "
        r"to decoder layers 1\.\.5 of a 6-layer target",
    ):
        run(_cfg(world, tmp_path / "a", data=world["prep"], aux_layers=[1, 3, 9]))
    vocab = json.loads((world["target"] / "config.json").read_text())["vocab_size"]
    with pytest.raises(
        EyasError,
        match=rf"^--draft-vocab {vocab + 1} exceeds the vocabulary of target .* "
        rf"\({vocab} tokens\)",
    ):
        run(_cfg(world, tmp_path / "b", data=world["prep"], draft_vocab=vocab + 1))


def test_options_fit_target_reads_only_the_config(world):
    """The check the demo can run before its stages: config.json only, no weights."""
    from eyas.train.loop import check_options_fit_target

    check_options_fit_target(world["target"], aux_layers=[1, 5], draft_vocab=VOCAB_CAP)
    with pytest.raises(
        EyasError, match=r"^--draft-vocab 100000 exceeds the vocabulary of target .*target \(\d+ tokens\)"
    ):
        check_options_fit_target(world["target"], draft_vocab=100000)
    with pytest.raises(EyasError, match=r"^--aux-layers \(target .*\): ids \[6\] include \[6\]"):
        check_options_fit_target(world["target"], aux_layers=[6])


def test_options_the_source_would_ignore_are_refused(world, tmp_path):
    with pytest.raises(EyasError, match=r"^--eval-store is for offline training \(--store\)"):
        _cfg(world, tmp_path / "a", data=world["prep"], eval_store=world["eval_store"])
    with pytest.raises(EyasError, match=r"^--cache-states .* online training \(--data\); with --store"):
        _cfg(world, tmp_path / "b", store=world["store"], cache_states=True, aux_layers=None)
    _cfg(world, tmp_path / "c", store=world["store"], cache_states=False)  # what offline does anyway
    # a batch sized two ways: before, --batch-size was dropped silently on CUDA for the default token budget
    with pytest.raises(EyasError, match=r"^--batch-size 2 and --tokens-per-batch 96 both size a micro-batch"):
        _cfg(world, tmp_path / "d", data=world["prep"], tokens_per_batch=96)


def test_a_max_length_that_cuts_off_every_answer_is_named(world, tmp_path):
    from eyas.train.loop import run

    # every sample masks at least its first 2 tokens (the prompt)
    with pytest.raises(
        EyasError,
        match=r"^--max-length 2 leaves no loss-masked \(assistant\) tokens .* "
        r"raise --max-length",
    ):
        run(_cfg(world, tmp_path / "m", store=world["store"], aux_layers=None, max_length=2))


def test_bad_inputs_fail_before_training(world, tmp_path):
    from eyas.data.prepared import write_prepared
    from eyas.train.loop import run

    # store with another hidden size than the target
    bad = write_store(
        tmp_path / "narrow", world["target"], world["prep"], "eval", tok_hash=world["tok_hash"], hidden=32
    )
    with pytest.raises(EyasError, match="hidden size"):
        run(_cfg(world, tmp_path / "a", store=bad, aux_layers=None))
    # store captured with another tokenizer
    wrong_tok = write_store(tmp_path / "tok", world["target"], world["prep"], "eval", tok_hash="0" * 64)
    with pytest.raises(EyasError, match="tokenizer"):
        run(_cfg(world, tmp_path / "b", store=wrong_tok, aux_layers=None))
    # store whose layer ids do not fit the target
    deep = write_store(
        tmp_path / "deep", world["target"], world["prep"], "eval", tok_hash=world["tok_hash"], aux=[1, 2, 5]
    )
    man = json.loads((deep / "manifest.json").read_text())
    man["aux_layer_ids"] = [1, 2, 40]
    from eyas.store.format import manifest_fields_sha256

    man["fields_sha256"] = manifest_fields_sha256(man)  # (a stale checksum is refused first)
    (deep / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(EyasError, match="layers"):
        run(_cfg(world, tmp_path / "c", store=deep, aux_layers=None))
    # empty training split
    empty = write_prepared(
        tmp_path / "empty", {"train": [], "eval": _samples(2, "e", 3)}, {"tokenizer_hash": world["tok_hash"]}
    )
    with pytest.raises(EyasError, match="empty"):
        run(_cfg(world, tmp_path / "d", data=empty))
    # neither or both sources
    with pytest.raises(EyasError, match="exactly one"):
        _cfg(world, tmp_path / "e")
    assert not (tmp_path / "a" / "metrics.jsonl").exists()


def test_cli_progress_line_and_summary(world, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "cli"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "eyas",
            "train",
            "--target",
            str(world["target"]),
            "--data",
            str(world["prep"]),
            "--out",
            str(out),
            "--steps",
            "2",
            "--batch-size",
            "4",
            "--draft-vocab",
            str(VOCAB_CAP),
            "--aux-layers",
            "1,3,4",
            "--device",
            "cpu",
            "--ttt-steps",
            "3",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and len(summary["acc_per_step"]) == 3
    assert "step 00002/00002 | loss " in res.stderr and "supervised) | useful " in res.stderr and "| eta" in res.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "eyas", "train", "--out", str(tmp_path / "x"), "--device", "cpu"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert bad.returncode == 2 and "exactly one of --store" in bad.stderr


def test_plan_covers_every_sample_once_per_epoch():
    from eyas.train.plans import Plan

    for world_size, micro, accum in ((1, 2, 1), (2, 1, 2), (3, 2, 1)):
        plan = Plan(n=23, micro_batch=micro, accum=accum, world=world_size, seed=4)
        seen = []
        for step in range(plan.steps_per_epoch):
            for rank in range(world_size):
                for idx in plan.micro_indices(step, rank):
                    seen += idx
        assert sorted(seen) == list(range(23)), (world_size, micro, accum)  # no drop_last, no repeats
        # the next epoch is another order of the same samples
        nxt = plan.step_indices(plan.steps_per_epoch)
        assert nxt != plan.step_indices(0)[: len(nxt)]
    # one process with micro-batch 2 reads what two processes with micro-batch 1 read together
    one = Plan(n=23, micro_batch=2, accum=1, world=1, seed=4)
    two = Plan(n=23, micro_batch=1, accum=1, world=2, seed=4)
    for step in range(5):
        assert one.micro_indices(step, 0)[0] == two.micro_indices(step, 0)[0] + two.micro_indices(step, 1)[0]


def test_token_plan_covers_every_sample_once_within_budget():
    from eyas.train.plans import TokenPlan

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (57,), generator=g).tolist()
    for world_size, accum in ((1, 1), (2, 1), (1, 3)):
        plan = TokenPlan(lengths=lengths, tokens_per_batch=64, accum=accum, world=world_size, seed=2)
        seen = []
        for step in range(plan.steps_per_epoch):
            for rank in range(world_size):
                for idx in plan.micro_indices(step, rank):
                    assert sum(lengths[i] for i in idx) <= 64
                    seen += idx
        assert sorted(seen) == list(range(57)), (world_size, accum)
        # the epoch after is a new order of all samples, and step numbers keep counting through it
        e1 = [
            i
            for s in range(plan.steps_per_epoch, plan.steps_per_epoch + plan._epoch_steps(1))
            for i in plan.step_indices(s)
        ]
        assert sorted(e1) == list(range(57)) and e1 != seen
    with pytest.raises(EyasError, match="tokens-per-batch"):
        TokenPlan(lengths=[10, 80], tokens_per_batch=64, accum=1, world=1, seed=0)


def test_token_batches_offline_equal_online(world, tmp_path):
    """Packing by tokens: the same steps offline and online, every real token counted once."""
    from eyas.train.loop import run

    kw = dict(steps=3, tokens_per_batch=96, batch_size=None)
    off = run(_cfg(world, tmp_path / "off", store=world["store"], eval_store=world["eval_store"], **kw))
    on = run(_cfg(world, tmp_path / "on", data=world["prep"], **kw))
    r_off, r_on = _train_records(tmp_path / "off"), _train_records(tmp_path / "on")
    for a, b in zip(r_off, r_on):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        assert a["tokens"] == b["tokens"] and a["padded_tokens"] == 96 and a["tokens"] <= 96
    assert off["tokens_per_batch"] == 96 and 0 < on["useful_fraction"] <= 1


def test_wider_draft_mlp_is_trained_saved_and_exported(world, tmp_path):
    from eyas.drafter.model import Eagle3Drafter
    from eyas.train.loop import run

    out = tmp_path / "wide"
    run(_cfg(world, out, data=world["prep"], steps=1, draft_intermediate_size=96))
    d = Eagle3Drafter.load(out / "drafter")
    target_inter = json.loads((world["target"] / "config.json").read_text())["intermediate_size"]
    assert d.config.intermediate_size == 96 != target_inter
    assert max(p.shape[0] for n, p in d.named_parameters() if "mlp" in n and p.ndim == 2) == 96


def test_state_cache_skips_the_target_after_the_first_epoch(world, tmp_path):
    """--cache-states: the same losses as running the target on every batch, with the target run only
    for samples not seen before (the first two batches are read before the cache starts)."""
    from eyas.train.loop import run

    kw = dict(data=world["prep"], steps=12, tokens_per_batch=96, batch_size=None)
    plain = run(_cfg(world, tmp_path / "plain", cache_states=False, **kw))
    cached = run(_cfg(world, tmp_path / "cached", cache_states=True, **kw))
    assert not plain["state_cache"] and cached["state_cache"]
    assert plain["target_forwards"] == 12
    # 4 steps an epoch: epoch 1 runs the target, epoch 2 only for the samples of batches 1-2, epoch 3 never
    assert 4 <= cached["target_forwards"] <= 8
    r_plain, r_cached = _train_records(tmp_path / "plain"), _train_records(tmp_path / "cached")
    assert len(r_cached) == 12
    for a, b in zip(r_plain, r_cached):
        assert a["tokens"] == b["tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
    auto = run(_cfg(world, tmp_path / "auto", **kw))  # the default on the CPU: off
    assert not auto["state_cache"] and auto["target_forwards"] == 12


def test_state_cache_gathers_what_it_was_given():
    from eyas.train.data import Item, StateCache

    items = [Item(f"s{i}", torch.arange(n), torch.ones(n, dtype=torch.bool)) for i, n in enumerate((3, 5, 2))]
    c = StateCache([it.id for it in items], [3, 5, 2], n_aux=2, hidden=4, dtype=torch.float32, device="cpu")
    aux = torch.randn(10, 2, 4)
    final = torch.randn(10, 4)
    c.put([items[1], items[2]], aux[3:], final[3:])  # s1, s2 end to end
    assert c.missing(items) == [items[0]]
    c.put([items[0]], aux[:3], final[:3])
    a, f = c.gather([items[2], items[0]], total=8)  # another order, padded to 8 rows
    assert torch.equal(a[:2], aux[8:10]) and torch.equal(a[2:5], aux[:3]) and torch.equal(f[5:], torch.zeros(3, 4))
    assert StateCache.bytes_needed([3, 5, 2], n_aux=2, hidden=4, dtype=torch.bfloat16) == 11 * 3 * 4 * 2


def test_bf16_training_casts_the_weights_once_or_per_step_alike(world, tmp_path, capsys):
    """`eyas train` under bf16 autocast through both TTT weight paths: it says which one it took, and
    the first step's loss (before any update) agrees within bf16 rounding."""
    from eyas.train.loop import run

    first = {}
    for once in (True, False):
        run(
            _cfg(
                world, tmp_path / f"once-{once}", store=world["store"], model_dtype="bf16", ttt_cast_once=once, steps=2
            )
        )
        err = capsys.readouterr().err
        assert ("cast to bf16 once a forward" in err) == once and ("cast by each step" in err) != once, err[-2000:]
        first[once] = _train_records(tmp_path / f"once-{once}")[0]["loss"]
    assert abs(first[True] - first[False]) <= 0.02 * abs(first[False]), first


def test_the_default_optimizer_and_learning_rate_follow_the_drafters_width(world, tmp_path):
    """--optimizer and --lr unset: Muon at 2e-3 for a drafter under hidden size 2048 (the tiny target's here), AdamW at
    1e-3 there when set or under --fsdp, AdamW at 1e-4 from 2048 on; the resolved ones are what the optimizer ran
    (warmup 1: step 1 is at the peak) and what the drafter records."""
    from eyas.train.loop import LARGE_DRAFTER_HIDDEN, default_lr, default_optimizer, run

    small, large = LARGE_DRAFTER_HIDDEN - 1, LARGE_DRAFTER_HIDDEN
    assert default_optimizer(576, fsdp=False) == default_optimizer(small, fsdp=False) == "muon"
    assert default_optimizer(576, fsdp=True) == default_optimizer(large, fsdp=False) == "adamw"
    assert default_lr(576, "muon") == default_lr(small, "muon") == 2e-3
    assert default_lr(576, "adamw") == default_lr(small, "adamw") == 1e-3
    assert default_lr(large, "muon") == default_lr(4096, "adamw") == 1e-4
    for kind, want in ((None, ("muon", 2e-3)), ("adamw", ("adamw", 1e-3))):
        out = tmp_path / f"lr-{kind}"
        run(_cfg(world, out, data=world["prep"], steps=2, lr=None, optimizer=kind))
        first = _train_records(out)[0]
        training = json.loads((out / "drafter" / "config.json").read_text())["training"]
        assert (training["optimizer"], training["lr"]) == want, training
        assert first["lr"] == pytest.approx(want[1])


def test_align_topk_masks_unreachable_rows_in_a_real_run(world, tmp_path):
    """--align-topk 1: the same first forward (same seed and data) has the same accuracies (every row still counted)
    and a smaller loss (rows past a miss dropped) than with 0; the drafter records it and a resume with the default
    (4) is refused."""
    from eyas.errors import EyasError
    from eyas.train.loop import run

    run(_cfg(world, tmp_path / "a0", data=world["prep"], steps=1, align_topk=0))
    run(_cfg(world, tmp_path / "a1", data=world["prep"], steps=2, save_every=1, align_topk=1))
    r0, r1 = _train_records(tmp_path / "a0")[0], _train_records(tmp_path / "a1")[0]
    assert r0["acc_per_step"] == r1["acc_per_step"]
    assert r1["loss_per_step"][0] == pytest.approx(r0["loss_per_step"][0], rel=1e-6)  # step 0: nothing masked
    assert sum(r1["loss_per_step"][1:]) < sum(r0["loss_per_step"][1:]) - 1e-3
    assert json.loads((tmp_path / "a1" / "drafter" / "config.json").read_text())["training"]["align_topk"] == 1
    ckpt = sorted((tmp_path / "a1" / "checkpoints").glob("step-*.safetensors"))[0]
    with pytest.raises(EyasError, match="align_topk"):
        run(_cfg(world, tmp_path / "a1b", data=world["prep"], steps=2, resume=str(ckpt)))
    with pytest.raises(EyasError, match="--align-topk"):
        _cfg(world, tmp_path / "am", data=world["prep"], align_topk=-1)


def test_feature_loss_changes_the_updates_not_the_reported_figures(world, tmp_path):
    """--feature-loss 0.5: the first step's figures (the soft cross-entropy and accuracies, which it does not
    enter) equal those without it, the second step's do not (the first update differed); the drafter records it,
    a resume without it is refused, a negative weight is refused before anything runs."""
    from eyas.errors import EyasError
    from eyas.train.loop import run

    run(_cfg(world, tmp_path / "f0", data=world["prep"], steps=2))
    run(_cfg(world, tmp_path / "f1", data=world["prep"], steps=2, save_every=1, feature_loss=0.5))
    (a0, b0), (a1, b1) = _train_records(tmp_path / "f0")[:2], _train_records(tmp_path / "f1")[:2]
    assert a1["loss_per_step"] == pytest.approx(a0["loss_per_step"], rel=1e-6)
    assert a1["acc_per_step"] == a0["acc_per_step"]
    assert b1["loss_per_step"] != pytest.approx(b0["loss_per_step"], rel=1e-6)
    assert json.loads((tmp_path / "f1" / "drafter" / "config.json").read_text())["training"]["feature_loss"] == 0.5
    ckpt = sorted((tmp_path / "f1" / "checkpoints").glob("step-*.safetensors"))[0]
    with pytest.raises(EyasError, match="feature_loss"):
        run(_cfg(world, tmp_path / "f1b", data=world["prep"], steps=2, resume=str(ckpt)))
    with pytest.raises(EyasError, match="--feature-loss"):
        _cfg(world, tmp_path / "fm", data=world["prep"], feature_loss=-1.0)


def test_teacher_temperature_sharpens_the_targets_not_the_top_token(world, tmp_path):
    """--teacher-temperature 0.5: the same first forward (same seed and data) agrees with the target's top token
    exactly as often as at 1 (the top token does not move), but learns from sharper targets (another loss); the
    drafter records it, a resume at another temperature is refused, and 0 is refused before any work."""
    from eyas.errors import EyasError
    from eyas.train.loop import run

    run(_cfg(world, tmp_path / "t1", data=world["prep"], steps=1))
    run(_cfg(world, tmp_path / "t05", data=world["prep"], steps=2, save_every=1, teacher_temperature=0.5))
    r1, r05 = _train_records(tmp_path / "t1")[0], _train_records(tmp_path / "t05")[0]
    assert r1["acc_per_step"] == r05["acc_per_step"]
    assert abs(r1["loss"] - r05["loss"]) > 1e-3
    assert (
        json.loads((tmp_path / "t05" / "drafter" / "config.json").read_text())["training"]["teacher_temperature"] == 0.5
    )
    ckpt = sorted((tmp_path / "t05" / "checkpoints").glob("step-*.safetensors"))[0]
    with pytest.raises(EyasError, match="teacher_temperature"):
        run(_cfg(world, tmp_path / "t05b", data=world["prep"], steps=2, resume=str(ckpt)))
    with pytest.raises(EyasError, match="--teacher-temperature"):
        _cfg(world, tmp_path / "t0", data=world["prep"], teacher_temperature=0.0)


def test_a_profiler_steps_through_the_loops_step_end(world, tmp_path, monkeypatch, capsys):
    """run(step_end=...) is called once per optimizer step with its index; train_bench.py's smol profile steps a torch
    profiler through it (steps --skip + 1 warm, + 2 and + 3 recorded) and prints the recorded steps' op table and
    the step's named parts, once per recorded step."""
    import argparse

    from conftest import load_benchmark

    from eyas.train.loop import run

    seen = []
    run(_cfg(world, tmp_path / "a", data=world["prep"], steps=3), step_end=seen.append)
    assert seen == [0, 1, 2]
    tb = load_benchmark("train_bench")
    prof = tb._loop_profile(argparse.Namespace(profile=8, skip=1), cuda=False)
    with prof:
        run(_cfg(world, tmp_path / "b", data=world["prep"], steps=4), step_end=tb.profiler_step(prof))
    tb.print_profile(prof, torch.device("cpu"), 8)
    out = capsys.readouterr().out
    assert "Self CPU time total" in out and "aten::" in out
    recorded = [e.count for e in prof.key_averages() if e.key == "ProfilerStep*"]
    assert recorded == [2]  # two of the loop's steps, each a profiler step
    table = out.split("part of the step")[1].splitlines()[1:]
    parts = {line.split()[0]: int(line.split()[1]) for line in table if line.split() and line.split()[0] in tb.RANGES}
    assert parts["eyas.drafter_forward"] == parts["eyas.drafter_backward"] == parts["eyas.optimizer"] == 2, parts
    assert "where (innermost first)" not in out  # no stacks recorded: no fill sites


def test_a_profile_with_stacks_places_the_fills_at_their_lines(capsys):
    """train_bench's --profile-stacks: the fills (memsets on CUDA) of a profile taken with Python stacks are listed
    by the line that queued them, autograd's (a slice's backward) under the forward line; a profile whose event
    tree cannot be built prints a line, not a traceback."""
    from conftest import load_benchmark
    from torch.profiler import ProfilerActivity, profile

    tb = load_benchmark("train_bench")
    x = torch.randn(16, 16, requires_grad=True)
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        with_stack=True,
        experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True),
    ) as prof:
        x[:, 1:].sum().backward()  # the slice's backward fills a [16, 16] gradient with zeros first
    tb.print_profile(prof, torch.device("cpu"), 8)
    out = capsys.readouterr().out
    sites = out.split("where (innermost first)")[1].splitlines()[1:]
    assert any(line.split()[0] in tb.FILLS and "test_train_loop.py(" in line for line in sites), sites

    class Deep:
        def key_averages(self, **kw):
            raise RecursionError("maximum recursion depth exceeded")

    tb.print_profile(Deep(), torch.device("cpu"), 8)
    assert "nested too deep" in capsys.readouterr().out


def test_muon_trains_resumes_exactly_and_is_recorded(world, tmp_path):
    """--optimizer muon: the first step's figures equal AdamW's (same start), the second's do not; a resume from its
    step-2 checkpoint (momentum buffers and AdamW moments) gives the uninterrupted run's losses and weights; the
    drafter records it; a resume with --optimizer unset keeps the checkpoint's (Muon, or AdamW for a run without the
    key); a resume with AdamW set, an unknown optimizer and muon with --fsdp are refused before any work."""
    from safetensors.torch import load_file

    from eyas.errors import EyasError
    from eyas.train.loop import run

    run(_cfg(world, tmp_path / "adam", data=world["prep"], steps=2, optimizer="adamw"))
    run(_cfg(world, tmp_path / "full", data=world["prep"], steps=4, optimizer="muon"))
    run(_cfg(world, tmp_path / "part", data=world["prep"], steps=4, optimizer="muon", save_every=2))
    ck2 = tmp_path / "part" / "checkpoints" / "step-000002.safetensors"
    for later in ("step-000004.safetensors",):
        (tmp_path / "part" / "checkpoints" / later).unlink()
    run(_cfg(world, tmp_path / "part", data=world["prep"], steps=4, resume=str(ck2)))  # (unset: the checkpoint's)
    a, full, part = (_train_records(tmp_path / x) for x in ("adam", "full", "part"))
    assert full[0]["loss_per_step"] == pytest.approx(a[0]["loss_per_step"], rel=1e-6)
    assert full[1]["loss_per_step"] != pytest.approx(a[1]["loss_per_step"], rel=1e-4)
    assert [r["loss"] for r in part[-2:]] == pytest.approx([r["loss"] for r in full[-2:]], rel=1e-6)
    wf, wp = (load_file(str(tmp_path / x / "drafter" / "model.safetensors")) for x in ("full", "part"))
    for k in wf:
        torch.testing.assert_close(wf[k], wp[k], atol=1e-6, rtol=1e-6)
    assert json.loads((tmp_path / "full" / "drafter" / "config.json").read_text())["training"]["optimizer"] == "muon"
    with pytest.raises(EyasError, match="optimizer"):
        run(_cfg(world, tmp_path / "other", data=world["prep"], steps=4, resume=str(ck2), optimizer="adamw"))
    # an AdamW run (as every run was before Muon became the small drafters' default) resumes as AdamW when unset
    run(_cfg(world, tmp_path / "adam", data=world["prep"], steps=3, resume="auto"))
    adam = _train_records(tmp_path / "adam")
    assert [r["step"] for r in adam] == [1, 2, 3], adam
    assert json.loads((tmp_path / "adam" / "drafter" / "config.json").read_text())["training"]["optimizer"] == "adamw"
    with pytest.raises(EyasError, match="--optimizer"):
        _cfg(world, tmp_path / "bad", data=world["prep"], optimizer="sgd")
    with pytest.raises(EyasError, match="--fsdp"):
        _cfg(world, tmp_path / "sharded", data=world["prep"], optimizer="muon", fsdp=True)


def test_only_the_latest_checkpoints_are_kept(world, tmp_path):
    """--keep-checkpoints (default 2) bounds the disk a long run takes; the user's files there stay, and the
    latest is what --resume auto continues from."""
    from eyas.train.checkpoint import prune_checkpoints
    from eyas.train.loop import run

    out = tmp_path / "r"
    run(_cfg(world, out, data=world["prep"], steps=3, save_every=1))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-000002.safetensors",
        "step-000003.safetensors",
    ]
    (out / "checkpoints" / "notes.txt").write_text("mine")
    run(_cfg(world, out, data=world["prep"], steps=4, save_every=1, resume="auto"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "notes.txt",
        "step-000003.safetensors",
        "step-000004.safetensors",
    ]
    assert [r["step"] for r in _train_records(out)] == [1, 2, 3, 4]  # continued from step 3
    d = tmp_path / "ck"
    d.mkdir()
    names = [f"step-{i:06d}.safetensors" for i in (1, 2, 10)] + ["step-000001.safetensors.sha256", "step-1.txt"]
    for n in names:
        (d / n).write_text("x")
    assert prune_checkpoints(d, keep=0) == []
    removed = prune_checkpoints(d, keep=2)
    assert sorted(p.name for p in removed) == ["step-000001.safetensors", "step-000001.safetensors.sha256"]
    assert sorted(p.name for p in d.iterdir()) == ["step-000002.safetensors", "step-000010.safetensors", "step-1.txt"]
