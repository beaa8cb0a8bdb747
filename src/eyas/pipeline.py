"""`eyas pipeline CONFIG.toml`: regenerate -> prepare -> train -> eval -> export for one target, from one file.

The file names each stage's options with the stage's own config fields, so a recipe reads like the
commands it replaces, and every option a stage gains (e.g. a new TrainConfig field) is usable here
at once:

    workdir = "runs/smollm2"        # every stage writes under it (relative to the current directory)
    target = "default"              # one target for every stage
    device = "auto"                 # default device of regenerate, train and eval
    [regenerate]                    # RegenConfig fields (eyas/regen/run.py); omit the section to train on
    max_turns = 2                   #   the source's own answers ([prepare] source then names the chats)
    [prepare]                       # PrepareConfig fields (eyas/data/prepare.py)
    [train]                         # TrainConfig fields (eyas/train/loop.py); online from the prepared data
    [eval]                          # EvalConfig fields (eyas/specdec/run.py)
    [export]                        # formats = ["sglang", "vllm"] + `eyas export` options

A stage runs when its section is present (an empty section = that stage's defaults). Paths between
stages are filled in by the pipeline (keys such as `out`, `data`, `drafter`, `overwrite`, `resume`
are refused in the file); `[regenerate] out` alone may be set, to share one growing regeneration
between several pipelines (the scaling study): each pipeline then reads only the conversations of
its own `limit` (source records 0 .. limit-1). A shared regeneration that already decided all of
those records with the same settings is only read, never resumed or rewritten, so several pipelines
may read it at once; one that must grow it has to run alone.

`--until STAGE` runs the stages up to and including STAGE and stops: the summary says `until` and
lists the stages `not_run` (e.g. `--until regenerate` fills a shared regeneration ahead of training).

Skip and resume. Each stage writes `stage.json` in its output directory: the fingerprint (sha256 of
the stage's resolved options plus its input's fingerprint), status and summary. A stage whose record
says complete with the same fingerprint, and whose output is present, is SKIPPED. A changed
fingerprint reruns the stage and everything after it (a stage's fingerprint includes its input's);
an unfinished one resumes: regenerate continues its committed chats, train restarts from its latest
checkpoint (`save_every`, 200 steps unless set), prepare/eval/export are redone (they write
atomically). A directory is only ever replaced or cleared when it holds a stage.json or is an eyas
output of that stage (its marker, common.output_kind); anything else in the way is an error (exit 2).
Replacing or clearing one removes only what eyas wrote there: files the user added to it are kept.

Trade-off: fingerprints hash options, not the bytes of inputs, except where the bytes are cheap and
decide the result (the selected regenerated chats, the prepared splits' own fingerprints), so a
regeneration rerun that changes nothing (a new batch size) does not retrain.

Errors in the file (unknown section or key, a wrong type, a key the pipeline fills, an invalid value)
exit 2 naming the file and key, before any model loads. Progress on stderr; one JSON summary on stdout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.common import (
    STAGE_KINDS,
    atomic_write_json,
    files_kind,
    is_owned,
    log,
    output_kind,
    read_text_file,
    remove_outputs,
    write_marker,
)
from eyas.config_checks import inputs_made_later
from eyas.errors import EyasError

SCHEMA = "eyas.pipeline/1"
STAGE_SCHEMA = "eyas.pipeline.stage/1"
STAGES = ("regenerate", "prepare", "train", "eval", "export")
TOP_KEYS = {"workdir": str, "target": str, "device": str}
DEFAULT_SAVE_EVERY = 200


@dataclass(kw_only=True)
class ExportOptions:
    """The [export] section: `eyas export` once per format."""

    formats: list[str] = field(default_factory=lambda: ["sglang", "vllm"])
    """Serving layouts to write: sglang, vllm."""
    weights_dtype: str = "keep"
    """Dtype of the exported weights: `keep` (as stored), `bfloat16`, `float16` or `float32`."""
    verifier: str | None = None
    """vllm format: the target's Hub repository id (owner/name), written as
    speculators_config.verifier.name_or_path so `vllm serve <out>` works; or a local target directory,
    whose config `_name_or_path` gives the id (default: the target recorded in the drafter). The local
    path is kept in `eyas_verifier_path`."""
    speculative_tokens: int | None = None
    """vllm format: default num_speculative_tokens written into the proposal method (5 unless set)."""
    target_layers: int | None = None
    """Target layer count, only needed when a foreign drafter's config names no aux layer ids (the
    engines' default is then used)."""

    def __post_init__(self):
        from eyas.config_checks import check_number
        from eyas.export.formats import FORMATS, VLLM_ONLY, check_verifier

        check_number(self, "target_layers", ge=1, optional=True)
        check_number(self, "speculative_tokens", ge=1, optional=True)  # before training, not at the export stage
        from eyas.dtypes import MODEL_DTYPES, to_dtype

        to_dtype(self.weights_dtype, what="--weights-dtype", allowed=MODEL_DTYPES, also=("keep",))  # before any drafter
        bad = [f for f in self.formats if f not in FORMATS]
        if bad or not self.formats:
            raise EyasError(f"formats {self.formats}: expected a non-empty list of {', '.join(FORMATS)}")
        for name in VLLM_ONLY:
            if getattr(self, name) is not None and "vllm" not in self.formats:
                raise EyasError(
                    f"{name} {getattr(self, name)!r}: only applies to the vllm format, and formats = "
                    f'{self.formats}; add "vllm" to formats or drop {name}'
                )
        check_verifier(self.verifier)


