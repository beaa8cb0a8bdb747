"""Where `eyas capture --backend sglang` spends its time between "the server computed the states" and
"the sample is in the store", stage by stage, on the CPU (issue 41).

Shapes are SmolLM2-135M's (hidden 576, 3 aux layers + the final state, bf16: 4.6 KB per token) and
samples of about 640 tokens (up to 2048). Stages, each reported as tokens/s:

  observe    CaptureCore.observe on packed EXTEND forwards (as the plugin's logits hook drives it)
  write      write_dump of every completed sample, one thread (the dump's serialisation and tmpfs write)
  write_pool DumpWriter with the plugin's writer threads (what the server runs)
  gil_stepsN the same writers beside a thread standing for SGLang's scheduler (Python steps, a torch call every
             N of them; 0: none), the two on separate cores where Linux allows, sharing only the GIL: the
             share of its rate that thread keeps while the dumps are written (scheduler_kept), and the
             dumps' ms each (--gil-steps; SGLang's plugin runs its writers in the scheduler's process)
  read       wait_for_dump of a dump already on disk (open, parse, load the tensors)
  read_threads, read_threads_readinto
             the same on the client's 2 x --concurrency threads, each dump's states then checked and let go,
             read by the safetensors package (it maps the file) and by read_into (readinto, a candidate)
  wait       wait_for_dump of a dump written `--appear-ms` after the call: reports how late the client
             sees a dump that has appeared (ms), i.e. its polling or notification delay
  handoff_pipe_busyN, handoff_spool_busyN
             --handoff-samples dumps read, checked and encoded in other processes, the rows handed back through
             the process pool's pipe and through a file beside the dump (how --sglang-procs workers hand them
             to the storing process), while N threads of this process run Python (the client's busy GIL)
  switch_Xms_busyN
             the client's check, encode and ingest of every dump while N more threads run Python
             (--switch-busy), with Python's thread switch interval at X ms (--switch-ms; 5 is Python's default)
  check      check_sample on a read dump (ids, positions, lengths, layers, finiteness)
  remove     remove_dump
  answer, answer_whole
             /generate's answer to a capture request with the logprob bypass (every prompt token's
             [logprob, id, null], as SGLang 0.5.17 writes it) read by parse_answer, and by json.loads whole
  stack      aux and final stacked into the store's [L, A+1, H] (where the client does it on its
             request threads, before handing the sample to the one ingesting thread)
  encode     StoreWriter.encode (stored dtype and checksum), where the client does it on its request threads
  ingest     what the client's ingesting thread does per sample into a store on --store-dir
             (StoreWriter.add_encoded; add_stacked or add in older trees), then close
  threads_default, threads_one
             the finiteness check and the stacking on the client's 2 x --concurrency request threads,
             with torch's default intra-op threads per thread, and with one (what the client sets)
  e2e        capture_from_sglang (the real client, --concurrency requests in flight) against the
             stand-in server (eyas/sglang/standin.py) whose forward is replaced by a free one that
             returns fixed states: the server costs nothing, so this is eyas's own path end to end
             (HTTP, plugin hooks, dump write, wait, read, check, ingest) in one process; e2e_loop
             leaves out the set-up (where the client reports its loop time)
  model      (--model-rate R) issue 41's ratio in a model: the stand-in in a process of its own, each
             forward costing what a GPU server's would (it sleeps --model-fixed-ms plus its tokens / R,
             without the GIL), and, at each --model-concurrency, that server's prefill tokens/s without
             dumps (requests without the eyas rid, as lab/scripts/serve_live.py measures it) against
             capture_from_sglang's loop tokens/s, after a warm-up capture, the concurrencies in reverse
             order every other run. A ratio well under 1 here is eyas's own path (client, plugin, dump
             writing) falling behind; near 1, the live gap is the engine's. Both arms send --model-bypass
             (plugin: nothing extra; logprob, as an older plugin on SGLang 0.5.17 needs: the answers then
             list every prompt token's logprob);
             --model-client current,whole,readinto,procs,switch measures this tree's client, one parsing
             the answers whole, one reading the dumps with readinto, one with worker processes and one with a
             shorter thread switch interval (CLIENTS), in turn, in the same run

    PYTHONPATH=src python benchmarks/capture_path.py [--samples 256] [--repeat 3] [--no-e2e]
    PYTHONPATH=src python benchmarks/capture_path.py --only-model --model-rate 60000 --repeat 3

Progress goes to stderr; the last stdout line is one JSON document of the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from sglang_plugin_overhead import schedule  # noqa: E402 (the same SGLang-like prefill schedule)

from eyas.sglang.core import CaptureCore, DumpWriter, ForwardInfo, make_rid, write_dump
from eyas.sglang.request import check_sample, remove_dump, wait_for_dump
from eyas.sglang.server import parse_answer

HIDDEN, AUX = 576, 3
LAYERS = [2, 15, 27]  # SmolLM2-135M's EAGLE-3 default (30 layers: 2, N//2, N-3)
WRITER_THREADS = 4  # eyas.sglang.plugin.WRITER_THREADS


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sample_lengths(n: int, seed: int) -> list[int]:
    """Log-normal prompt lengths, mean about 640, clipped to 16..2048."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(n, generator=g) * 0.75 + 6.2)
    return [int(x) for x in raw.clamp(16, 2048)]


