"""The CLI generated from config dataclasses (eyas/cli_options.py): defaults, names, parsing, help."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eyas.cli import app
from eyas.cli_options import REQUIRED, read_fields

CONVERTED = {  # command -> its config class
    "train": "eyas.train.loop:TrainConfig",
    "regenerate": "eyas.regen.run:RegenConfig",
    "prepare": "eyas.data.prepare:PrepareConfig",
    "eval": "eyas.specdec.run:EvalConfig",
    "verify": "eyas.store.verify:VerifyConfig",
    "demo": "eyas.demo:DemoConfig",
    "export": "eyas.pipeline:ExportOptions",
    "capture": "eyas.capture.run:CaptureSettings",
    "generate": "eyas.specdec.generate_run:GenerateConfig",
    "bench-serve": "eyas.serve_bench:BenchServeConfig",
}


@pytest.mark.parametrize("target", sorted(CONVERTED.values()))
def test_source_read_fields_match_the_class(target):
    """The fields read with `ast` (names, order, defaults) are the imported dataclass's, every one documented."""
    module, cls = target.split(":")
    real = dataclasses.fields(getattr(importlib.import_module(module), cls))
    read = read_fields(target)
    assert [f.name for f in read] == [f.name for f in real]
    for spec, f in zip(read, real):
        if f.default is not dataclasses.MISSING:
            expected = f.default
        elif f.default_factory is not dataclasses.MISSING:
            expected = f.default_factory()
        else:
            expected = REQUIRED
        assert spec.default == expected, spec.name
        assert spec.doc, f"{target}.{spec.name} has no docstring (it is the --help text)"


@pytest.mark.parametrize("command", sorted(CONVERTED))
def test_every_field_is_an_option_with_its_docstring(command):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    assert result.exit_code == 0, result.output
    for spec in read_fields(CONVERTED[command]):
        if (command, spec.name) == ("export", "formats"):  # one --format per `eyas export` call
            continue
        assert spec.flag in result.output, spec.flag
        assert spec.doc.split()[0] in result.output


def _fake_run(monkeypatch, module: str, name: str, seen: list) -> None:
    monkeypatch.setattr(importlib.import_module(module), name, lambda cfg, *a, **k: seen.append(cfg) or {"ok": 1})


def test_train_values_reach_the_config(tmp_path, monkeypatch):
    """Parsed values (int list, bool pair, optional numbers) arrive typed; untouched fields keep the class default."""
    from eyas.train.loop import TrainConfig

    seen: list = []
    _fake_run(monkeypatch, "eyas.train.loop", "run", seen)
    data = tmp_path / "prep"
    data.mkdir()
    out = CliRunner().invoke(
        app,
        [
            "train",
            "--data",
            str(data),
            "--out",
            str(tmp_path / "o"),
            "--aux-layers",
            "1,3,4",
            "--no-compile",
            "--steps",
            "5",
            "--lr",
            "2e-4",
            "--device",
            "cpu",
        ],
    )
    assert out.exit_code == 0, out.output
    (cfg,) = seen
    assert cfg.aux_layers == [1, 3, 4] and cfg.compile is False and cfg.steps == 5 and cfg.lr == 2e-4
    assert cfg.ttt_decay == TrainConfig(out=tmp_path / "o2", data=data).ttt_decay
    assert cfg.data == data and isinstance(cfg.out, Path)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--aux-layers", "1,x"], "--aux-layers: expected comma-separated integers, got '1,x'"),
        (["--ttt-decay", "-1"], "--ttt-decay must be > 0 and <= 1"),
        (["--attention", "bogus"], "--attention must be one of fast, reference"),
    ],
)
def test_bad_values_exit_2_naming_the_option_before_running(tmp_path, monkeypatch, args, message):
    seen: list = []
    _fake_run(monkeypatch, "eyas.train.loop", "run", seen)
    data = tmp_path / "prep"
    data.mkdir()
    out = CliRunner().invoke(app, ["train", "--data", str(data), "--out", str(tmp_path / "o"), *args])
    assert out.exit_code == 2 and message in out.output and not seen, out.output


def test_regenerate_repeated_server_url_and_eval_value_error(tmp_path, monkeypatch):
    seen: list = []
    _fake_run(monkeypatch, "eyas.regen.run", "regenerate", seen)
    out = CliRunner().invoke(
        app,
        [
            "regenerate",
            "--out",
            str(tmp_path / "r"),
            "--server-url",
            "http://127.0.0.1:1/",
            "--server-url",
            "http://127.0.0.1:2",
            "--max-retries",
            "0",
        ],
    )
    assert out.exit_code == 0, out.output
    assert seen[0].server_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"] and seen[0].engine == "server"
    assert seen[0].max_retries == 0
    bad = CliRunner().invoke(app, ["regenerate", "--out", str(tmp_path / "r2"), "--top-p", "0"])
    assert bad.exit_code == 2 and "--top-p must be > 0 and <= 1, got 0" in bad.output
    # EvalConfig raises ValueError: still exit 2 with the option named
    ev = CliRunner().invoke(
        app, ["eval", "--drafter", str(tmp_path), "--out", str(tmp_path / "e"), "--chain-k", "0", "--tree-depth", "0"]
    )
    assert ev.exit_code == 2 and "--chain-k 0 and --tree-depth 0" in ev.output, ev.output


