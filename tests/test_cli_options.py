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
    out = CliRunner().invoke(app, ["train", "--data", str(data), "--out", str(tmp_path / "o"), "--aux-layers", "1,3,4",
                                   "--no-compile", "--steps", "5", "--lr", "2e-4", "--device", "cpu"])
    assert out.exit_code == 0, out.output
    (cfg,) = seen
    assert cfg.aux_layers == [1, 3, 4] and cfg.compile is False and cfg.steps == 5 and cfg.lr == 2e-4
    assert cfg.ttt_decay == TrainConfig(out=tmp_path / "o2", data=data).ttt_decay
    assert cfg.data == data and isinstance(cfg.out, Path)


@pytest.mark.parametrize("args,message", [
    (["--aux-layers", "1,x"], "--aux-layers: expected comma-separated integers, got '1,x'"),
    (["--ttt-decay", "-1"], "--ttt-decay must be > 0 and <= 1"),
    (["--attention", "bogus"], "--attention must be one of fast, reference"),
])
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
    out = CliRunner().invoke(app, ["regenerate", "--out", str(tmp_path / "r"), "--server-url", "http://127.0.0.1:1/",
                                   "--server-url", "http://127.0.0.1:2", "--retries", "0"])
    assert out.exit_code == 0, out.output
    assert seen[0].server_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"] and seen[0].engine == "server"
    assert seen[0].max_retries == 0
    bad = CliRunner().invoke(app, ["regenerate", "--out", str(tmp_path / "r2"), "--top-p", "0"])
    assert bad.exit_code == 2 and "--top-p must be > 0 and <= 1, got 0" in bad.output
    # EvalConfig raises ValueError: still exit 2 with the option named
    ev = CliRunner().invoke(app, ["eval", "--drafter", str(tmp_path), "--out", str(tmp_path / "e"), "--chain-k", "0",
                                  "--tree-depth", "0"])
    assert ev.exit_code == 2 and "--chain-k 0 and --tree-depth 0" in ev.output, ev.output


def test_hidden_old_spellings_and_parsed_text(tmp_path, monkeypatch):
    """Renamed options keep their old spelling (hidden from --help); --shard-bytes takes sizes, defaulting to the field's."""
    seen: list = []
    _fake_run(monkeypatch, "eyas.data.prepare", "prepare", seen)
    out = CliRunner().invoke(app, ["prepare", "--out", str(tmp_path / "p"), "--aux-layers", "5"])
    assert out.exit_code == 0, out.output
    assert seen[-1].aux_layer_count == 5
    new = CliRunner().invoke(app, ["prepare", "--out", str(tmp_path / "p"), "--aux-layer-count", "4"])
    assert new.exit_code == 0 and seen[-1].aux_layer_count == 4
    helptext = CliRunner().invoke(app, ["prepare", "--help"], env={"COLUMNS": "400"}).output
    assert "--aux-layer-count" in helptext and "--aux-layers " not in helptext

    _fake_run(monkeypatch, "eyas.capture.run", "run_capture", seen)
    data = tmp_path / "prep"
    data.mkdir()
    base = ["capture", "--data", str(data), "--out", str(tmp_path / "s")]
    assert CliRunner().invoke(app, [*base, "--layers", "1,3"]).exit_code == 0
    assert seen[-1].aux_layers == [1, 3] and seen[-1].shard_bytes == 1 << 30 and seen[-1].target is None
    assert CliRunner().invoke(app, [*base, "--aux-layers", "2,4", "--shard-bytes", "512MiB"]).exit_code == 0
    assert seen[-1].aux_layers == [2, 4] and seen[-1].shard_bytes == 512 << 20
    bad = CliRunner().invoke(app, [*base, "--shard-bytes", "lots"])
    assert bad.exit_code == 2 and "--shard-bytes" in bad.output


def test_regenerate_max_len_renamed_with_old_spellings(tmp_path, monkeypatch):
    """`--max-len` / `max_len` (pipeline files) still set RegenConfig.max_length; giving both names is refused."""
    from eyas.errors import EyasError
    from eyas.pipeline import check_config

    seen: list = []
    _fake_run(monkeypatch, "eyas.regen.run", "regenerate", seen)
    assert CliRunner().invoke(app, ["regenerate", "--out", str(tmp_path / "r"), "--max-len", "300"]).exit_code == 0
    assert seen[-1].max_length == 300
    assert CliRunner().invoke(app, ["regenerate", "--out", str(tmp_path / "r"), "--max-length", "256"]).exit_code == 0
    assert seen[-1].max_length == 256
    raw = {"workdir": str(tmp_path / "w"), "device": "cpu", "regenerate": {"max_len": 300}, "prepare": {}}
    assert check_config(raw, where="p.toml")["stages"]["regenerate"].max_length == 300
    with pytest.raises(EyasError, match="`max_len` is the old name of `max_length`"):
        check_config({**raw, "regenerate": {"max_len": 300, "max_length": 200}}, where="p.toml")


# one name per meaning: (command, new flag, old hidden flag, config field, value given)
RENAMED = [
    ("capture", "--store-dtype", "--dtype", "store_dtype", "fp8"),
    ("regenerate", "--model-dtype", "--dtype", "model_dtype", "bfloat16"),
    ("regenerate", "--max-retries", "--retries", "max_retries", "7"),
    ("eval", "--model-dtype", "--dtype", "model_dtype", "float16"),
    ("generate", "--model-dtype", "--dtype", "model_dtype", "float16"),
    ("train", "--model-dtype", "--precision", "model_dtype", "fp32"),
    ("export", "--weights-dtype", "--dtype", "weights_dtype", "float16"),
]