def token_ids(n: int, start: int = 0) -> torch.Tensor:
    return (torch.arange(start, start + n) * 7919 + 13) % 49152


def make_forwards(plan, rids, pool_TAD: torch.Tensor, pool_TD: torch.Tensor, pad_to: int) -> list[ForwardInfo]:
    """Packed forwards whose rows are slices of fixed pools (aux as SGLang's list of [T, H])."""
    out = []
    for fwd in plan:
        T = sum(n for *_, n in fwd)
        Tp = T + (-T) % pad_to
        rows = torch.cat([torch.arange(s, s + n) for _, s, n in fwd] + [torch.zeros(Tp - T, dtype=torch.long)])
        aux_TAD = pool_TAD[rows]
        out.append(
            ForwardInfo(
                rids=[rids[r] for r, _, _ in fwd],
                extend_prefix_lens=[s for _, s, _ in fwd],
                extend_seq_lens=[n for *_, n in fwd],
                aux=[aux_TAD[:, a].contiguous() for a in range(AUX)],
                final_TD=pool_TD[rows],
                positions_T=rows,
                input_ids_T=torch.cat([token_ids(n, s) for _, s, n in fwd] + [torch.zeros(Tp - T, dtype=torch.long)]),
            )
        )
    return out


def clock() -> tuple[float, float]:
    """Wall and CPU time (every thread of this process): on a shared machine the CPU time per token is
    the steadier figure, the wall time the one a user waits for."""
    return time.perf_counter(), time.process_time()


def stage(
    results: dict,
    name: str,
    tokens: int,
    start: tuple[float, float] | None = None,
    *,
    seconds: float | None = None,
    cpu_s: float | None = None,
    **extra,
) -> None:
    """Record a stage timed from `start` (or given); over repeats the fastest run is kept."""
    if start is not None:
        wall, cpu = clock()
        seconds, cpu_s = wall - start[0], cpu - start[1]
    cpu_part = f"  cpu {cpu_s / tokens * 1e6:7.2f} us/token" if cpu_s is not None else ""
    log(
        f"{name:10s} {seconds:8.3f} s  {tokens / seconds:12,.0f} tok/s  {seconds / tokens * 1e6:7.2f} us/token"
        + cpu_part
        + "".join(f"  {k} {v}" for k, v in extra.items())
    )
    if name in results and results[name]["seconds"] <= seconds:
        return
    results[name] = {
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1),
        "us_per_token": round(seconds / tokens * 1e6, 3),
        **({"cpu_us_per_token": round(cpu_s / tokens * 1e6, 3)} if cpu_s is not None else {}),
        **extra,
    }


def read_threads(a, dump_dir: Path, rids: list[str], tokens: int, results: dict, flip: bool) -> None:
    """Each dump read, its states checked for finiteness and let go, on the client's 2 x --concurrency
    threads (one intra-op thread each), with the safetensors package and with read_into (in reverse order
    when `flip`: the runs take turns going first)."""
    import concurrent.futures as cf

    from eyas.sglang.core import all_finite

    def one(rid: str) -> None:
        d = wait_for_dump(dump_dir, rid, timeout=5.0)
        all_finite(d.aux_LAD), all_finite(d.final_LD)

    arms = [("read_threads", "current"), ("read_threads_readinto", "readinto")]
    for name, variant in arms[:: -1 if flip else 1]:
        with (
            client_variant(variant),
            cf.ThreadPoolExecutor(2 * a.concurrency, initializer=torch.set_num_threads, initargs=(1,)) as ex,
        ):
            t0 = clock()
            list(ex.map(one, rids))
            stage(results, name, tokens, t0, threads=2 * a.concurrency)


def spin(stop: threading.Event) -> None:
    """Python steps holding the GIL until `stop`: the client's busy request threads, standing in."""
    while not stop.is_set():
        [i * i for i in range(1000)]