def test_parsed_text_options(tmp_path, monkeypatch):
    """--aux-layer-count (prepare), --aux-layers (capture, comma-separated) and --shard-bytes (sizes, defaulting
    to the field's) arrive parsed."""
    seen: list = []
    _fake_run(monkeypatch, "eyas.data.prepare", "prepare", seen)
    new = CliRunner().invoke(app, ["prepare", "--out", str(tmp_path / "p"), "--aux-layer-count", "4"])
    assert new.exit_code == 0 and seen[-1].aux_layer_count == 4, new.output

    _fake_run(monkeypatch, "eyas.capture.run", "run_capture", seen)
    data = tmp_path / "prep"
    data.mkdir()
    base = ["capture", "--data", str(data), "--out", str(tmp_path / "s")]
    assert CliRunner().invoke(app, [*base, "--aux-layers", "1,3"]).exit_code == 0
    assert seen[-1].aux_layers == [1, 3] and seen[-1].shard_bytes == 1 << 30 and seen[-1].target is None
    assert CliRunner().invoke(app, [*base, "--aux-layers", "2,4", "--shard-bytes", "512MiB"]).exit_code == 0
    assert seen[-1].aux_layers == [2, 4] and seen[-1].shard_bytes == 512 << 20
    bad = CliRunner().invoke(app, [*base, "--shard-bytes", "lots"])
    assert bad.exit_code == 2 and "--shard-bytes" in bad.output


# one name per meaning: (command, flag, config field, value given)
OPTIONS = [
    ("capture", "--store-dtype", "store_dtype", "fp8"),
    ("regenerate", "--model-dtype", "model_dtype", "bfloat16"),
    ("regenerate", "--max-retries", "max_retries", "7"),
    ("regenerate", "--max-length", "max_length", "300"),
    ("eval", "--model-dtype", "model_dtype", "float16"),
    ("generate", "--model-dtype", "model_dtype", "float16"),
    ("train", "--model-dtype", "model_dtype", "fp32"),
    ("export", "--weights-dtype", "weights_dtype", "float16"),
]


def _invoke(tmp_path, monkeypatch, command: str, flag: str, value: str):
    """Run `eyas <command> <flag> <value>` with the work faked out; returns (result, the config built)."""
    seen: list = []
    d = tmp_path / "dir"
    d.mkdir(exist_ok=True)
    args = {
        "capture": ["--data", str(d), "--out", str(tmp_path / "s")],
        "prepare": ["--out", str(tmp_path / "p")],
        "regenerate": ["--out", str(tmp_path / "r")],
        "eval": ["--drafter", str(d), "--out", str(tmp_path / "e")],
        "generate": ["--drafter", str(d), "--out", str(tmp_path / "g")],
        "train": ["--data", str(d), "--out", str(tmp_path / "t")],
        "export": ["--drafter", str(d), "--format", "sglang", "--out", str(tmp_path / "x")],
        "verify-server": ["--url", "http://127.0.0.1:9"],
    }[command]
    if command == "capture":
        _fake_run(monkeypatch, "eyas.capture.run", "run_capture", seen)
    elif command == "prepare":
        _fake_run(monkeypatch, "eyas.data.prepare", "prepare", seen)
    elif command == "regenerate":
        _fake_run(monkeypatch, "eyas.regen.run", "regenerate", seen)
    elif command == "train":
        _fake_run(monkeypatch, "eyas.train.loop", "run", seen)
    elif command == "eval":
        monkeypatch.setattr(
            importlib.import_module("eyas.specdec.run"),
            "evaluate_to",
            lambda out, cfg, **k: seen.append(cfg) or {"ok": 1},
        )
    elif command == "generate":
        monkeypatch.setattr(
            importlib.import_module("eyas.specdec.generate_run"),
            "generate_to",
            lambda cfg, **k: seen.append(cfg) or {"ok": 1},
        )
    elif command == "export":  # the dtype reaches export_drafter
        monkeypatch.setattr(importlib.import_module("eyas.common"), "check_safetensors_dir", lambda *a, **k: None)
        monkeypatch.setattr(
            importlib.import_module("eyas.export.formats"),
            "export_drafter",
            lambda drafter, fmt, out, **k: seen.append(k) or {"ok": 1},
        )
    result = CliRunner().invoke(app, [command, *args, flag, value])
    return result, seen


@pytest.mark.parametrize("command,flag,name,value", OPTIONS)
def test_one_name_per_meaning_reaches_the_config(tmp_path, monkeypatch, command, flag, name, value):
    result, seen = _invoke(tmp_path, monkeypatch, command, flag, value)
    assert result.exit_code == 0, (flag, result.output)
    got = seen[-1]["dtype"] if command == "export" else getattr(seen[-1], name)
    assert str(got) == value, (flag, got)


