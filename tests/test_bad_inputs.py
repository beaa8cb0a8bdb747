"""Bad inputs for every subcommand: each fails with exit 2 and one line naming what was wrong, never
a traceback, never a silent success, never a deleted user file.

Most cases run under `no_model_loads`, which makes any model load an error: they must be refused
from the inputs alone. Classes (the `CASES` ids start with them):
  text     non-UTF-8 / random-byte chat, prompt and config files
  struct   malformed structure: prompts fields, manifest fields, model_type, garbage safetensors
  option   NaN, negative, out-of-range numbers and unknown enum strings
  outfile  --out that is an existing file
  rofs     --out on a read-only filesystem
  owner    --overwrite / --out on a directory eyas did not create (or created for another stage)
  url      malformed server URLs and layer lists
Further tests below: corrupt training data (checksum, NaN, duplicate), a drafter with NaN weights
in eval, checkpoints without pickle, the guard for unexpected exceptions, metrics de-duplication
and the disk margin.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from eyas.cli import app
from eyas.errors import EyasError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------------------------
# inputs on disk


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """A directory of bad and good inputs, by name."""
    root = tmp_path_factory.mktemp("bad_inputs")
    rng = random.Random(0)
    p = {"root": root}
    p["nonutf8"] = root / "latin1.jsonl"
    p["nonutf8"].write_bytes('{"conversations": [{"from": "human", "value": "caf\u00e9"}]}\n'.encode("latin-1"))
    p["random"] = root / "random.jsonl"
    p["random"].write_bytes(bytes(rng.randrange(256) for _ in range(4096)))
    p["random_json"] = root / "random.json"
    p["random_json"].write_bytes(b"[" + bytes(rng.randrange(128, 256) for _ in range(512)))
    p["turns5"] = root / "turns5.jsonl"
    p["turns5"].write_text('{"turns": 5}\n')
    p["file"] = root / "a_file"
    p["file"].write_text("user's file\n")
    p["dir"] = root / "some_dir"  # an existing directory for options that only need one
    p["dir"].mkdir()
    # a user's directory: notes, and a metrics.jsonl of their own
    p["user"] = root / "user_dir"
    p["user"].mkdir()
    (p["user"] / "notes.txt").write_text("do not delete\n")
    (p["user"] / "metrics.jsonl").write_text('{"mine": 1}\n')
    (p["user"] / "meta.json").write_text("{}\n")
    # an eyas output of another stage (a prepared dataset) for regenerate --overwrite
    from eyas.common import write_marker

    p["prepared_like"] = root / "prepared_like"
    p["prepared_like"].mkdir()
    (p["prepared_like"] / "meta.json").write_text("{}\n")
    write_marker(p["prepared_like"], kind="prepare")
    # a training run written before runs had a kind (marker kind null): still recognised as one
    p["train_run"] = root / "train_run"
    (p["train_run"] / "checkpoints").mkdir(parents=True)
    (p["train_run"] / "checkpoints" / "step-000002.safetensors").write_bytes(b"x")
    (p["train_run"] / "metrics.jsonl").write_text('{"step": 2}\n')
    (p["train_run"] / "drafter").mkdir()  # the run's drafter: eyas wrote it, yet it carries no marker of its own
    (p["train_run"] / "drafter" / "config.json").write_text("{}\n")
    write_marker(p["train_run"])
    # a target whose model_type transformers does not know, and one whose config is random bytes
    p["bogus_target"] = root / "bogus_target"
    p["bogus_target"].mkdir()
    (p["bogus_target"] / "config.json").write_text(json.dumps({"model_type": "bogus_arch", "hidden_size": 8}))
    p["binary_target"] = root / "binary_target"
    p["binary_target"].mkdir()
    (p["binary_target"] / "config.json").write_bytes(bytes(rng.randrange(256) for _ in range(256)))
    # a store whose manifest lacks fields
    p["store_nofields"] = root / "store_nofields"
    p["store_nofields"].mkdir()
    from eyas.store.format import MANIFEST, SCHEMA

    (p["store_nofields"] / MANIFEST).write_text(json.dumps({"schema": SCHEMA, "samples": []}))
    # a drafter directory with a garbage weights file
    p["garbage_drafter"] = root / "garbage_drafter"
    p["garbage_drafter"].mkdir()
    (p["garbage_drafter"] / "config.json").write_text("{}")
    (p["garbage_drafter"] / "model.safetensors").write_bytes(bytes(rng.randrange(256) for _ in range(1000)))
    # a drafter directory whose config.json is `{}` (valid weights), and a prompts file
    from safetensors.torch import save_file

    p["empty_cfg_drafter"] = root / "empty_cfg_drafter"
    p["empty_cfg_drafter"].mkdir()
    (p["empty_cfg_drafter"] / "config.json").write_text("{}")
    save_file({"fc.weight": torch.zeros(2, 2)}, str(p["empty_cfg_drafter"] / "model.safetensors"))
    p["prompts"] = root / "prompts.jsonl"
    p["prompts"].write_text('{"turns": ["Hi"]}\n')
    for name in ("ro", "ro_owned"):
        p[name] = root / name
        p[name].mkdir()
    return p


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: these inputs must be refused before one."""
    import transformers

    import eyas.target

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(eyas.target, "load_target", boom)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)


@pytest.fixture
def read_only(monkeypatch, bad):
    """Make bad['ro'] look like a read-only filesystem (the tests run as root, where chmod cannot)."""
    import eyas.common

    real_access = os.access
    ro = str(bad["ro"])
    monkeypatch.setattr(
        os,
        "access",
        lambda path, mode, **k: False if str(path).startswith(ro) and mode & os.W_OK else real_access(path, mode, **k),
    )
    monkeypatch.setattr(eyas.common, "_read_only_fs", lambda path: str(path).startswith(ro))


