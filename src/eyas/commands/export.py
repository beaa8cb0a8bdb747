"""`eyas export`: write a drafter in SGLang's or vLLM/speculators' serving layout (see eyas/export/formats.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def export(
    drafter: Path = typer.Option(..., "--drafter", help="Drafter directory to export: eyas (`eyas train` output), SGLang or vLLM/speculators layout."),
    format: str = typer.Option(..., "--format", help="`sglang` (LlamaForCausalLMEagle3, --speculative-draft-model-path) or `vllm` (speculators Eagle3Speculator, speculative_config model)."),
    out: Path = typer.Option(..., "--out", help="Directory to create."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out directory."),
    dtype: str = typer.Option("keep", "--dtype", help="Weights dtype: `keep` (as stored), `bfloat16`, `float16` or `float32`."),
    verifier: Optional[str] = typer.Option(None, "--verifier", help="vllm format: the target's Hub repository id (owner/name), written as speculators_config.verifier.name_or_path so `vllm serve <out>` works; or a local target directory, whose config `_name_or_path` gives the id (default: the target recorded in the drafter). The local path is kept in `eyas_verifier_path`."),
    speculative_tokens: int = typer.Option(5, "--speculative-tokens", help="vllm format: default num_speculative_tokens written into the proposal method."),
    target_layers: Optional[int] = typer.Option(None, "--target-layers", help="Target layer count, only needed when a foreign drafter's config names no aux layer ids (the engines' default is then used)."),
) -> dict:
    """Export a drafter for serving, with the aux layer ids converted to the engine's convention."""
    from eyas.common import check_out_path, check_safetensors_dir, require_owned
    from eyas.config_checks import check_value
    from eyas.errors import EyasError
    from eyas.export.formats import export_drafter

    if not drafter.is_dir():
        raise EyasError(f"--drafter {drafter} is not a directory (expected `eyas train`'s <out>/drafter)")
    check_value(target_layers, "--target-layers", ge=1, optional=True)
    check_out_path(out)
    if overwrite:
        require_owned(out, option="--overwrite")
    check_safetensors_dir(drafter, what="--drafter")
    return export_drafter(drafter, format, out, overwrite=overwrite, dtype=dtype, verifier=verifier,
                          speculative_tokens=speculative_tokens, target_layers=target_layers)