def switch_intervals(a, dump_dir: Path, rids: list[str], lengths: list[int], store_root: Path, results, flip) -> None:
    """The client's own work on each dump (check_and_encode on 2 x --concurrency request threads, then the one
    ingesting thread's StoreWriter.add_encoded) while --switch-busy more threads run Python (the client's busy GIL), at
    each of --switch-ms as Python's thread switch interval (in reverse order when `flip`). Every torch op, read
    and write releases the GIL, and a thread back from one waits until the running thread is told to let go,
    after at most that interval: the time the live client's request threads spent in `check` and `dump`."""
    import concurrent.futures as cf

    from eyas.sglang.request import check_and_encode
    from eyas.store.writer import SampleEncoder, StoreSpec, StoreWriter

    spec = StoreSpec(aux_layer_ids=LAYERS, hidden_size=HIDDEN, dtype="bf16")
    kw = {"layer_ids": LAYERS, "hidden_size": HIDDEN, "encode": SampleEncoder(spec)}
    tokens, saved = sum(lengths), sys.getswitchinterval()

    def one(i: int):
        L = lengths[i]
        out = check_and_encode(
            dump_dir / rids[i], f"s{i}", token_ids(L), {"prompt_tokens": L, "cached_tokens": 0}, **kw
        )
        assert out.reason is None, out.reason
        return out.encoded

    for ms in a.switch_ms[:: -1 if flip else 1]:
        stop = threading.Event()
        spinners = [threading.Thread(target=spin, args=(stop,), daemon=True) for _ in range(a.switch_busy)]
        store = store_root / f"switch-{ms}"
        shutil.rmtree(store, ignore_errors=True)
        writer = StoreWriter(store, spec)
        sys.setswitchinterval(ms / 1000)
        for t in spinners:
            t.start()
        try:
            with cf.ThreadPoolExecutor(2 * a.concurrency, initializer=torch.set_num_threads, initargs=(1,)) as ex:
                t0 = clock()
                for enc in ex.map(one, range(len(rids))):  # this thread stores, as the ingesting thread does
                    writer.add_encoded(enc)
                writer.close(complete=True)
                stage(results, f"switch_{ms:g}ms_busy{a.switch_busy}", tokens, t0, threads=2 * a.concurrency)
        finally:
            stop.set()
            for t in spinners:
                t.join()
            sys.setswitchinterval(saved)
            shutil.rmtree(store, ignore_errors=True)


def check_in_pipe(path: str, sample_id: str, ids_np, meta_info: dict, **kw):
    """check_and_encode in another process (the ids sent as numpy), its rows handed back through the pipe."""
    from eyas.sglang.request import check_and_encode

    return check_and_encode(Path(path), sample_id, torch.from_numpy(ids_np), meta_info, **kw)


def check_and_spool(path: str, sample_id: str, ids_np, meta_info: dict, **kw):
    """check_in_pipe, its rows then handed back in a file beside the dump (EncodedSample.spool), as the
    capture's worker processes (--sglang-procs) hand theirs to the storing process."""
    from dataclasses import replace

    out = check_in_pipe(path, sample_id, ids_np, meta_info, **kw)
    return out if out.encoded is None else replace(out, encoded=out.encoded.spool(os.path.join(path, "rows.bin")))


def handoff(a, dump_dir: Path, rids: list[str], lengths: list[int], results: dict, flip: bool) -> None:
    """--handoff-samples dumps read, checked and encoded in --handoff-procs processes, their rows coming back
    through the process pool's pipe (check_in_pipe) and through a file beside the dump (check_and_spool, the
    way the capture's workers hand samples over), with 0 and 1 threads of this process holding the GIL."""
    import concurrent.futures as cf
    import multiprocessing

    from eyas.store.writer import SampleEncoder, StoreSpec

    n = min(a.handoff_samples, len(rids))
    tokens = sum(lengths[:n])
    kw = {"layer_ids": LAYERS, "hidden_size": HIDDEN}
    kw["encode"] = SampleEncoder(StoreSpec(aux_layer_ids=LAYERS, hidden_size=HIDDEN, dtype="bf16"))
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(
        a.handoff_procs, mp_context=ctx, initializer=torch.set_num_threads, initargs=(1,)
    ) as ex:
        list(ex.map(abs, range(2 * a.handoff_procs)))  # the processes started
        arms = [
            (f"handoff_{way}_busy{busy}", fn, busy)
            for busy in (0, 1)
            for way, fn in (("pipe", check_in_pipe), ("spool", check_and_spool))
        ]
        for name, fn, busy in arms[:: -1 if flip else 1]:
            stop = threading.Event()
            spinners = [threading.Thread(target=spin, args=(stop,), daemon=True) for _ in range(busy)]
            for t in spinners:
                t.start()
            t0 = clock()
            futures = [
                ex.submit(
                    fn,
                    str(dump_dir / rid),
                    f"s{i}",
                    token_ids(L).numpy(),
                    {"prompt_tokens": L, "cached_tokens": 0},
                    **kw,
                )
                for i, (rid, L) in enumerate(zip(rids[:n], lengths[:n]))
            ]
            for f in futures:
                out = f.result()
                assert out.reason is None, out.reason
                enc = out.encoded.load() if hasattr(out.encoded, "load") else out.encoded
                assert enc.rows.shape[0] == out.tokens
            stop.set()
            for t in spinners:
                t.join()
            stage(results, name, tokens, t0, procs=a.handoff_procs, samples=n)


def sglang_answer(rid: str, n: int) -> bytes:
    """/generate's answer to a capture request with the logprob bypass, as SGLang 0.5.17 writes it (orjson:
    no spaces): one [logprob, id, null] per prompt token (the first without a logprob)."""
    g = torch.Generator().manual_seed(n)
    lp = (-torch.rand(n, generator=g, dtype=torch.float64) * 12).tolist()
    ids = torch.randint(0, 49152, (n,), generator=g).tolist()
    meta = {
        "id": rid,
        "finish_reason": {"type": "length", "length": 1},
        "prompt_tokens": n,
        "weight_version": "default",
        "input_token_logprobs": [[None if i == 0 else lp[i], ids[i], None] for i in range(n)],
        "output_token_logprobs": [[lp[0], ids[0], None]],
        "output_token_logprobs_length": 1,
        "completion_tokens": 1,
        "cached_tokens": 0,
        "e2e_latency": 0.1,
    }
    return json.dumps({"text": "", "output_ids": [ids[0]], "meta_info": meta}, separators=(",", ":")).encode()