def _config_classes() -> dict[str, type]:
    from eyas.data.prepare import PrepareConfig
    from eyas.regen.run import RegenConfig
    from eyas.specdec.run import EvalConfig
    from eyas.train.loop import TrainConfig

    return {
        "regenerate": RegenConfig,
        "prepare": PrepareConfig,
        "train": TrainConfig,
        "eval": EvalConfig,
        "export": ExportOptions,
    }


# keys the pipeline fills in (paths between stages, the one target, overwrite/resume policy)
FILLED = {
    "regenerate": {"overwrite", "target"},
    "prepare": {"out", "target", "overwrite"},
    "train": {"out", "data", "store", "eval_store", "target", "resume", "overwrite"},
    "eval": {"drafter", "target"},
    "export": set(),
}


# -- reading the file --------------------------------------------------------------------------


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (inner,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_type_ok(v, inner) for v in value)
    if hint is Path:
        return isinstance(value, str)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _hint_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("pathlib.", "").replace("<class '", "").replace("'>", "")


def parse_value(text: str) -> Any:
    """A `--set` value as TOML (numbers, booleans, lists, quoted strings), else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_config(
    path: str | Path, *, overrides: list[str] = (), workdir: str | Path | None = None, until: str | None = None
) -> dict[str, Any]:
    """Read and check a pipeline file; `overrides` are `section.key=value` (or `key=value` at the top);
    `until` names the last stage to run (a stage of the file)."""
    if until is not None and until not in STAGES:
        raise EyasError(f"--until {until!r}: not a stage; expected one of {', '.join(STAGES)}")
    path = Path(path)
    try:
        raw = tomllib.loads(read_text_file(path, what="pipeline file", expected="UTF-8 TOML"))
    except tomllib.TOMLDecodeError as exc:
        raise EyasError(f"{path}: not valid TOML ({exc})") from None
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise EyasError(f"--set {item!r}: expected section.key=value (e.g. train.steps=100)")
        section, _, name = key.strip().rpartition(".")
        where = raw.setdefault(section, {}) if section else raw
        if not isinstance(where, dict):
            raise EyasError(f"--set {item!r}: `{section}` is not a section")
        where[name] = parse_value(value.strip())
    if workdir is not None:
        raw["workdir"] = str(workdir)
    config = check_config(raw, where=str(path))
    if until is not None and until not in config["stages"]:
        raise EyasError(f"--until {until}: {path} has no [{until}] stage; its stages are {', '.join(config['stages'])}")
    config["until"] = until
    return config


def check_config(raw: dict[str, Any], *, where: str) -> dict[str, Any]:
    """Validate keys and types of every section and build each stage's config; no model is loaded."""
    classes = _config_classes()
    for key, value in raw.items():
        if isinstance(value, dict):
            if key not in STAGES:
                raise EyasError(f"{where}: unknown section [{key}]; expected {', '.join(f'[{s}]' for s in STAGES)}")
        elif key not in TOP_KEYS:
            raise EyasError(f"{where}: unknown top-level key `{key}`; expected {', '.join(TOP_KEYS)} or a [section]")
        elif not isinstance(value, TOP_KEYS[key]):
            raise EyasError(f"{where}: `{key}` must be a string, got {value!r}")
    if "workdir" not in raw:
        raise EyasError(f"{where}: `workdir` is missing (the directory every stage writes under)")
    present = [s for s in STAGES if s in raw]
    if not present:
        raise EyasError(f"{where}: no stage sections; expected some of {', '.join(f'[{s}]' for s in STAGES)}")
    first = present[0] if present[0] != "regenerate" else "prepare"
    chain = list(STAGES[STAGES.index(first) : STAGES.index(present[-1]) + 1])
    missing = [s for s in chain if s not in raw]
    if missing:
        raise EyasError(
            f"{where}: [{missing[0]}] is missing: the stages from [{first}] to [{present[-1]}] must all "
            "be present (an empty section runs a stage with its defaults)"
        )
    if "regenerate" in raw and "prepare" not in raw:
        raise EyasError(f"{where}: [regenerate] without [prepare]: add [prepare] (its output is what training reads)")

    workdir = Path(raw["workdir"]).expanduser()
    target = raw.get("target", "default")
    device = raw.get("device")
    paths = stage_paths(workdir)
    cfgs: dict[str, Any] = {}
    auto: dict[str, set[str]] = {}
    for stage in present:
        section = raw[stage]
        cls = classes[stage]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        filled = set(FILLED[stage])
        if stage == "prepare" and "regenerate" in raw:
            filled.add("source")
        for key, value in section.items():
            if isinstance(value, dict):
                raise EyasError(f"{where}: [{stage}.{key}] is not a stage option (nested tables are not supported)")
            if key not in fields:
                raise EyasError(
                    f"{where}: [{stage}] unknown key `{key}`; {cls.__name__} fields are: "
                    f"{', '.join(sorted(set(fields) - filled))}"
                )
            if key in filled:
                raise EyasError(
                    f"{where}: [{stage}] `{key}` is filled in by the pipeline; remove it"
                    + (" (the target is the top-level `target`)" if key == "target" else "")
                )
            if not _type_ok(value, hints[key]):
                raise EyasError(f"{where}: [{stage}] `{key}` = {value!r}: expected {_hint_name(hints[key])}")
        kw = dict(section)
        if "target" in fields:
            kw["target"] = target
        if device is not None and "device" in fields and "device" not in kw:
            kw["device"] = device
        given = set(kw)
        if stage == "regenerate":
            kw["out"] = Path(kw["out"]).expanduser() if "out" in kw else paths["regenerate"] / "run"
        elif stage == "prepare":
            kw["out"] = paths["prepare"]
            if "regenerate" in raw:
                kw["source"] = str(paths["regenerate"] / "chats.jsonl")
        elif stage == "train":
            kw["out"], kw["data"] = paths["train"], paths["prepare"]
            kw["resume"] = "auto"
            kw.setdefault("save_every", DEFAULT_SAVE_EVERY)
        elif stage == "eval":
            kw["drafter"] = paths["train"] / "drafter"
        for key in ("out", "data", "drafter"):
            if key in kw and key in fields:
                kw[key] = Path(kw[key])
        # paths the pipeline chose stay out of fingerprints: moving a workdir reruns nothing
        auto[stage] = {k for k in kw if k not in given and k in ("out", "data", "drafter", "source", "resume")}
        try:
            with inputs_made_later():  # earlier stages write these stages' inputs
                cfgs[stage] = cls(**kw)
            if stage == "export" and "vllm" in cfgs[stage].formats and cfgs[stage].speculative_tokens is None:
                from eyas.export.formats import SPECULATIVE_TOKENS

                # the vllm default, recorded and fingerprinted as it was before the option could be left unset
                cfgs[stage].speculative_tokens = SPECULATIVE_TOKENS
            if stage == "eval":
                cfgs[stage].modes()
        except EyasError as exc:
            raise EyasError(f"{where}: [{stage}] {exc}") from None
        except (ValueError, TypeError) as exc:
            raise EyasError(f"{where}: [{stage}] {exc}") from None
    return {"where": where, "workdir": workdir, "target": target, "stages": cfgs, "auto": auto, "raw": raw}


