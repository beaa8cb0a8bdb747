"""`eyas export`: write any readable drafter in SGLang's or vLLM/speculators' serving layout.

The layouts themselves are eyas.drafter.layouts (layer-id conversion), .reader and .writer; this module
adds what exporting needs on top: an atomic output directory, the verifier named for vLLM, and
`eyas_export.json` (provenance, checksums, the layer ids in every convention).

Serving the vLLM export, two routes:
- `vllm serve <export dir>`: vLLM reads the speculators config, serves `verifier.name_or_path` as the
  target and the directory as the drafter. It accepts only a Hub repository id there, so the id is
  taken from `--verifier` or the target's config (`_name_or_path`); the local target path is kept in
  `eyas_verifier_path` beside it.
- `vllm serve <target> --speculative-config '{"method": "eagle3", "model": "<export dir>",
  "num_speculative_tokens": 5}'`: works with a local target; the verifier field is not read.

`embed_tokens.weight` is written to both (the engines replace or accept it; it makes the directory
self-contained). Run: `eyas export --drafter DIR --format sglang|vllm --out DIR`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from eyas.drafter.layouts import CONVENTION, ENGINES, DraftCheckpoint, engine_layer_ids
from eyas.drafter.reader import read_drafter
from eyas.drafter.writer import write_engine_layout
from eyas.errors import EyasError

FORMATS = ENGINES
SCHEMA = "eyas.export/1"
SPECULATIVE_TOKENS = 5
"""num_speculative_tokens the vllm format writes unless --speculative-tokens is given."""
VLLM_ONLY = {
    "verifier": "the speculators config names the verifier",
    "speculative_tokens": "the speculators config's proposal method takes it",
}
"""`eyas export` options only the vllm format writes (ExportOptions fields): given with no vllm format, refused."""


HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def check_verifier(verifier: str | None, *, option: str = "--verifier") -> None:
    """Refuse a --verifier that is neither a Hub id nor a model directory, before any drafter is read: an empty
    or unrelated directory would otherwise be written into the export as the verifier."""
    if verifier is None:
        return
    if Path(verifier).is_dir():
        if not (Path(verifier) / "config.json").is_file():
            raise EyasError(
                f"{option} {verifier}: a directory without config.json; expected a Hub repository id "
                "OWNER/NAME or a model directory with config.json"
            )
    elif not HUB_ID.match(verifier) or ".." in verifier:
        raise EyasError(
            f"{option} {verifier!r}: neither a local target directory nor a Hub repository id "
            "(owner/name); pass the id the target is published under"
        )


def resolve_verifier(
    verifier: str | None, recorded_path: str | None
) -> tuple[str | None, str | None, list[str] | None]:
    """(Hub repository id, local target path, architectures) for speculators_config.verifier.

    `verifier` is a Hub id or a local target directory; None = the target recorded in the drafter.
    The Hub id of a local directory is its config's `_name_or_path` when that is one.
    """
    local = None
    check_verifier(verifier)
    if verifier is not None and not Path(verifier).is_dir():
        hub = verifier
    else:
        hub = None
        local = verifier or recorded_path
    arch = None
    if local and (Path(local) / "config.json").is_file():
        cfg = json.loads((Path(local) / "config.json").read_text())
        arch = cfg.get("architectures")
        name = str(cfg.get("_name_or_path") or "")
        if hub is None and HUB_ID.match(name) and not Path(name).exists():
            hub = name
    return hub, (str(Path(local).resolve()) if local else None), arch


def write_export(
    ckpt: DraftCheckpoint,
    fmt: str,
    out_dir: Path,
    *,
    dtype: torch.dtype | None = None,
    verifier: str | None = None,
    verifier_architectures: list[str] | None = None,
    verifier_path: str | None = None,
    speculative_tokens: int = 3,
    source_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the layout into `out_dir` (an empty directory). Returns the provenance record."""
    from eyas.common import sha256_file

    written = write_engine_layout(
        ckpt,
        fmt,
        out_dir,
        dtype=dtype,
        verifier=verifier,
        verifier_path=verifier_path,
        verifier_architectures=verifier_architectures,
        speculative_tokens=speculative_tokens,
    )
    config, spec = written["config"], ckpt.config
    record = {
        "schema": SCHEMA,
        "format": fmt,
        "source": {"path": str(ckpt.path.resolve()), "format": ckpt.provenance.format, **(source_meta or {})},
        "aux_layer_ids": {
            CONVENTION: spec.aux_layer_ids,
            "sglang (output of layer k)": engine_layer_ids(
                spec.aux_layer_ids, "sglang", model_type=spec.target_model_type
            ),
            "vllm (input of layer i)": engine_layer_ids(spec.aux_layer_ids, "vllm"),
            "written": config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
            if fmt == "sglang"
            else config["eagle_aux_hidden_state_layer_ids"],
        },
        "dtype": written["dtype"],
        "full_vocab": written["full_vocab"],
        "verifier": {"name_or_path": verifier, "local_path": verifier_path} if fmt == "vllm" else None,
        "weights": {
            "file": "model.safetensors",
            "sha256": sha256_file(out_dir / "model.safetensors"),
            "keys": written["keys"],
        },
    }
    (out_dir / "eyas_export.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def export_drafter(
    drafter: str | Path,
    fmt: str,
    out: str | Path,
    *,
    overwrite: bool = False,
    dtype: str = "keep",
    verifier: str | None = None,
    speculative_tokens: int | None = None,
    target_layers: int | None = None,
    allow_other_target: bool = False,
) -> dict[str, Any]:
    """Read any drafter directory and write it atomically in `fmt` layout; returns the CLI summary.
    `speculative_tokens`: the vllm format's num_speculative_tokens, SPECULATIVE_TOKENS when None. A local
    `verifier` must be the target an eyas drafter was trained for, unless `allow_other_target`."""
    from eyas.common import atomic_directory, check_out_dir, log

    drafter, out = Path(drafter), Path(out)
    if fmt not in FORMATS:
        raise EyasError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    from eyas.dtypes import MODEL_DTYPES, to_dtype

    weights_dtype = to_dtype(dtype, what="--weights-dtype", allowed=MODEL_DTYPES, also=("keep",))  # None: as stored
    speculative_tokens = SPECULATIVE_TOKENS if speculative_tokens is None else speculative_tokens
    if speculative_tokens < 1:
        raise EyasError(f"--speculative-tokens must be >= 1, got {speculative_tokens}")
    check_out_dir(out, kind="export", overwrite=overwrite)
    if out.resolve() == drafter.resolve():
        raise EyasError(f"--out {out} is the --drafter directory itself; choose another --out")
    ckpt = read_drafter(drafter, target_layers=target_layers)
    cfg = json.loads((drafter / "config.json").read_text())
    recorded = cfg.get("target") if isinstance(cfg.get("target"), dict) else {}
    hub, local, arch = resolve_verifier(verifier, recorded.get("path"))
    if verifier is not None and local is not None and Path(local).is_dir():
        from eyas.target import check_drafter_target

        check_drafter_target(drafter, local, allow=allow_other_target, option="--verifier")
    if fmt == "vllm" and hub is None:
        log(
            f"export: no Hub repository id for the target (--verifier, or `_name_or_path` in its config): "
            f"`vllm serve {out}` will refuse the local path; serve with `vllm serve <target> --speculative-config "
            f'\'{{"method": "eagle3", "model": "{out}"}}\'` or export again with --verifier OWNER/NAME'
        )
    with atomic_directory(out, overwrite=overwrite, kind="export") as tmp:
        record = write_export(
            ckpt,
            fmt,
            tmp,
            dtype=weights_dtype,
            verifier=hub or local,
            verifier_path=local,
            verifier_architectures=arch,
            speculative_tokens=speculative_tokens,
            source_meta={"target": recorded} if recorded else None,
        )
    return {
        "out": str(out),
        "format": fmt,
        "aux_layer_ids_written": record["aux_layer_ids"]["written"],
        "aux_layer_ids_hf_input": record["aux_layer_ids"][CONVENTION],
        "dtype": record["dtype"],
        "weights_sha256": record["weights"]["sha256"],
        "keys": len(record["weights"]["keys"]),
        "full_vocab": record["full_vocab"],
        **({"verifier": hub or local} if fmt == "vllm" else {}),
    }