def run_stages(a, lengths: list[int], dump_root: Path, store_root: Path, results: dict, flip: bool) -> None:
    tokens = sum(lengths)
    g = torch.Generator().manual_seed(1)
    pool_TAD = torch.randn(2048, AUX, HIDDEN, generator=g).bfloat16()
    pool_TD = torch.randn(2048, HIDDEN, generator=g).bfloat16()
    rids = [make_rid(n, f"bench-{i}") for i, n in enumerate(lengths)]
    plan = schedule(lengths, chunk=a.chunk, budget=a.forward_tokens)
    fwds = make_forwards(plan, rids, pool_TAD, pool_TD, pad_to=64)
    log(
        f"{len(lengths)} samples, {tokens} tokens (mean {tokens / len(lengths):.0f}, max {max(lengths)}), "
        f"{len(plan)} forwards, H={HIDDEN}, A={AUX}, bf16 ({(AUX + 1) * HIDDEN * 2} B/token)"
    )

    CaptureCore().observe(fwds[0])  # warm-up
    core = CaptureCore()
    t0 = clock()
    done = [s for info in fwds for s in core.observe(info)]
    stage(results, "observe", tokens, t0)
    assert len(done) == len(lengths) and all(s.status == "complete" for s in done), core.stats
    del fwds

    dump_dir = dump_root / "serial"
    shutil.rmtree(dump_dir, ignore_errors=True)
    write_dump(dump_dir, done[0], layer_ids=LAYERS)  # warm-up (imports)
    t0 = clock()
    for s in done:
        write_dump(dump_dir, s, layer_ids=LAYERS)
    stage(results, "write", tokens, t0)

    pool_dir = dump_root / "pool"
    shutil.rmtree(pool_dir, ignore_errors=True)
    writer = DumpWriter(pool_dir, layer_ids=LAYERS, threads=WRITER_THREADS)
    t0 = clock()
    writer.submit(done)
    writer.close()
    stage(results, "write_pool", tokens, t0, threads=WRITER_THREADS)
    for steps in a.gil_steps:
        gil_share(a, done, tokens, dump_root / "gil", steps, results)
    assert writer.written == len(done) and not writer.errors, writer.errors[:3]
    shutil.rmtree(pool_dir, ignore_errors=True)

    by_rid = {s.rid: s for s in done}
    t0 = clock()
    dumps = [wait_for_dump(dump_dir, rid, timeout=5.0) for rid in rids]
    stage(results, "read", tokens, t0)
    read_threads(a, dump_dir, rids, tokens, results, flip)
    if a.handoff_samples:
        handoff(a, dump_dir, rids, lengths, results, flip)
    if a.switch_ms:
        switch_intervals(a, dump_dir, rids, lengths, store_root, results, flip)
    assert all(d is not None for d in dumps)

    t0 = clock()
    for rid, n, d in zip(rids, lengths, dumps):
        reason = check_sample(
            token_ids(n), {"prompt_tokens": n, "cached_tokens": 0}, d, layer_ids=LAYERS, hidden_size=HIDDEN
        )
        assert reason is None, f"{rid}: {reason}"
    stage(results, "check", tokens, t0)

    t0 = clock()
    for rid in rids:
        remove_dump(dump_dir, rid)
    stage(results, "remove", tokens, t0)

    answers = [sglang_answer(s.rid, s.num_tokens) for s in done]
    for name, parse in (("answer_whole", json.loads), ("answer", parse_answer)):
        t0 = clock()
        for raw in answers:
            parse(raw)
        stage(results, name, tokens, t0)

    wait = wait_latency(a, dump_root / "late", [by_rid[r] for r in rids[: a.wait_samples]])
    if "wait" not in results or wait["late_ms_mean"] < results["wait"]["late_ms_mean"]:
        results["wait"] = wait

    from eyas.store.writer import StoreSpec, StoreWriter

    store = store_root / "store"
    shutil.rmtree(store, ignore_errors=True)
    w = StoreWriter(store, StoreSpec(aux_layer_ids=LAYERS, hidden_size=HIDDEN, dtype="bf16"))
    if hasattr(w, "add_stacked"):  # the client stacks on its request threads, then the ingest thread only writes
        t0 = clock()
        stacked = [torch.cat([d.aux_LAD, d.final_LD.unsqueeze(1)], dim=1) for d in dumps]
        stage(results, "stack", tokens, t0)
        if hasattr(w, "encode"):  # the request threads also encode and checksum: the ingest thread only writes
            t0 = clock()
            encoded = [w.encode(f"s{i}", h) for i, h in enumerate(stacked)]
            stage(results, "encode", tokens, t0)
            t0 = clock()
            for e in encoded:
                w.add_encoded(e)
        else:
            t0 = clock()
            for i, h in enumerate(stacked):
                w.add_stacked(f"s{i}", h)
    else:
        t0 = clock()
        for i, d in enumerate(dumps):
            w.add(f"s{i}", d.aux_LAD, d.final_LD)
    w.close(complete=True)
    stage(results, "ingest", tokens, t0)
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(dump_dir, ignore_errors=True)