def _invoke_renamed(tmp_path, monkeypatch, command: str, flag: str, value: str):
    """Run `eyas <command> <flag> <value>` with the work faked out; returns (result, the config built)."""
    seen: list = []
    d = tmp_path / "dir"
    d.mkdir(exist_ok=True)
    args = {"capture": ["--data", str(d), "--out", str(tmp_path / "s")],
            "regenerate": ["--out", str(tmp_path / "r")],
            "eval": ["--drafter", str(d), "--out", str(tmp_path / "e")],
            "generate": ["--drafter", str(d), "--out", str(tmp_path / "g")],
            "train": ["--data", str(d), "--out", str(tmp_path / "t")],
            "export": ["--drafter", str(d), "--format", "sglang", "--out", str(tmp_path / "x")]}[command]
    if command == "capture":
        _fake_run(monkeypatch, "eyas.capture.run", "run_capture", seen)
    elif command == "regenerate":
        _fake_run(monkeypatch, "eyas.regen.run", "regenerate", seen)
    elif command == "train":
        _fake_run(monkeypatch, "eyas.train.loop", "run", seen)
    elif command == "eval":
        monkeypatch.setattr(importlib.import_module("eyas.specdec.run"), "evaluate_to",
                            lambda out, cfg, **k: seen.append(cfg) or {"ok": 1})
    elif command == "generate":
        monkeypatch.setattr(importlib.import_module("eyas.specdec.generate_run"), "generate_to",
                            lambda cfg, **k: seen.append(cfg) or {"ok": 1})
    else:  # export: the dtype reaches export_drafter
        monkeypatch.setattr(importlib.import_module("eyas.common"), "check_safetensors_dir", lambda *a, **k: None)
        monkeypatch.setattr(importlib.import_module("eyas.export.formats"), "export_drafter",
                            lambda drafter, fmt, out, **k: seen.append(k) or {"ok": 1})
    result = CliRunner().invoke(app, [command, *args, flag, value])
    return result, seen


@pytest.mark.parametrize("command,new,old,name,value", RENAMED)
def test_renamed_options_old_spelling_still_works_and_is_hidden(tmp_path, monkeypatch, command, new, old, name, value):
    helptext = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"}).output
    assert new in helptext
    assert f"{old} " not in helptext and f"{old}," not in helptext, f"{old} should be hidden from {command} --help"
    for flag in (new, old):
        result, seen = _invoke_renamed(tmp_path, monkeypatch, command, flag, value)
        assert result.exit_code == 0, (flag, result.output)
        got = seen[-1]["dtype"] if command == "export" else getattr(seen[-1], name)
        assert str(got) == value, (flag, got)


@pytest.mark.parametrize("command,new,old,name,value", [r for r in RENAMED if "dtype" in r[1]])
def test_renamed_dtype_options_refuse_a_bad_value_naming_the_new_option(tmp_path, monkeypatch, command, new, old,
                                                                        name, value):
    result, seen = _invoke_renamed(tmp_path, monkeypatch, command, old, "int3")
    assert result.exit_code == 2 and new in result.output and not seen, result.output


def test_renamed_keys_in_pipeline_files(tmp_path):
    """Old TOML keys (`dtype`, `retries`, `precision`) still read as the renamed fields, and fingerprints keep
    the old names, so a workdir made before the rename does not rerun."""
    import hashlib
    import json

    from eyas.pipeline import _jsonable, check_config, fingerprint
    from eyas.regen.run import RegenConfig

    raw = {"workdir": str(tmp_path / "w"), "device": "cpu", "regenerate": {"dtype": "float32", "retries": 1},
           "prepare": {}, "train": {"precision": "fp32"}, "eval": {"dtype": "float32"},
           "export": {"dtype": "bfloat16"}}
    stages = check_config(raw, where="p.toml")["stages"]
    assert (stages["regenerate"].model_dtype, stages["regenerate"].max_retries) == ("float32", 1)
    assert stages["train"].model_dtype == "fp32" and stages["eval"].model_dtype == "float32"
    assert stages["export"].weights_dtype == "bfloat16"
    new = {"workdir": str(tmp_path / "w"), "device": "cpu", "regenerate": {"model_dtype": "float32", "max_retries": 1},
           "prepare": {}, "train": {"model_dtype": "fp32"}, "eval": {"model_dtype": "float32"},
           "export": {"weights_dtype": "bfloat16"}}
    assert check_config(new, where="p.toml")["stages"]["export"].weights_dtype == "bfloat16"
    cfg = RegenConfig(out=tmp_path / "r", model_dtype="float32")
    opts = {("dtype" if k == "model_dtype" else k): v for k, v in dataclasses.asdict(cfg).items()
            if k not in ("concurrency", "max_retries", "request_timeout")}
    old_fp = hashlib.sha256(json.dumps({"stage": "regenerate", "options": _jsonable(opts), "input": None},
                                       sort_keys=True).encode()).hexdigest()
    assert fingerprint("regenerate", cfg, None) == old_fp


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