@pytest.mark.parametrize(
    "command,old,value",
    [
        ("capture", "--dtype", "fp8"),
        ("capture", "--layers", "1,3"),
        ("prepare", "--aux-layers", "4"),  # prepare's --aux-layer-count (--aux-layers is layer ids everywhere)
        ("regenerate", "--dtype", "bfloat16"),
        ("regenerate", "--retries", "7"),
        ("regenerate", "--max-len", "300"),
        ("eval", "--dtype", "float16"),
        ("generate", "--dtype", "float16"),
        ("train", "--precision", "fp32"),
        ("export", "--dtype", "float16"),
        ("verify-server", "--layers", "2,4"),
    ],
)
def test_old_spellings_are_usage_errors(tmp_path, monkeypatch, command, old, value):
    """The old spellings are gone (eyas 0.1.0 keeps no aliases): click's "No such option", exit 2, nothing run."""
    result, seen = _invoke(tmp_path, monkeypatch, command, old, value)
    assert result.exit_code == 2 and f"No such option: {old}" in result.output and not seen, result.output


@pytest.mark.parametrize("command,flag,name,value", [r for r in OPTIONS if "dtype" in r[1]])
def test_dtype_options_refuse_a_bad_value_naming_the_option(tmp_path, monkeypatch, command, flag, name, value):
    result, seen = _invoke(tmp_path, monkeypatch, command, flag, "int3")
    assert result.exit_code == 2 and flag in result.output and not seen, result.output


@pytest.mark.parametrize(
    "stage,old",
    [
        ("regenerate", "dtype"),
        ("regenerate", "retries"),
        ("regenerate", "max_len"),
        ("train", "precision"),
        ("eval", "dtype"),
        ("export", "dtype"),
    ],
)
def test_old_keys_in_pipeline_files_are_unknown_keys(tmp_path, stage, old):
    """A pipeline file's old keys get the usual unknown-key error; fingerprints use the field names."""
    from eyas.errors import EyasError
    from eyas.pipeline import check_config

    raw = {
        "workdir": str(tmp_path / "w"),
        "device": "cpu",
        "regenerate": {},
        "prepare": {},
        "train": {},
        "eval": {},
        "export": {},
    }
    raw[stage] = {old: "x"}
    with pytest.raises(EyasError, match=rf"^p\.toml: \[{stage}\] unknown key `{old}`;"):
        check_config(raw, where="p.toml")


def test_fingerprints_use_the_field_names(tmp_path):
    import hashlib
    import json

    from eyas.pipeline import _jsonable, check_config, fingerprint
    from eyas.regen.run import RegenConfig

    new = {
        "workdir": str(tmp_path / "w"),
        "device": "cpu",
        "regenerate": {"model_dtype": "float32", "max_retries": 1},
        "prepare": {},
        "train": {"model_dtype": "fp32"},
        "eval": {"model_dtype": "float32"},
        "export": {"weights_dtype": "bfloat16"},
    }
    stages = check_config(new, where="p.toml")["stages"]
    assert (stages["regenerate"].model_dtype, stages["regenerate"].max_retries) == ("float32", 1)
    assert stages["train"].model_dtype == "fp32" and stages["export"].weights_dtype == "bfloat16"
    cfg = RegenConfig(out=tmp_path / "r", model_dtype="float32")
    opts = {
        k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("concurrency", "max_retries", "request_timeout")
    }
    want = hashlib.sha256(
        json.dumps({"stage": "regenerate", "options": _jsonable(opts), "input": None}, sort_keys=True).encode()
    ).hexdigest()
    assert fingerprint("regenerate", cfg, None) == want


def test_field_metadata_other_than_flag_and_parse_is_refused(tmp_path, monkeypatch):
    """No hidden aliases: a field's metadata takes `flag` and `parse` only, checked when the CLI is built."""
    import sys

    from eyas.cli_options import read_fields

    (tmp_path / "eyas_meta_probe.py").write_text(
        "from dataclasses import dataclass, field\n\n@dataclass(kw_only=True)\nclass C:\n"
        '    x: int = field(default=1, metadata={\'aliases\': [\'--y\']})\n    """X."""\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "eyas_meta_probe", raising=False)
    with pytest.raises(TypeError, match=r"eyas_meta_probe:C.x: field metadata \['aliases'\] not understood"):
        read_fields("eyas_meta_probe:C")


@pytest.mark.parametrize("command", sorted(CONVERTED))
def test_help_reads_at_80_columns(command):
    """Every option's name whole, no line past 80 columns, one short paragraph an option, no internal names."""
    import re

    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in result.output
    named = set(re.findall(r"--[a-z0-9-]+", result.output))
    for spec in read_fields(CONVERTED[command]):
        if (command, spec.name) != ("export", "formats"):
            assert spec.flag in named, spec.flag
    options = sum(1 for line in lines if line.startswith("  --"))
    assert len(lines) <= 3 * options + 10, (len(lines), options)  # about two lines an option
    assert not re.search(r"[A-Z][a-z]+Config\.|benchmarks/|\.py\b", result.output)