def gil_share(a, done, tokens: int, dump_dir: Path, steps: int, results: dict) -> None:
    """The dump writers beside a thread standing for the server's scheduler: Python steps with a torch call
    every `steps` of them (0: none). Pinned to separate cores where Linux allows, they share only the GIL.
    Reports the share of its rate the scheduler keeps while the dumps are written and the dumps' ms each."""

    def pin(thread_id: int, core: int) -> None:
        if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
            os.sched_setaffinity(thread_id, {core})

    def scheduler_rate(seconds: float | None, work=None) -> tuple[float, float]:
        stop, out = threading.Event(), []

        def loop():
            pin(threading.get_native_id(), 0)
            x, n, t0 = torch.zeros(8), 0, time.perf_counter()
            while not stop.is_set():
                for _ in range(steps or 1000):
                    n += 1
                if steps:
                    x.add_(1)
            out.append(n / (time.perf_counter() - t0))

        th = threading.Thread(target=loop)
        th.start()
        time.sleep(0.2)
        t0 = time.perf_counter()
        work() if work else time.sleep(seconds)
        took = time.perf_counter() - t0
        stop.set()
        th.join()
        return out[0], took

    shutil.rmtree(dump_dir, ignore_errors=True)
    writer = DumpWriter(dump_dir, layer_ids=LAYERS, threads=WRITER_THREADS)
    for th in threading.enumerate():
        if th.name.startswith("eyas-dump-writer"):
            pin(th.native_id, 1)
    idle, _ = scheduler_rate(1.0)

    def write_all():
        writer.submit(done)
        writer.flush()

    busy, took = scheduler_rate(None, write_all)
    writer.close()
    shutil.rmtree(dump_dir, ignore_errors=True)
    name = f"gil_steps{steps}"
    kept = round(busy / idle, 4)
    stage(results, name, tokens, seconds=took, scheduler_kept=kept, dump_ms=round(took / len(done) * 1e3, 2))
    results.setdefault("gil_kept", {}).setdefault(name, []).append(kept)


def wait_latency(a, dump_dir: Path, samples) -> dict:
    """wait_for_dump called `appear_ms` before another thread writes the dump: how late it returns."""
    shutil.rmtree(dump_dir, ignore_errors=True)
    dump_dir.mkdir(parents=True)
    late = []
    for s in samples:
        written = []

        def later(s=s, written=written):
            time.sleep(a.appear_ms / 1e3)
            write_dump(dump_dir, s, layer_ids=LAYERS)
            written.append(time.perf_counter())

        th = threading.Thread(target=later)
        th.start()
        d = wait_for_dump(dump_dir, s.rid, timeout=5.0)
        got = time.perf_counter()
        th.join()
        assert d is not None
        late.append((got - written[0]) * 1e3)
        remove_dump(dump_dir, s.rid)
    late.sort()
    out = {
        "appear_ms": a.appear_ms,
        "samples": len(late),
        "late_ms_mean": round(sum(late) / len(late), 2),
        "late_ms_p90": round(late[int(0.9 * (len(late) - 1))], 2),
        "late_ms_max": round(late[-1], 2),
    }
    log(
        f"{'wait':10s} dump seen {out['late_ms_mean']:.2f} ms (mean), {out['late_ms_p90']:.2f} ms (p90), "
        f"{out['late_ms_max']:.2f} ms (max) after it was written (written {a.appear_ms} ms after the call)"
    )
    return out


def prepared_samples(work: Path, lengths: list[int], target: Path) -> Path:
    """A prepared dataset of samples with these prompt lengths, for the target's tokenizer."""
    from eyas.data.prepared import write_prepared
    from eyas.target import load_tokenizer, tokenizer_hash

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    samples = [(f"s{i}", token_ids(n).tolist(), [True] * n) for i, n in enumerate(lengths)]
    return write_prepared(
        work / "prep", {"train": samples, "eval": []}, {"tokenizer_hash": tokenizer_hash(load_tokenizer(target))}
    )


def free_forward_capture():
    """eyas.target.forward_capture replaced by one returning fixed states (rows of two random pools)."""
    g = torch.Generator().manual_seed(2)
    pool_BTAD = torch.randn(1, 2048, AUX, HIDDEN, generator=g).bfloat16()
    pool_BTD = torch.randn(1, 2048, HIDDEN, generator=g).bfloat16()

    def free_forward(model, input_ids_BT, attention_mask_BT=None, *, layer_ids):
        T = input_ids_BT.shape[1]
        return pool_BTAD[:, :T], pool_BTD[:, :T]

    return free_forward


def free_standin(a, target: Path, dump_dir: Path, *, batch_wait_s: float):
    """The stand-in with the bench's schedule, a free forward and a free next token: the server computes
    nothing. It leaves eyas.target.forward_capture replaced (the caller restores it where it matters)."""
    import eyas.target
    from eyas.sglang.standin import StandinConfig, StandinServer

    eyas.target.forward_capture = free_forward_capture()
    cfg = StandinConfig(
        target=target,
        dump_dir=dump_dir,
        layer_ids=LAYERS,
        max_forward_tokens=a.forward_tokens,
        chunked_prefill_size=a.chunk,
        pad_rows_to=1,
        batch_wait_s=batch_wait_s,
    )
    srv = StandinServer(cfg)
    srv.model.lm_head = torch.nn.Identity()  # the next token is not what is measured
    return srv