def stage_paths(workdir: Path) -> dict[str, Path]:
    return {
        "regenerate": workdir / "regenerate",
        "prepare": workdir / "prepared",
        "train": workdir / "train",
        "eval": workdir / "eval",
        "export": workdir / "export",
    }


# -- stage records ---------------------------------------------------------------------------------

# options that never change a stage's result: they do not enter its fingerprint
NOT_IN_FINGERPRINT = {
    "regenerate": {"concurrency", "max_retries", "request_timeout"},
    "train": {"resume", "save_every", "eval_every", "keep_checkpoints"},
    "eval": {"gen_batch_size", "replay_tokens", "allow_other_target"},
}


def _jsonable(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def fingerprint(stage: str, cfg: Any, input_fp: str | None, *, auto: set[str] = frozenset()) -> str:
    """sha256 of the options that decide the stage's result plus its input's fingerprint."""
    skip = NOT_IN_FINGERPRINT.get(stage, set()) | set(auto)
    opts = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in skip}
    if stage == "eval" and opts.get("answers") is None:
        opts.pop("answers", None)  # unset: out, so fingerprints from before the option existed still match
    elif stage == "eval":  # the recorded answers decide the result, not the path they are read from
        from eyas.specdec.answers import answers_digest

        opts["answers"] = answers_digest(Path(opts["answers"])) or opts["answers"]
    blob = json.dumps({"stage": stage, "options": _jsonable(opts), "input": input_fp}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def read_record(directory: Path) -> dict[str, Any] | None:
    p = directory / "stage.json"
    if not p.is_file():
        return None
    try:
        rec = json.loads(p.read_text())
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and rec.get("schema") == STAGE_SCHEMA else None


def write_record(directory: Path, **rec: Any) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    write_marker(directory, kind=STAGE_KINDS[rec["stage"]])  # eyas made it: the stage's own command may write into it
    atomic_write_json(directory / "stage.json", _jsonable({"schema": STAGE_SCHEMA, **rec}))


def _eyas_made(stage: str, directory: Path) -> bool:
    """Whether eyas wrote `directory` for `stage`: its stage record, else the kind of eyas output it is
    (common.output_kind: its marker's) or its files show (common.files_kind). An export directory gets its
    record only once every format is written, so it also counts while each folder in it is an export or the
    eyas-marked `.<fmt>.*.tmp` that an export killed mid-way leaves (removed by the next export)."""
    if read_record(directory) is not None:
        return True
    if stage != "export":
        return output_kind(directory) == stage or files_kind(directory) == stage
    subdirs = [d for d in directory.iterdir() if d.is_dir()]
    return bool(subdirs) and all(
        output_kind(d) == "export"
        or files_kind(d) == "export"
        or (d.name.startswith(".") and d.name.endswith(".tmp") and is_owned(d))
        for d in subdirs
    )


def claim(stage: str, directory: Path) -> None:
    """Refuse to write into a non-empty directory that eyas did not make (exit 2)."""
    if directory.exists() and any(directory.iterdir()) and not _eyas_made(stage, directory):
        raise EyasError(
            f"{directory} exists and was not written by `eyas pipeline` ({stage} stage: no stage.json); "
            "move it away or choose another workdir"
        )


def clear(stage: str, directory: Path) -> None:
    """Delete what eyas wrote in a stage directory before a fresh run (only one this pipeline or eyas wrote;
    files the user put there are kept)."""
    if directory.exists():
        claim(stage, directory)
        remove_outputs(directory, STAGE_KINDS[stage])


# -- stages ------------------------------------------------------------------------------------------


def _select_chats(run_dir: Path, limit: int | None, out_file: Path) -> dict[str, Any]:
    """Write the conversations of source records [0, limit) of a (possibly shared) regenerate output."""
    from eyas.data.sources import parse_jsonl

    meta = json.loads((run_dir / "meta.json").read_text())
    done = (run_dir / "done.jsonl").read_bytes()[: meta["committed"]["done_bytes"]].decode("utf-8")
    wanted: set[str] = set()
    decided: set[int] = set()
    tokens = 0
    for _, d in parse_jsonl(done.split("\n"), run_dir / "done.jsonl"):
        if limit is None or int(d["index"]) < limit:
            decided.add(int(d["index"]))
            if d["status"] == "written":
                wanted.add(d["id"])
                tokens += int(d.get("tokens", 0))
    records = meta.get("source_info", {}).get("records")
    expected = records if limit is None else min(limit, records or limit)
    if expected is not None and len(decided) < expected:
        raise EyasError(
            f"{run_dir}: only {len(decided)} of the first {expected} source conversations are decided; "
            "the regeneration did not finish (run the pipeline again to resume it)"
        )
    data = (run_dir / "chats.jsonl").read_bytes()[: meta["committed"]["chats_bytes"]].decode("utf-8")
    lines = [line for line in data.split("\n") if line and json.loads(line)["id"] in wanted]
    blob = ("\n".join(lines) + "\n").encode("utf-8") if lines else b""
    tmp = out_file.with_name(out_file.name + ".tmp")
    tmp.write_bytes(blob)
    tmp.replace(out_file)
    return {"conversations": len(lines), "answer_tokens": tokens, "sha256": hashlib.sha256(blob).hexdigest()}


def shared_coverage(cfg) -> dict[str, Any] | None:
    """The committed meta.json of `cfg.out` when that regeneration already decided every source record
    this pipeline reads ([0, limit)) with the same settings; else None (the stage must regenerate).

    Why: `regenerate` on an existing output resumes it, and a resume cuts the files back to their last
    commit and rewrites meta.json even when nothing is left to do. Several pipelines reading one shared
    regeneration at once (the scaling study on several GPUs) must therefore only read it once it is
    complete enough. Only files are read (settings hash the target's files; no model loads)."""
    from eyas.regen.output import SCHEMA as CHATS_SCHEMA, settings_differ
    from eyas.regen.run import regen_settings

    try:
        meta = json.loads((Path(cfg.out) / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("schema") != CHATS_SCHEMA or "committed" not in meta:
        return None
    info = meta.get("source_info") or {}
    records, made_limit = info.get("records"), info.get("limit")
    # the source's size is known when the run that wrote meta.json was not cut short by its own limit
    size = records if isinstance(records, int) and (made_limit is None or records < made_limit) else None
    if cfg.limit is None and size is None:
        return None
    needed = min(x for x in (cfg.limit, size) if x is not None)
    done = (Path(cfg.out) / "done.jsonl").read_bytes()[: meta["committed"]["done_bytes"]].decode("utf-8")
    decided = {int(json.loads(line)["index"]) for line in done.split("\n") if line}
    if not decided.issuperset(range(needed)):
        return None
    if settings_differ(meta.get("settings", {}), regen_settings(cfg)):
        return None  # regenerate itself then says which settings differ
    return meta


def _run_regenerate(cfg, directory: Path) -> tuple[dict[str, Any], str]:
    from eyas.regen.run import regenerate

    meta = shared_coverage(cfg) if not cfg.overwrite else None
    if meta is not None:  # read, never rewritten: other pipelines may be reading it right now
        which = f"source records 0..{cfg.limit - 1}" if cfg.limit else "every source record"
        log(f"regen: {cfg.out} already holds {which} with these settings: reading it, nothing regenerated")
        sel = _select_chats(cfg.out, cfg.limit, directory / "chats.jsonl")
        counts = meta.get("counts", {})
        return {
            "written": counts.get("written"),
            "conversations": counts.get("conversations"),
            "answer_tokens": counts.get("answer_tokens"),
            "tokens_this_run": 0,
            "tokens_per_s": None,
            "truncated_turns": counts.get("truncated_turns"),
            "skipped": counts.get("skipped"),
            "selected": sel["conversations"],
            "selected_answer_tokens": sel["answer_tokens"],
            "out": str(cfg.out),
            "shared": "read",
        }, sel["sha256"]
    try:
        summary = regenerate(cfg)
    except EyasError as exc:
        if "different settings" in str(exc):
            raise EyasError(
                f"{exc}. In a pipeline: move {cfg.out} away, or set [regenerate] out to a new directory"
            ) from None
        raise
    sel = _select_chats(cfg.out, cfg.limit, directory / "chats.jsonl")
    keep = (
        "written",
        "conversations",
        "answer_tokens",
        "tokens_this_run",
        "tokens_per_s",
        "truncated_turns",
        "skipped",
    )
    return {
        **{k: summary.get(k) for k in keep},
        "selected": sel["conversations"],
        "selected_answer_tokens": sel["answer_tokens"],
        "out": str(cfg.out),
    }, sel["sha256"]


def _run_prepare(cfg, directory: Path) -> tuple[dict[str, Any], str]:
    from eyas.data.prepare import prepare

    cfg = dataclasses.replace(cfg, overwrite=True)
    summary = prepare(cfg)
    meta = json.loads((directory / "meta.json").read_text())
    keep = ("samples_kept", "train_samples", "eval_samples", "tokens", "assistant_tokens", "skipped_total")
    return {k: summary.get(k) for k in keep}, hashlib.sha256(
        json.dumps(meta["splits"], sort_keys=True).encode()
    ).hexdigest()


def _run_train(cfg, directory: Path) -> tuple[dict[str, Any], None]:
    from eyas.train.loop import run

    s = run(cfg)
    ev = s.get("eval") or {}
    return {
        "steps": s.get("steps"),
        "final_loss": s.get("final_loss"),
        "tokens_per_s": s.get("tokens_per_s"),
        "heldout_acc_per_step": ev.get("acc_per_step"),
        "heldout_tau_simulated": ev.get("acceptance_length"),
        "drafter": s.get("drafter"),
    }, None


def _run_eval(cfg, directory: Path) -> tuple[dict[str, Any], None]:
    from eyas.specdec.run import evaluate_to

    s = evaluate_to(directory, cfg, overwrite=True)
    return {k: v for k, v in s.items() if k.startswith(("tau_", "accepted_per_drafted_"))} | {
        "sequences": s.get("sequences"),
        "out": s.get("out"),
    }, None


def _run_export(cfg: ExportOptions, directory: Path, drafter: Path) -> tuple[dict[str, Any], None]:
    from eyas.export.formats import export_drafter

    out = {}
    for fmt in cfg.formats:
        s = export_drafter(
            drafter,
            fmt,
            directory / fmt,
            overwrite=True,
            dtype=cfg.weights_dtype,
            verifier=cfg.verifier,
            speculative_tokens=cfg.speculative_tokens,
            target_layers=cfg.target_layers,
        )
        out[fmt] = s["out"]
    return out, None


def _complete(stage: str, directory: Path, cfg: Any) -> bool:
    """The stage's output is there (besides its record saying so)."""
    if stage == "regenerate":
        return (directory / "chats.jsonl").is_file()
    if stage == "prepare":
        return (directory / "meta.json").is_file()
    if stage == "train":
        return (directory / "drafter" / "config.json").is_file()
    if stage == "eval":
        return (directory / "report.json").is_file()
    return all((directory / f / "config.json").is_file() for f in cfg.formats)


def run_pipeline(config: dict[str, Any]) -> dict[str, Any]:
    """Run (or skip) every configured stage in order; returns the summary."""
    workdir: Path = config["workdir"]
    paths = stage_paths(workdir)
    cfgs = config["stages"]
    from eyas.locks import hold

    hold(workdir, option="workdir")  # one pipeline per workdir; its stages, in this process, write under this lock
    workdir.mkdir(parents=True, exist_ok=True)
    for stage in cfgs:  # every directory in the way is checked before anything runs
        claim(stage, paths[stage])
    runners: dict[str, Callable] = {
        "regenerate": _run_regenerate,
        "prepare": _run_prepare,
        "train": _run_train,
        "eval": _run_eval,
        "export": lambda c, d: _run_export(c, d, paths["train"] / "drafter"),
    }
    results: dict[str, dict[str, Any]] = {}
    input_fp: str | None = None
    t_all = time.perf_counter()
    until = config.get("until")
    not_run = list(cfgs)[list(cfgs).index(until) + 1 :] if until else []
    for stage, cfg in cfgs.items():
        if stage in not_run:
            break
        directory = paths[stage]
        fp = fingerprint(stage, cfg, input_fp, auto=config["auto"].get(stage, set()))
        rec = read_record(directory)
        if (
            rec
            and rec.get("fingerprint") == fp
            and rec.get("status") == "complete"
            and _complete(stage, directory, cfg)
        ):
            log(f"== eyas pipeline: {stage}: SKIPPED (complete, same fingerprint {fp[:12]}) ==")
            results[stage] = {"status": "skipped", "seconds": 0.0, **rec.get("summary", {})}
            input_fp = rec.get("output_fingerprint") or fp
            continue
        if rec is None:
            status = (
                "resumed"
                if stage in ("regenerate", "train") and directory.exists() and any(directory.iterdir())
                else "ran"
            )
        elif rec.get("fingerprint") == fp:
            status = "resumed"
        else:
            status = "rerun"
        if stage == "train" and status == "rerun":
            clear(stage, directory)  # old checkpoints belong to other options
        if stage in ("regenerate", "train"):
            write_record(directory, stage=stage, status="running", fingerprint=fp, input_fingerprint=input_fp)
        log(f"== eyas pipeline: {stage}: {status.upper()} -> {directory} ==")
        t0 = time.perf_counter()
        summary, out_fp = runners[stage](cfg, directory)
        seconds = round(time.perf_counter() - t0, 1)
        write_record(
            directory,
            stage=stage,
            status="complete",
            fingerprint=fp,
            input_fingerprint=input_fp,
            output_fingerprint=out_fp or fp,
            seconds=seconds,
            summary=summary,
            options={k: v for k, v in dataclasses.asdict(cfg).items()},
        )
        results[stage] = {"status": status, "seconds": seconds, **summary}
        input_fp = out_fp or fp
    ev = results.get("eval", {})
    out = {
        "stage": "pipeline",
        "schema": SCHEMA,
        "config": config["where"],
        "workdir": str(workdir),
        "target": config["target"],
        "seconds": round(time.perf_counter() - t_all, 1),
        "tau_chain": ev.get("tau_chain"),
        "tau_tree": ev.get("tau_tree"),
        "stages": results,
    }
    if until:
        out["until"] = until
        out["not_run"] = not_run  # configured stages after --until: untouched, rerun the pipeline without it
        log(f"== eyas pipeline: stopped after {until} (--until); not run: {', '.join(not_run) or 'none'} ==")
    atomic_write_json(workdir / "pipeline.json", _jsonable(out))
    _print_table(out)
    return out


def _num(x: Any, digits: int) -> str:
    return f"{x:,.{digits}f}" if isinstance(x, (int, float)) else str(x)


def _print_table(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"eyas pipeline {s['config']} -> {s['workdir']}")
    for col in ("stage", "status", "seconds", "result"):
        table.add_column(col, justify="right" if col == "seconds" else "left")
    for stage, r in s["stages"].items():
        figures = {
            "regenerate": lambda r: f"{r.get('selected')} chats, {r.get('selected_answer_tokens')} answer tokens",
            "prepare": lambda r: (
                f"{r.get('train_samples')} train / {r.get('eval_samples')} eval, {r.get('tokens')} tokens"
            ),
            "train": lambda r: (
                f"{r.get('steps')} steps, loss {_num(r.get('final_loss'), 3)}, {_num(r.get('tokens_per_s'), 0)} tok/s"
            ),
            "eval": lambda r: f"tau chain {r.get('tau_chain')}, tree {r.get('tau_tree')}",
            "export": lambda r: ", ".join(f"{k}: {v}" for k, v in r.items() if k not in ("status", "seconds")),
        }[stage](r)
        table.add_row(stage, r["status"], str(r["seconds"]), figures)
    Console(stderr=True).print(table)