def _run(args: list[str], env: dict | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def _one_line_error(r) -> str:
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert lines, f"no message on stderr (exit {r.exit_code})"
    assert "Traceback" not in r.stderr and r.exception is None or isinstance(r.exception, SystemExit), r.stderr
    return lines[-1]


# (id, args with {name} placeholders into `bad`, message regex). Every case must exit 2.
D = "{dir}"
CASES = [
    # text: non-UTF-8 / random bytes
    (
        "text-prepare-latin1",
        ["prepare", "--source", "{nonutf8}", "--out", "{root}/o1"],
        r"latin1\.jsonl.*line 1.*not UTF-8",
    ),
    (
        "text-prepare-random",
        ["prepare", "--source", "{random}", "--out", "{root}/o1"],
        r"random\.jsonl.*(not UTF-8|NUL|malformed JSON)",
    ),
    (
        "text-prepare-random-json",
        ["prepare", "--source", "{random_json}", "--out", "{root}/o1"],
        r"random\.json.*not UTF-8",
    ),
    (
        "text-regenerate-latin1",
        ["regenerate", "--source", "{nonutf8}", "--out", "{root}/o2", "--device", "cpu"],
        r"latin1\.jsonl.*not UTF-8",
    ),
    (
        "text-regenerate-random",
        ["regenerate", "--source", "{random}", "--out", "{root}/o2", "--device", "cpu"],
        r"random\.jsonl",
    ),
    (
        "text-eval-prompts-latin1",
        ["eval", "--drafter", D, "--prompts", "{nonutf8}", "--out", "{root}/o3", "--device", "cpu"],
        r"--prompts .*not UTF-8",
    ),
    (
        "text-eval-prompts-random",
        ["eval", "--drafter", D, "--prompts", "{random}", "--out", "{root}/o3", "--device", "cpu"],
        r"--prompts .*random\.jsonl",
    ),
    (
        "text-prepare-target-config",
        ["prepare", "--target", "{binary_target}", "--out", "{root}/o1"],
        r"config\.json.*(not UTF-8|NUL)",
    ),
    # struct: malformed structure
    (
        "struct-eval-turns-int",
        ["eval", "--drafter", D, "--prompts", "{turns5}", "--out", "{root}/o3", "--device", "cpu"],
        r"turns5\.jsonl:1: needs \"turns\"",
    ),
    (
        "struct-prepare-model-type",
        ["prepare", "--target", "{bogus_target}", "--out", "{root}/o1"],
        r"model_type 'bogus_arch' is unknown",
    ),
    (
        "struct-train-model-type",
        ["train", "--target", "{bogus_target}", "--data", D, "--out", "{root}/o4"],
        r"model_type 'bogus_arch'",
    ),
    (
        "struct-capture-model-type",
        ["capture", "--target", "{bogus_target}", "--data", D, "--out", "{root}/o5"],
        r"model_type 'bogus_arch'",
    ),
    ("struct-verify-manifest", ["verify", "--store", "{store_nofields}"], r"manifest has no `dtype` field"),
    (
        "struct-train-manifest",
        ["train", "--store", "{store_nofields}", "--out", "{root}/o4"],
        r"manifest has no `dtype` field",
    ),
    (
        "struct-eval-garbage-weights",
        ["eval", "--drafter", "{garbage_drafter}", "--out", "{root}/o3", "--device", "cpu"],
        r"model\.safetensors is not a valid safetensors file",
    ),
    (
        "struct-export-garbage-weights",
        ["export", "--drafter", "{garbage_drafter}", "--format", "sglang", "--out", "{root}/o6"],
        r"model\.safetensors is not a valid safetensors file",
    ),
    (
        "struct-eval-missing-drafter",
        ["eval", "--drafter", "{root}/nope", "--out", "{root}/o3"],
        r"--drafter .*nope is not a directory",
    ),
    # option: numbers and enums
    (
        "option-train-lr-nan",
        ["train", "--data", D, "--out", "{root}/o4", "--lr", "nan"],
        r"--lr must be a finite number, got nan",
    ),
    (
        "option-train-lr-inf",
        ["train", "--data", D, "--out", "{root}/o4", "--lr", "inf"],
        r"--lr must be a finite number",
    ),
    (
        "option-train-attention",
        ["train", "--data", D, "--out", "{root}/o4", "--attention", "bogus"],
        r"--attention must be one of fast, reference; got 'bogus'",
    ),
    (
        "option-train-grad-reduce",
        ["train", "--data", D, "--out", "{root}/o4", "--grad-reduce", "fp8"],
        r"--grad-reduce must be one of fp32, bf16; got 'fp8'",
    ),
    (
        "option-train-grad-reduce-fsdp",
        ["train", "--data", D, "--out", "{root}/o4", "--grad-reduce", "bf16", "--fsdp"],
        r"--grad-reduce bf16 applies to DDP; --fsdp always reduces in fp32",
    ),
    (
        "option-train-draft-vocab-0",
        ["train", "--data", D, "--out", "{root}/o4", "--draft-vocab", "0"],
        r"--draft-vocab must be >= 1, got 0",
    ),
    (
        "option-train-warmup-neg",
        ["train", "--data", D, "--out", "{root}/o4", "--warmup-steps", "-1"],
        r"--warmup-steps must be >= 0, got -1",
    ),
    (
        "option-train-save-every-neg",
        ["train", "--data", D, "--out", "{root}/o4", "--save-every", "-3"],
        r"--save-every must be >= 0",
    ),
    (
        "option-train-grad-clip-neg",
        ["train", "--data", D, "--out", "{root}/o4", "--grad-clip", "-1"],
        r"--grad-clip must be >= 0",
    ),
    (
        "option-train-min-lr-ratio",
        ["train", "--data", D, "--out", "{root}/o4", "--min-lr-ratio", "5"],
        r"--min-lr-ratio must be >= 0 and <= 1, got 5",
    ),
    (
        "option-train-ttt-decay",
        ["train", "--data", D, "--out", "{root}/o4", "--ttt-decay", "-1"],
        r"--ttt-decay must be > 0 and <= 1",
    ),
    (
        "option-train-device",
        ["train", "--data", D, "--out", "{root}/o4", "--device", "tpu"],
        r"--device must be auto, cpu, cuda or cuda:N; got 'tpu'",
    ),
    ("option-train-aux-layers", ["train", "--data", D, "--out", "{root}/o4", "--aux-layers", "1,x"], r"--aux-layers"),
    (
        "option-train-resume-missing",
        ["train", "--data", D, "--out", "{root}/o4", "--resume", "{root}/none.safetensors"],
        r"--resume .*no such checkpoint",
    ),
    (
        "option-capture-queue-depth",
        ["capture", "--data", D, "--out", "{root}/o5", "--queue-depth", "0"],
        r"--queue-depth must be >= 1, got 0",
    ),
    ("option-capture-device", ["capture", "--data", D, "--out", "{root}/o5", "--device", "tpu"], r"--device"),
    ("option-capture-dtype", ["capture", "--data", D, "--out", "{root}/o5", "--store-dtype", "int3"], r"int3"),
    ("option-capture-backend", ["capture", "--data", D, "--out", "{root}/o5", "--backend", "vllm"], r"--backend"),
    (
        "option-eval-device",
        ["eval", "--drafter", D, "--out", "{root}/o3", "--device", "tpu"],
        r"--device must be auto, cpu, cuda or cuda:N; got 'tpu'",
    ),
    (
        "option-eval-max-new",
        ["eval", "--drafter", D, "--out", "{root}/o3", "--max-new-tokens", "0"],
        r"--max-new-tokens must be >= 1",
    ),
    (
        "option-eval-dtype",
        ["eval", "--drafter", D, "--out", "{root}/o3", "--model-dtype", "fp4"],
        r"--model-dtype fp4: not a dtype eyas knows; it takes auto, fp32, bf16, fp16",
    ),
    (
        "option-eval-dtype-fp8",
        ["eval", "--drafter", D, "--out", "{root}/o3", "--model-dtype", "float8_e4m3fn"],
        r"--model-dtype float8_e4m3fn: fp8 is not supported here; it takes auto, fp32, bf16, fp16 \(or the long names float32, bfloat16, float16\)$",
    ),
    (
        "option-export-dtype-int8",
        ["export", "--drafter", D, "--format", "sglang", "--out", "{root}/o6", "--weights-dtype", "int8"],
        r"--weights-dtype int8: not a dtype eyas knows; it takes keep, fp32, bf16, fp16 \(or the long names float32, bfloat16, float16\)$",
    ),
    (
        "struct-eval-drafter-no-config",
        ["eval", "--drafter", D, "--prompts", "{prompts}", "--out", "{root}/o3", "--device", "cpu"],
        r"--drafter .*some_dir: no config\.json",
    ),
    (
        "struct-eval-drafter-empty-config",
        ["eval", "--drafter", "{empty_cfg_drafter}", "--prompts", "{prompts}", "--out", "{root}/o3", "--device", "cpu"],
        r"--drafter .*empty_cfg_drafter/config\.json: cannot tell the drafter layout",
    ),
    (
        "option-train-aux-layers-range",
        ["train", "--data", D, "--out", "{root}/o4", "--aux-layers", "2,15,99"],
        r"--aux-layers \(target .*\): ids \[2, 15, 99\] include \[99\]",
    ),
    (
        "option-train-draft-vocab-range",
        ["train", "--data", D, "--out", "{root}/o4", "--draft-vocab", "100000"],
        r"--draft-vocab 100000 exceeds the vocabulary of target .*\(49152 tokens\)",
    ),
    (
        "option-train-eval-store-online",
        ["train", "--data", D, "--out", "{root}/o4", "--eval-store", D],
        r"--eval-store is for offline training \(--store\)",
    ),
    (
        "option-train-cache-states-offline",
        ["train", "--store", D, "--out", "{root}/o4", "--cache-states"],
        r"--cache-states .*online training \(--data\); with --store",
    ),
    (
        "option-prepare-hf-split-file",
        ["prepare", "--source", "{turns5}", "--out", "{root}/o1", "--hf-split", "validation"],
        r"--hf-split validation: --source .*turns5\.jsonl is a file, not a DatasetDict",
    ),
    (
        "option-regenerate-hf-split-file",
        ["regenerate", "--source", "{turns5}", "--out", "{root}/o2", "--hf-split", "validation"],
        r"--hf-split validation: --source .*turns5\.jsonl is a file",
    ),
    (
        "option-regenerate-attention-generate",
        ["regenerate", "--source", "{nonutf8}", "--out", "{root}/o2", "--engine", "generate", "--attention", "triton"],
        r"--attention triton .*--engine generate does not use it",
    ),
    (
        "option-regenerate-server-model",
        ["regenerate", "--source", "{nonutf8}", "--out", "{root}/o2", "--server-model", "foo"],
        r"--server-model foo .*pass --server-url too",
    ),
    ("option-pipeline-directory", ["pipeline", D], r"pipeline file .*some_dir is a directory, expected a file"),
    (
        "option-eval-tree-topk",
        ["eval", "--drafter", D, "--out", "{root}/o3", "--tree-topk", "0"],
        r"--tree-topk must be >= 1",
    ),
    ("option-prepare-eval-fraction", ["prepare", "--out", "{root}/o1", "--eval-fraction", "nan"], r"--eval-fraction"),
    ("option-prepare-policy", ["prepare", "--out", "{root}/o1", "--length-policy", "squash"], r"--length-policy"),
    (
        "option-prepare-source-missing",
        ["prepare", "--source", "{root}/nope.jsonl", "--out", "{root}/o1"],
        r"--source .*nope\.jsonl does not exist",
    ),
    (
        "option-regenerate-temperature",
        ["regenerate", "--source", "{nonutf8}", "--out", "{root}/o2", "--temperature", "nan"],
        r"--temperature must be a finite number",
    ),
    (
        "option-regenerate-top-p",
        ["regenerate", "--source", "{nonutf8}", "--out", "{root}/o2", "--top-p", "2"],
        r"--top-p must be > 0 and <= 1, got 2",
    ),
    (
        "option-regenerate-device",
        ["regenerate", "--source", "{nonutf8}", "--out", "{root}/o2", "--device", "tpu"],
        r"--device",
    ),
    (
        "option-regenerate-timeout",
        ["regenerate", "--source", "{nonutf8}", "--out", "{root}/o2", "--request-timeout", "-5"],
        r"--request-timeout must be > 0",
    ),
    ("option-export-format", ["export", "--drafter", D, "--format", "onnx", "--out", "{root}/o6"], r"--format 'onnx'"),
    (
        "option-export-verifier-empty-dir",
        ["export", "--drafter", D, "--format", "vllm", "--out", "{root}/o6", "--verifier", D],
        r"--verifier .*some_dir: a directory without config\.json; expected a Hub repository id OWNER/NAME or a model directory with config\.json$",
    ),
    (
        "option-export-verifier-not-vllm",
        ["export", "--drafter", D, "--format", "sglang", "--out", "{root}/o6", "--verifier", "foo/bar"],
        r"--verifier only applies to --format vllm .*not --format sglang",
    ),
    (
        "option-export-target-layers",
        ["export", "--drafter", D, "--format", "sglang", "--out", "{root}/o6", "--target-layers", "0"],
        r"--target-layers must be >= 1",
    ),
    ("option-verify-numbers", ["verify", "--store", D, "--numbers", "-1"], r"--numbers must be >= 0"),
    ("option-verify-tolerance", ["verify", "--store", D, "--tolerance", "nan"], r"--tolerance must be a finite number"),
    ("option-verify-device", ["verify", "--store", D, "--device", "tpu"], r"--device"),
    ("option-verify-store-missing", ["verify", "--store", "{root}/nope"], r"--store .*nope is not a directory"),
    ("option-demo-lr", ["demo", "--out", "{root}/o7", "--lr", "nan"], r"--lr must be a finite number"),
    ("option-demo-device", ["demo", "--out", "{root}/o7", "--device", "tpu"], r"--device must be cpu or cuda"),
    (
        "option-verify-server-bypass",
        ["verify-server", "--url", "http://127.0.0.1:9", "--sglang-cache-bypass", "maybe"],
        r"--sglang-cache-bypass must be one of",
    ),
    (
        "option-verify-server-prompt",
        ["verify-server", "--url", "http://127.0.0.1:9", "--prompt-tokens", "3"],
        r"--prompt-tokens must be >= 8",
    ),
    # url: malformed server addresses and layer lists
    ("url-verify-server-url", ["verify-server", "--url", "not a url"], r"--url 'not a url' is not an http\(s\) URL"),
    ("url-verify-server-port", ["verify-server", "--url", "http://host:99999"], r"--url .* is not an http\(s\) URL"),
    (
        "url-verify-server-layers",
        ["verify-server", "--url", "http://127.0.0.1:9", "--aux-layers", "2,x"],
        r"--aux-layers: expected comma-separated integers",
    ),
    (
        "url-verify-server-layers-neg",
        ["verify-server", "--url", "http://127.0.0.1:9", "--aux-layers", "-1,2"],
        r"--aux-layers: values must be >= 0",
    ),
    (
        "url-capture-sglang-url",
        ["capture", "--backend", "sglang", "--data", D, "--out", "{root}/o5", "--url", "ftp://x"],
        r"--url 'ftp://x' is not an http\(s\) URL",
    ),
    (
        "url-regenerate-server-url",
        ["regenerate", "--source", "{nonutf8}", "--out", "{root}/o2", "--server-url", "localhost:8000"],
        r"--server-url 'localhost:8000'",
    ),
    # outfile: --out is an existing file
    ("outfile-prepare", ["prepare", "--out", "{file}"], r"--out .*a_file is an existing file"),
    ("outfile-capture", ["capture", "--data", D, "--out", "{file}"], r"--out .*a_file is an existing file"),
    ("outfile-train", ["train", "--data", D, "--out", "{file}"], r"--out .*a_file is an existing file"),
    (
        "outfile-eval",
        ["eval", "--drafter", D, "--out", "{file}", "--device", "cpu"],
        r"--out .*a_file is an existing file",
    ),
    (
        "outfile-regenerate",
        ["regenerate", "--source", "{nonutf8}", "--out", "{file}"],
        r"--out .*a_file is an existing file",
    ),
    (
        "outfile-export",
        ["export", "--drafter", D, "--format", "sglang", "--out", "{file}"],
        r"--out .*a_file is an existing file",
    ),
    ("outfile-demo", ["demo", "--out", "{file}"], r"--out .*a_file is an existing file"),
    (
        "outfile-under-file",
        ["prepare", "--out", "{file}/sub"],
        r"a_file is a file, so no directory can be created under it",
    ),
    # owner: never delete or write into what eyas did not create
    (
        "owner-prepare-overwrite",
        ["prepare", "--out", "{user}", "--overwrite"],
        r"--overwrite: .*user_dir holds files eyas did not create",
    ),
    (
        "owner-regenerate-overwrite",
        ["regenerate", "--source", "{nonutf8}", "--out", "{user}", "--overwrite"],
        r"--overwrite: .*user_dir holds files eyas did not create",
    ),
    (
        "owner-regenerate-other-stage",
        ["regenerate", "--source", "{nonutf8}", "--out", "{prepared_like}", "--overwrite"],
        r"is an eyas `prepare` output, not a `regenerate` output",
    ),
    (
        "owner-demo-overwrite",
        ["demo", "--out", "{user}", "--overwrite"],
        r"--overwrite: .*user_dir holds files eyas did not create",
    ),
    ("owner-demo-out", ["demo", "--out", "{user}"], r"--out: .*user_dir holds files eyas did not create"),
    (
        "owner-eval-overwrite",
        ["eval", "--drafter", D, "--out", "{user}", "--overwrite", "--device", "cpu"],
        r"--overwrite: .*user_dir holds files eyas did not create",
    ),
    (
        "owner-export-overwrite",
        ["export", "--drafter", D, "--format", "vllm", "--out", "{user}", "--overwrite"],
        r"--overwrite: .*user_dir holds files eyas did not create",
    ),
    (
        "owner-train-out",
        ["train", "--data", D, "--out", "{user}"],
        r"--out: .*user_dir holds files eyas did not create",
    ),
    (
        "owner-capture-out",
        ["capture", "--data", D, "--out", "{user}"],
        r"--out: .*user_dir holds files eyas did not create",
    ),
    # owner: another stage's eyas output (a kind check, before anything is written into it or deleted)
    (
        "owner-demo-other-stage",
        ["demo", "--out", "{prepared_like}", "--overwrite"],
        r"--overwrite: .*prepared_like is an eyas `prepare` output, not a `demo` output",
    ),
    (
        "owner-demo-out-other-stage",
        ["demo", "--out", "{prepared_like}"],
        r"--out: .*prepared_like is an eyas `prepare` output, not a `demo` output",
    ),
    (
        "owner-prepare-over-train-run",
        ["prepare", "--out", "{train_run}", "--overwrite"],
        r"--overwrite: .*train_run is an eyas `train` output, not a `prepare` output",
    ),
    (
        "owner-train-out-other-stage",
        ["train", "--data", D, "--out", "{prepared_like}"],
        r"--out: .*prepared_like is an eyas `prepare` output, not a `train` output",
    ),
    (
        "owner-capture-out-other-stage",
        ["capture", "--data", D, "--out", "{prepared_like}"],
        r"--out: .*prepared_like is an eyas `prepare` output, not a `store` output",
    ),
    # owner: a training run's drafter/ is part of that run, not a directory of the user's nor an export
    (
        "owner-export-over-train-drafter",
        ["export", "--drafter", D, "--format", "sglang", "--out", "{train_run}/drafter", "--overwrite"],
        r"--overwrite: .*train_run/drafter is the `drafter` folder of the eyas `train` output .*train_run, not an output of its own; refusing to replace it",
    ),
    (
        "owner-export-into-train-drafter",
        ["export", "--drafter", D, "--format", "sglang", "--out", "{train_run}/drafter"],
        r"^(?!.*--overwrite).*--out: .*train_run/drafter is the `drafter` folder of the eyas `train` output",
    ),
    # owner: without --overwrite, a user's directory is refused without suggesting --overwrite (which is refused too)
    (
        "owner-prepare-out-user",
        ["prepare", "--out", "{user}"],
        r"^(?!.*--overwrite).*--out: .*user_dir holds files eyas did not create",
    ),
    (
        "owner-eval-out-user",
        ["eval", "--drafter", D, "--out", "{user}", "--device", "cpu"],
        r"^(?!.*--overwrite).*--out: .*user_dir holds files eyas did not create",
    ),
    (
        "owner-export-out-user",
        ["export", "--drafter", D, "--format", "sglang", "--out", "{user}"],
        r"^(?!.*--overwrite).*--out: .*user_dir holds files eyas did not create",
    ),
    (
        "owner-export-other-stage",
        ["export", "--drafter", D, "--format", "sglang", "--out", "{train_run}", "--overwrite"],
        r"--overwrite: .*train_run is an eyas `train` output, not a `export` output",
    ),
    # owner: generate's --out file (existing: only with --overwrite, and only generate's own records)
    (
        "owner-generate-existing-file",
        ["generate", "--drafter", D, "--out", "{file}"],
        r"--out .*a_file already exists: pass --overwrite",
    ),
    (
        "owner-generate-overwrite-user-file",
        ["generate", "--drafter", D, "--out", "{file}", "--overwrite"],
        r"--overwrite: .*a_file is not an `eyas generate` records file \(line 1",
    ),
    (
        "outfile-generate-under-file",
        ["generate", "--drafter", D, "--out", "{file}/x.jsonl"],
        r"--out .*a_file/x\.jsonl: .*a_file is a file",
    ),
]

RO_CASES = [
    ("rofs-prepare", ["prepare", "--out", "{ro}/x"]),
    ("rofs-capture", ["capture", "--data", D, "--out", "{ro}/x"]),
    ("rofs-train", ["train", "--data", D, "--out", "{ro}/x"]),
    ("rofs-eval", ["eval", "--drafter", D, "--out", "{ro}/x", "--device", "cpu"]),
    ("rofs-regenerate", ["regenerate", "--source", "{nonutf8}", "--out", "{ro}/x"]),
    ("rofs-export", ["export", "--drafter", D, "--format", "sglang", "--out", "{ro}/x"]),
    ("rofs-demo", ["demo", "--out", "{ro}/x"]),
]


def _fill(args, bad):
    return [a.format(**{k: str(v) for k, v in bad.items()}) for a in args]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case_id,args,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_before_any_model_loads(case_id, args, pattern, bad, no_model_loads):
    kept = ("user", "prepared_like", "train_run")
    before = {k: _snapshot(bad[k]) for k in kept}
    r = _run(_fill(args, bad))
    line = _one_line_error(r)
    assert r.exit_code == 2, (r.exit_code, r.stderr)
    assert line.startswith("error: "), line
    assert re.search(pattern, line), (pattern, line)
    assert r.stdout.strip() == "", "no JSON summary for a refused command"
    assert {k: _snapshot(bad[k]) for k in kept} == before, "a file was changed, added (a lock) or deleted"
    assert bad["file"].read_text() == "user's file\n"


@pytest.mark.parametrize("case_id,args", RO_CASES, ids=[c[0] for c in RO_CASES])
def test_out_on_a_read_only_filesystem_is_refused(case_id, args, bad, no_model_loads, read_only):
    r = _run(_fill(args, bad))
    line = _one_line_error(r)
    assert r.exit_code == 2, (r.exit_code, r.stderr)
    assert re.search(r"--out .*ro/x: .*ro is a read-only filesystem; choose a writable location", line), line
    assert not (bad["ro"] / "x").exists()


# ----------------------------------------------------------------------------------------------
# the guard for unexpected exceptions


def test_unexpected_exception_is_one_line_exit_3_with_a_debug_hint(monkeypatch, bad):
    import eyas.data.prepare

    def crash(cfg):
        raise RuntimeError("something\nunforeseen")

    monkeypatch.setattr(eyas.data.prepare, "prepare", crash)
    r = _run(["prepare", "--out", bad["root"] / "guard"])
    assert r.exit_code == 3
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert lines[0].startswith("internal error: RuntimeError: something unforeseen (in `eyas prepare`)")
    assert "EYAS_DEBUG=1" in lines[0]
    # with the debug switch the exception propagates (a traceback), by env var or flag
    r = _run(["prepare", "--out", bad["root"] / "guard"], env={"EYAS_DEBUG": "1"})
    assert isinstance(r.exception, RuntimeError)
    monkeypatch.delenv("EYAS_DEBUG", raising=False)
    r = _run(["--debug", "prepare", "--out", bad["root"] / "guard"])
    assert isinstance(r.exception, RuntimeError)
    os.environ.pop("EYAS_DEBUG", None)


def test_os_errors_are_exit_2_not_a_traceback(monkeypatch, bad):
    import eyas.data.prepare

    def full(cfg):
        raise OSError(28, "No space left on device", "/data/x")

    monkeypatch.setattr(eyas.data.prepare, "prepare", full)
    r = _run(["prepare", "--out", bad["root"] / "guard2"])
    assert r.exit_code == 2 and "No space left on device (/data/x)" in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------------------------
# training refuses corrupt data


@pytest.fixture
def train_world(tmp_path, tiny_target_dir, smol_tokenizer):
    """A prepared dataset and a store of random states for the tiny target (no model forward)."""
    from eyas.data.prepared import PreparedDataset, write_prepared
    from eyas.store.writer import StoreSpec, StoreWriter
    from eyas.target import model_identity, tokenizer_hash

    g = torch.Generator().manual_seed(0)
    th = tokenizer_hash(smol_tokenizer)
    samples = []
    for i in range(6):
        T = 12 + i
        samples.append((f"s{i}", torch.randint(0, 300, (T,), generator=g).tolist(), [False] * 4 + [True] * (T - 4)))
    prep = write_prepared(tmp_path / "prep", {"train": samples}, {"tokenizer_hash": th})
    split = PreparedDataset(prep).split("train")

    def make_store(name: str, *, nan_in: str | None = None) -> Path:
        spec = StoreSpec(
            aux_layer_ids=[1, 2, 3],
            hidden_size=64,
            dtype="fp32",
            target=model_identity(tiny_target_dir),
            tokenizer_hash=th,
            model_dtype="fp32",
            prepared={"path": str(prep), "split": "train", "fingerprint": split.fingerprint},
        )
        with StoreWriter(tmp_path / name, spec) as w:
            for s in split:
                T = s.input_ids.numel()
                aux, final = torch.randn(T, 3, 64, generator=g), torch.randn(T, 64, generator=g)
                if s.id == nan_in:
                    aux[T // 2, 1, 7] = float("nan")
                w.add(s.id, aux, final)
            w.close(complete=True)
        return tmp_path / name

    return {"target": tiny_target_dir, "make_store": make_store, "root": tmp_path}


def _train_args(w, store, out):
    return [
        "train",
        "--target",
        w["target"],
        "--store",
        store,
        "--out",
        w["root"] / out,
        "--steps",
        "3",
        "--device",
        "cpu",
        "--eval-samples",
        "1",
        "--draft-vocab",
        "64",
        "--ttt-steps",
        "2",
    ]


def test_train_refuses_nan_in_a_sample_naming_it(train_world):
    store = train_world["make_store"]("nan_store", nan_in="s3")
    r = _run(_train_args(train_world, store, "run_nan"))
    assert r.exit_code == 2, r.stderr
    assert re.search(r"sample s3 holds NaN/Inf hidden states", r.stderr), r.stderr
    assert not (train_world["root"] / "run_nan" / "drafter").exists()


def test_train_refuses_flipped_bits_and_duplicates(train_world):
    from eyas.store.format import MANIFEST
    from eyas.store.reader import StoreReader

    store = train_world["make_store"]("flip_store")
    man = json.loads((store / MANIFEST).read_text())
    rec = man["samples"][2]
    reader = StoreReader(store)
    lay = reader.layout(rec["shard"])
    shard = store / man["shards"][rec["shard"]]["name"]
    data = bytearray(shard.read_bytes())
    data[lay.hidden_offset + rec["start"] * lay.row_bytes + 5] ^= 0x10  # one flipped bit, value stays finite
    shard.write_bytes(bytes(data))
    r = _run(_train_args(train_world, store, "run_flip"))
    assert r.exit_code == 2 and re.search(rf"sample {rec['id']} fails its checksum", r.stderr), r.stderr
    # a sample listed twice
    dup = train_world["make_store"]("dup_store")
    man = json.loads((dup / MANIFEST).read_text())
    man["samples"].append(dict(man["samples"][0]))
    (dup / MANIFEST).write_text(json.dumps(man))
    r = _run(_train_args(train_world, dup, "run_dup"))
    assert r.exit_code == 2 and "lists 1 sample(s) more than once (first: s0)" in r.stderr, r.stderr


def test_reader_checks_each_sample_once(train_world, monkeypatch):
    from eyas.store import writer as writer_mod
    from eyas.store.reader import StoreReader

    store = train_world["make_store"]("once_store")
    calls = []
    real = writer_mod._sample_digest
    monkeypatch.setattr(writer_mod, "_sample_digest", lambda h, s: calls.append(1) or real(h, s))
    reader = StoreReader(store, verify_reads=True)
    for _ in range(3):
        reader.get("s1")
    assert len(calls) == 1
    plain = StoreReader(store)
    plain.get("s2")
    assert len(calls) == 1  # verification is opt-in (verify has its own scan)


# ----------------------------------------------------------------------------------------------
# eval refuses a drafter with non-finite weights; the drafter never saves them


def test_eval_refuses_a_drafter_with_nan_weights(tmp_path, tiny_target_dir):
    from transformers import AutoConfig

    from eyas.drafter.model import DrafterConfig, Eagle3Drafter

    cfg = DrafterConfig.from_target_config(AutoConfig.from_pretrained(tiny_target_dir), draft_vocab_size=64)
    d = Eagle3Drafter(cfg)
    d.reset_parameters(seed=0)
    with torch.no_grad():
        next(p for n, p in d.named_parameters() if p.is_floating_point()).view(-1)[3] = float("nan")
    d.save(tmp_path / "drafter")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hi"}\n')
    r = _run(
        [
            "eval",
            "--drafter",
            tmp_path / "drafter",
            "--target",
            tiny_target_dir,
            "--prompts",
            prompts,
            "--out",
            tmp_path / "ev",
            "--device",
            "cpu",
            "--max-new-tokens",
            "2",
        ]
    )
    assert r.exit_code == 2 and re.search(r"--drafter .*drafter: 1 tensor\(s\) hold NaN/Inf", r.stderr), r.stderr
    assert not (tmp_path / "ev").exists()


def test_require_finite_names_the_tensor():
    from eyas.common import require_finite

    require_finite({"a": torch.ones(3), "ids": torch.arange(3)}, what="x")
    with pytest.raises(EyasError, match=r"x: 1 tensor\(s\) hold NaN/Inf \(b\); nothing was saved"):
        require_finite({"a": torch.ones(3), "b": torch.tensor([1.0, float("inf")])}, what="x")


# ----------------------------------------------------------------------------------------------
# checkpoints: safetensors + JSON, no pickle


def test_checkpoint_round_trip_without_pickle(tmp_path):
    import numpy as np

    from eyas.train import checkpoint as ck

    torch.manual_seed(3)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    path = ck.save_checkpoint(
        tmp_path / "step-000007.pt",
        model=model,
        optimizer=opt,
        scheduler=sched,
        step=7,
        identity={"a": (1, 2), "b": {"c": None}},
        extra={"world": 1},
        is_main=True,
    )
    assert path.name == "step-000007.safetensors" and ck.latest_checkpoint(tmp_path) == path
    expect_rand = torch.rand(3)
    random_state = random.random()
    np_state = np.random.rand()
    state = ck.load_checkpoint(path)
    assert state["step"] == 7 and state["extra"] == {"world": 1}
    ck.check_identity(state["identity"], {"a": (1, 2), "b": {"c": None}}, path)  # tuples vs lists compare equal
    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 0.5)
    ck.restore(state, model=model2, optimizer=opt2, scheduler=sched2)
    assert torch.equal(model2.weight, model.weight)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert sched2.last_epoch == sched.last_epoch
    # RNG streams continue exactly where the checkpoint was taken
    assert torch.equal(torch.rand(3), expect_rand) and random.random() == random_state and np.random.rand() == np_state
    # the file is plain safetensors: no pickle opcode stream anywhere
    raw = path.read_bytes()
    assert raw[8:9] == b"{" and b"\x80\x04" not in raw[:16]


def test_pickled_or_damaged_checkpoints_are_refused(tmp_path):
    from eyas.train import checkpoint as ck

    evil = tmp_path / "step-000009.pt"

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    torch.save({"x": Boom()}, evil)
    assert ck.latest_checkpoint(tmp_path) is None  # pickled .pt files are not even considered
    with pytest.raises(EyasError, match="cannot read .* as an eyas checkpoint"):
        ck.load_checkpoint(evil)
    assert not (tmp_path / "pwned").exists()
    torn = tmp_path / "step-000010.safetensors"
    torn.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(EyasError, match="cannot read"):
        ck.load_checkpoint(torn)


def test_save_refuses_non_finite_weights_and_clears_stale_temps(tmp_path):
    from eyas.train import checkpoint as ck

    stale = tmp_path / ".step-000004.safetensors.x1y2.tmp"
    stale.write_bytes(b"half")
    mine = tmp_path / "notes.tmp"
    mine.write_text("keep")
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(EyasError, match=r"the drafter weights at step 4: 1 tensor\(s\) hold NaN/Inf \(weight\)"):
        ck.save_checkpoint(
            tmp_path / "step-000004.pt",
            model=model,
            optimizer=opt,
            scheduler=sched,
            step=4,
            identity={},
            extra={},
            is_main=True,
        )
    assert not list(tmp_path.glob("step-*"))
    assert ck.latest_checkpoint(tmp_path) is None
    assert not stale.exists() and mine.exists()  # only eyas's own temp names are removed


# ----------------------------------------------------------------------------------------------
# metrics and the disk margin


def test_metrics_writer_deduplicates_on_resume_and_refuses_user_dirs(tmp_path):
    from eyas.train.metrics import MetricsWriter

    out = tmp_path / "run"
    w = MetricsWriter(out / "metrics.jsonl", enabled=True, append=False)
    for s in range(1, 6):
        w.write({"step": s, "loss": float(s)})
    w.write({"eval": True, "step": 5, "loss": 0.0})
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # torn by a kill
    w2 = MetricsWriter(out / "metrics.jsonl", enabled=True, append=True)  # resumed from step 3
    w2.write({"step": 4, "loss": 40.0})
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in recs] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    last, evals = w2.last()
    assert last["loss"] == 40.0 and evals == []
    user = tmp_path / "user"
    user.mkdir()
    (user / "metrics.jsonl").write_text("mine\n")
    with pytest.raises(EyasError, match="holds files eyas did not create"):
        MetricsWriter(user / "metrics.jsonl", enabled=True, append=False)
    assert (user / "metrics.jsonl").read_text() == "mine\n"