def run_e2e(a, lengths: list[int], dump_root: Path, store_root: Path, results: dict) -> None:
    """capture_from_sglang against the stand-in server with a free forward (see the module docstring)."""
    import eyas.target
    from eyas.defaults import default_target_dir
    from eyas.sglang.client import capture_from_sglang

    target = default_target_dir()
    work = store_root / "e2e"
    prepared = prepared_samples(work, lengths, target)
    real_forward = eyas.target.forward_capture
    dump_dir = dump_root / "e2e"
    shutil.rmtree(dump_dir, ignore_errors=True)
    try:
        srv = free_standin(a, target, dump_dir, batch_wait_s=0.001)
        with srv:
            t0 = clock()
            out = capture_from_sglang(
                [srv.url],
                prepared,
                "train",
                work / "store",
                LAYERS,
                target=target,
                concurrency=a.concurrency,
                calibrate=0,
            )
            cpu_s = clock()[1] - t0[1]
    finally:
        eyas.target.forward_capture = real_forward
        shutil.rmtree(dump_dir, ignore_errors=True)
    assert out["captured"] == len(lengths) and out["rejected_count"] == 0, out["rejected"][:3]
    # elapsed_s includes the set-up (preflight, probe, the store's identity hashes); loop_s, where the
    # client reports it, only the sending and ingesting
    stage(results, "e2e", out["tokens"], seconds=out["elapsed_s"], cpu_s=cpu_s, concurrency=a.concurrency)
    if out.get("loop_s"):
        stage(
            results,
            "e2e_loop",
            out["tokens"],
            seconds=out["loop_s"],
            concurrency=a.concurrency,
            **{k: out[k] for k in ("seconds_summed", "setup_seconds", "beside_loop_seconds") if k in out},
        )
    shutil.rmtree(work, ignore_errors=True)


def serve_model(a) -> None:
    """The model's server (run in a child process): the stand-in whose every forward sleeps what a GPU
    server's would take (--model-fixed-ms plus its tokens / --model-rate, less the time it took), does
    not wait for its dumps (SGLang does not), and answers with the first token of a free model."""
    from eyas.defaults import default_target_dir

    srv = free_standin(a, default_target_dir(), a.serve_model, batch_wait_s=0.0)
    srv.flush = lambda: None
    forward = srv._forward

    def timed(running):
        t0, before = time.perf_counter(), sum(r.computed for r in running)
        out = forward(running)
        cost = a.model_fixed_ms / 1e3 + (sum(r.computed for r in running) - before) / a.model_rate
        time.sleep(max(0.0, cost - (time.perf_counter() - t0)))
        return out

    srv._forward = timed
    with srv:
        print(srv.url, flush=True)
        sys.stdin.read()  # until the parent closes the pipe


def prefill_tokens_per_s(url: str, prepared: Path, concurrency: int, bypass: str) -> tuple[int, float]:
    """The samples sent without the eyas rid (no dump is written): the server's prefill rate."""
    import concurrent.futures as cf

    from eyas.data.prepared import PreparedDataset
    from eyas.sglang.request import build_request
    from eyas.sglang.server import generate

    split = PreparedDataset(prepared).split("train")
    run = os.urandom(3).hex()

    def one(i: int) -> int:
        body = build_request(split[i].input_ids.tolist(), f"plain-{run}-{i}", bypass)
        return int(generate(url, body, timeout=600)["meta_info"]["prompt_tokens"])

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(len(split))))
    return tokens, time.perf_counter() - t0


CLIENTS = ("current", "whole", "readinto", "procs", "switch")
"""--model-client: this tree's client; `whole`: the same with /generate's answers parsed whole (the client
before parse_answer cut out the logprob lists); `readinto`: the same with each dump read by `read_into`
instead of the safetensors package (a candidate, not the product's path); `procs`: this tree's client with
--model-procs worker processes sending, reading, checking and encoding (`eyas capture --sglang-procs`);
`switch`: this tree's client with its loop's thread switch interval (SWITCH_INTERVAL_S) at --model-switch-ms,
the prefill beside it unchanged (a thread back from a syscall or a torch op waits up to that long for the GIL
while another runs Python)."""


def read_into(path) -> dict[str, torch.Tensor]:
    """A dump's safetensors file read with readinto into one malloc'd buffer (no GIL while the kernel copies),
    where the safetensors package maps the file and the client's many threads then unmap it (a TLB shootdown
    on every core the process runs on, with the GIL held). The tensors are views of that buffer."""
    import struct

    from eyas.sglang.core import _SAFETENSORS_DTYPES

    by_name = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}
    with open(path, "rb", buffering=0) as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        size = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
        buf = torch.empty(size, dtype=torch.uint8)
        view, got = memoryview(buf.numpy()), 0
        while got < size:
            k = f.readinto(view[got:])
            if not k:
                raise ValueError(f"{path}: {got} of {size} data bytes (truncated)")
            got += k
    out = {}
    for name, v in header.items():
        a, b = map(int, v["data_offsets"])
        raw = buf[a:b] if a % by_name[v["dtype"]].itemsize == 0 else buf[a:b].clone()
        out[name] = raw.view(by_name[v["dtype"]]).reshape([int(x) for x in v["shape"]])
    return out


@contextlib.contextmanager
def client_variant(name: str, switch_s: float = 0.005):
    import safetensors.torch

    import eyas.sglang.sender as sender
    import eyas.sglang.server as server

    saved = server.parse_answer, safetensors.torch.load_file, sender.SWITCH_INTERVAL_S
    if name == "whole":
        server.parse_answer = json.loads
    if name == "readinto":  # read_dump imports load_file when it runs
        safetensors.torch.load_file = read_into
    if name == "switch":  # what the loop sets (at most Python's own interval, which this process leaves alone)
        sender.SWITCH_INTERVAL_S = switch_s
    try:
        yield
    finally:
        server.parse_answer, safetensors.torch.load_file, sender.SWITCH_INTERVAL_S = saved


def run_model(
    a, lengths: list[int], dump_root: Path, store_root: Path, results: dict, order: list[int], flip: bool
) -> None:
    """Prefill without dumps against capture, same server, at each concurrency of `order` and with each
    --model-client, the clients in reverse order when `flip` (module docstring). A warm-up prefill and a
    warm-up capture come first: the first capture after the server's start ran slower, whichever concurrency
    it had; and whichever client ran first after a prefill took more CPU, so the clients take turns."""
    from eyas.defaults import default_target_dir
    from eyas.sglang.client import capture_from_sglang

    target = default_target_dir()
    work = store_root / "model"
    prepared = prepared_samples(work, lengths, target)
    dump_dir = dump_root / "model"
    cmd = [sys.executable, __file__, "--serve-model", str(dump_dir), "--model-rate", str(a.model_rate)]
    cmd += ["--model-fixed-ms", str(a.model_fixed_ms), "--chunk", str(a.chunk)]
    cmd += ["--forward-tokens", str(a.forward_tokens)]
    server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        if not url.startswith("http"):
            raise SystemExit(f"the model's server did not start (exit {server.wait()})")
        bypass = a.model_bypass
        prefill_tokens_per_s(url, prepared, 4, bypass)  # warm-up
        capture_from_sglang(
            [url],
            prepared,
            "train",
            work / "warm",
            LAYERS,
            target=target,
            limit=64,
            concurrency=max(order),
            calibrate=0,
            cache_bypass=bypass,
        )
        clients = a.model_client[:: -1 if flip else 1]
        for c in order:
            for variant in clients:
                name = f"c{c}" if variant == "current" else f"c{c}_{variant}"
                with client_variant(variant, a.model_switch_ms / 1000):
                    tokens, seconds = prefill_tokens_per_s(url, prepared, c, bypass)
                    stage(results, f"model_prefill_{name}", tokens, seconds=seconds)
                    shutil.rmtree(work / "store", ignore_errors=True)
                    cpu0 = time.process_time()  # this process is the client alone: the server runs in the child
                    out = capture_from_sglang(
                        [url],
                        prepared,
                        "train",
                        work / "store",
                        LAYERS,
                        target=target,
                        concurrency=c,
                        calibrate=0,
                        cache_bypass=bypass,
                        procs=a.model_procs if variant == "procs" else 0,
                    )
                cpu_s = time.process_time() - cpu0
                assert out["captured"] == len(lengths) and out["rejected_count"] == 0, out["rejected"][:3]
                ratio = round(out["tokens"] / out["loop_s"] / (tokens / seconds), 4)
                stage(
                    results,
                    f"model_capture_{name}",
                    out["tokens"],
                    seconds=out["loop_s"],
                    cpu_s=cpu_s,
                    vs_prefill=ratio,
                    in_flight=out.get("in_flight_mean"),  # requests at the server on average, of c
                    gate_s=out["seconds_summed"].get("gate"),  # summed waits for a slot: ~0, none was waiting
                )
                results.setdefault("model_ratios", {}).setdefault(name, []).append(ratio)
    finally:
        server.stdin.close()
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(dump_dir, ignore_errors=True)