def test_disk_margin_scales_with_the_job(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from eyas.store import writer

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(100 << 20, 90 << 20, 10 << 20))  # 10 MiB free
    writer.check_free_space(tmp_path, 2 << 20, what="a small job")  # 2 MiB job fits in 10 MiB free
    with pytest.raises(EyasError, match="not enough disk space"):
        writer.check_free_space(tmp_path, 10 << 20, what="a job as large as the free space")
    from eyas.common import disk_margin

    assert disk_margin(0) == 1 << 20 and disk_margin(100 << 30) == 1 << 30 and disk_margin(1 << 30) == (1 << 30) // 20


# ----------------------------------------------------------------------------------------------
# --overwrite replaces what eyas created


def test_overwrite_replaces_an_eyas_output_but_not_a_user_dir(tmp_path):
    from eyas.common import MARKER, atomic_directory, remove_owned_dir

    with atomic_directory(tmp_path / "o", kind="prepare") as t:
        (t / "a").write_text("1")
    assert (tmp_path / "o" / MARKER).is_file()
    with atomic_directory(tmp_path / "o", overwrite=True, kind="prepare") as t:
        (t / "a").write_text("2")
    assert (tmp_path / "o" / "a").read_text() == "2"
    user = tmp_path / "u"
    user.mkdir()
    (user / "notes").write_text("x")
    with pytest.raises(EyasError, match="holds files eyas did not create"), atomic_directory(user, overwrite=True):
        pass
    with pytest.raises(EyasError, match="holds files eyas did not create"):
        remove_owned_dir(user)
    assert (user / "notes").read_text() == "x"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_overwrite_removes_only_what_eyas_wrote(tmp_path):
    from eyas.common import MARKER, atomic_directory, remove_owned_dir, write_marker

    out = tmp_path / "p"
    with atomic_directory(out, kind="prepare") as t:
        for name in ("meta.json", "train.safetensors", "old.ids.json"):
            (t / name).write_text("old")
    (out / "NOTES.txt").write_text("mine")
    (out / "mine").mkdir()
    (out / "mine" / "a").write_text("1")
    with atomic_directory(out, overwrite=True, kind="prepare") as t:
        (t / "meta.json").write_text("new")
    # eyas's old files are gone (even one the new output does not write), the user's are kept
    assert _tree(out) == [MARKER, "NOTES.txt", "meta.json", "mine", "mine/a"]
    assert (out / "meta.json").read_text() == "new" and (out / "NOTES.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["p"]  # no temporary or old directory left

    demo = tmp_path / "demo"  # `demo --overwrite`: each stage's outputs go, a user file anywhere stays
    for sub, kind in ((demo, "demo"), (demo / "store", "store"), (demo / "train", "train")):
        sub.mkdir(parents=True, exist_ok=True)
        write_marker(sub, kind=kind)
    (demo / "store" / "manifest.json").write_text("{}")
    (demo / "store" / "shard-00000.safetensors").write_text("x")
    (demo / "store" / "NOTES.txt").write_text("mine")
    (demo / "train" / "checkpoints").mkdir()
    (demo / "train" / "checkpoints" / "step-000001.safetensors").write_text("x")
    (demo / "train" / "metrics.jsonl").write_text("{}")
    (demo / "NOTES.txt").write_text("mine")
    remove_owned_dir(demo, kind="demo")
    assert _tree(demo) == [MARKER, "NOTES.txt", "store", f"store/{MARKER}", "store/NOTES.txt"]
    (demo / "NOTES.txt").unlink()
    (demo / "store" / "NOTES.txt").unlink()
    remove_owned_dir(demo, kind="demo")
    assert not demo.exists()  # nothing of the user's left: the directory goes too


def test_atomic_directory_removes_its_own_stale_temp_dirs(tmp_path):
    from eyas.common import MARKER, atomic_directory

    ours = tmp_path / ".out.abc123.tmp"  # a killed earlier write: carries the marker
    ours.mkdir()
    (ours / MARKER).write_text("{}")
    theirs = tmp_path / ".out.zzz.tmp"  # same shape of name, but not eyas's
    theirs.mkdir()
    (theirs / "x").write_text("1")
    with atomic_directory(tmp_path / "out") as t:
        (t / "a").write_text("1")
    assert not ours.exists() and (theirs / "x").read_text() == "1"


def test_regenerate_that_writes_nothing_is_an_error(tmp_path, tiny_target_dir):
    src = tmp_path / "user_only.jsonl"
    src.write_text('{"conversations": [{"from": "human", "value": "Hi"}]}\n' * 2)
    r = _run(
        [
            "regenerate",
            "--source",
            src,
            "--target",
            tiny_target_dir,
            "--out",
            tmp_path / "o",
            "--device",
            "cpu",
            "--max-new-tokens",
            "2",
        ]
    )
    assert r.exit_code == 2, r.stderr
    assert "none of its 2 conversations could be regenerated (skipped: no_assistant_turn: 2)" in r.stderr


@pytest.mark.parametrize(
    "name,dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32), ("fp8", torch.float8_e4m3fn)]
)
def test_raw_finite_bit_test_agrees_with_torch(name, dtype):
    from eyas.store.reader import _all_finite

    for v in (float("nan"), float("inf"), -float("inf"), 448.0, -0.0, 1e-30, 3.0e38):
        x = torch.zeros(16)
        x[5] = v
        y = x.to(dtype)
        assert _all_finite(y.view(torch.uint8).numpy(), name) == bool(torch.isfinite(y.float()).all()), (name, v)


def test_a_missing_cuda_device_suggests_only_a_device_the_command_takes(bad, monkeypatch, no_model_loads):
    """demo takes cpu or cuda (not auto): the hint must not name an option value it would refuse."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for args in (
        ["demo", "--out", bad["root"] / "o7", "--device", "cuda"],
        ["train", "--data", bad["dir"], "--out", bad["root"] / "o4", "--device", "cuda"],
    ):
        r = _run(args)
        line = _one_line_error(r)
        assert r.exit_code == 2, line
        assert line.endswith("--device cuda: CUDA is not available on this machine; use --device cpu"), line