def run_threads(a, lengths: list[int], results: dict) -> None:
    """check_sample's finiteness test and the stacking, on 2 x --concurrency threads as the client runs
    them, with torch's default intra-op threads per thread and with one (what the client sets)."""
    import concurrent.futures as cf

    from eyas.sglang.core import all_finite

    g = torch.Generator().manual_seed(3)
    pool = [
        (torch.randn(n, AUX, HIDDEN, generator=g).bfloat16(), torch.randn(n, HIDDEN, generator=g).bfloat16())
        for n in lengths[:64]
    ]
    tokens = sum(pool[i % len(pool)][0].shape[0] for i in range(len(lengths)))

    def work(i: int) -> None:
        aux, final = pool[i % len(pool)]
        all_finite(aux), all_finite(final)
        torch.cat([aux, final.unsqueeze(1)], dim=1)

    default = torch.get_num_threads()
    for name, init in (("threads_default", None), ("threads_one", (1,))):
        kw = {"initializer": torch.set_num_threads, "initargs": init} if init else {}
        with cf.ThreadPoolExecutor(2 * a.concurrency, **kw) as ex:
            t0 = clock()
            list(ex.map(work, range(len(lengths))))
            stage(results, name, tokens, t0, threads=2 * a.concurrency)
        torch.set_num_threads(default)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--e2e-samples", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=8192, help="SGLang --chunked-prefill-size")
    ap.add_argument("--forward-tokens", type=int, default=10240, help="token budget of one EXTEND forward")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument(
        "--appear-ms", type=float, default=15.0, help="wait stage: the dump appears this long after the call"
    )
    ap.add_argument("--wait-samples", type=int, default=40)
    ap.add_argument(
        "--dump-dir", type=Path, default=None, help="default: a directory under /dev/shm (else the temp dir)"
    )
    ap.add_argument("--store-dir", type=Path, default=None, help="where stores are written (default: the temp dir)")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument(
        "--gil-steps",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[0, 50],
        help="gil stages: Python steps between the scheduler thread's torch calls (0: none), comma-separated",
    )
    ap.add_argument("--handoff-samples", type=int, default=64, help="handoff stages: dumps handed over (0: skip)")
    ap.add_argument("--handoff-procs", type=int, default=2, help="handoff stages: processes checking the dumps")
    ap.add_argument("--model-rate", type=float, default=0.0, help="model stage: the server's tokens/s (0: skip)")
    ap.add_argument("--model-fixed-ms", type=float, default=5.0, help="model stage: each forward's fixed cost")
    ap.add_argument(
        "--model-concurrency",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[16, 32],
        help="model stage: requests in flight, comma-separated",
    )
    ap.add_argument("--model-samples", type=int, default=768)
    ap.add_argument(
        "--model-bypass",
        choices=("plugin", "logprob", "none"),
        default="plugin",
        help="model stage: the radix-cache bypass both arms send (plugin: nothing extra, what a server with plugin "
        "version 3 gets; logprob: what older plugins on SGLang 0.5.17 get, whose answers list every prompt token's "
        "logprob)",
    )
    ap.add_argument(
        "--switch-ms",
        type=lambda v: [float(x) for x in v.split(",") if x],
        default=[5.0, 1.0, 0.2],
        help="switch stages: Python thread switch intervals, ms ('' skips them)",
    )
    ap.add_argument("--switch-busy", type=int, default=1, help="switch stages: threads running Python beside")
    ap.add_argument("--model-procs", type=int, default=4, help="model stage: worker processes of `procs`")
    ap.add_argument(
        "--model-switch-ms", type=float, default=0.2, help="model stage: the `switch` client's thread switch interval"
    )
    ap.add_argument(
        "--model-client",
        type=lambda v: [x for x in v.split(",") if x],
        default=["current"],
        help=f"model stage: clients measured in turn, comma-separated, of {', '.join(CLIENTS)} (see CLIENTS)",
    )
    ap.add_argument("--only-model", action="store_true", help="run the model stage alone")
    ap.add_argument("--serve-model", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=3, help="run everything this often; each stage keeps its fastest run")
    a = ap.parse_args()
    if a.serve_model is not None:
        return serve_model(a)
    if a.only_model and not a.model_rate:
        ap.error("--only-model needs --model-rate")
    if set(a.model_client) - set(CLIENTS):
        ap.error(f"--model-client: {','.join(a.model_client)}, expected some of {', '.join(CLIENTS)}")
    shm = Path("/dev/shm")
    dump_root = a.dump_dir or Path(tempfile.mkdtemp(prefix="eyas-capture-path-", dir=shm if shm.is_dir() else None))
    store_root = a.store_dir or Path(tempfile.mkdtemp(prefix="eyas-capture-path-"))
    results: dict = {}
    lengths = sample_lengths(a.samples, a.seed)
    try:
        for k in range(a.repeat):
            log(f"-- run {k + 1} of {a.repeat}")
            if not a.only_model:
                run_stages(a, lengths, dump_root, store_root, results, flip=bool(k % 2))
                run_threads(a, lengths, results)
                if not a.no_e2e:
                    run_e2e(a, sample_lengths(a.e2e_samples, a.seed + 1), dump_root, store_root, results)
            if a.model_rate:  # the concurrencies in the given order, then reversed, alternating over the runs
                order = a.model_concurrency[:: -1 if k % 2 else 1]
                lengths = sample_lengths(a.model_samples, a.seed + 2)
                run_model(a, lengths, dump_root, store_root, results, order, flip=bool(k % 2))
    finally:
        if a.dump_dir is None:
            shutil.rmtree(dump_root, ignore_errors=True)
        if a.store_dir is None:
            shutil.rmtree(store_root, ignore_errors=True)
    print(
        json.dumps(
            {
                "benchmark": "capture_path",
                "hidden": HIDDEN,
                "aux": AUX,
                "dtype": "bf16",
                "samples": len(lengths),
                "tokens": sum(lengths),
                "mean_tokens": round(sum(lengths) / len(lengths), 1),
                "repeat": a.repeat,
                "cpus": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "stages": results,
            }
        )
    )


if __name__ == "__main__":
    main()
