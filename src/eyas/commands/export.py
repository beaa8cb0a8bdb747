"""`eyas export`: write a drafter in SGLang's or vLLM/speculators' serving layout (see eyas/export/formats.py).

The weight and vLLM options are the pipeline's [export] fields (eyas.pipeline.ExportOptions, via
eyas/cli_options.py, except `formats`: one --format per call here).
"""

from __future__ import annotations

from pathlib import Path

import typer

from eyas.cli_options import options_from


@options_from("eyas.pipeline:ExportOptions", exclude=("formats",))
def export(
    cfg,
    drafter: Path = typer.Option(
        ...,
        "--drafter",
        help="Drafter directory to export: eyas (`eyas train` output), SGLang or vLLM/speculators layout.",
    ),
    format: str = typer.Option(
        ...,
        "--format",
        help="`sglang` (LlamaForCausalLMEagle3, --speculative-draft-model-path) or `vllm` (speculators Eagle3Speculator, speculative_config model).",
    ),
    out: Path = typer.Option(..., "--out", help="Directory to create."),
    overwrite: bool = typer.Option(
        False,
        "--overwrite/--no-overwrite",
        help="Replace an existing --out export (files eyas did not write there are kept).",
    ),
    allow_other_target: bool = typer.Option(
        False,
        "--allow-other-target",
        help="Export an eyas drafter for a local --verifier other than the target it was trained for (a deliberate transfer).",
    ),
) -> dict:
    """Export a drafter for serving, with the aux layer ids converted to the engine's convention."""
    from eyas.common import check_out_dir, check_safetensors_dir
    from eyas.config_checks import option_name
    from eyas.errors import EyasError
    from eyas.export.formats import VLLM_ONLY, export_drafter

    for name, why in VLLM_ONLY.items():  # None: not given (the vllm format's defaults are resolved by export)
        if getattr(cfg, name) is not None and format != "vllm":
            flag = option_name(name)
            raise EyasError(
                f"{flag} only applies to --format vllm ({why}), not --format {format}: drop {flag}, "
                "or export with --format vllm"
            )
    if not drafter.is_dir():
        raise EyasError(f"--drafter {drafter} is not a directory (expected `eyas train`'s <out>/drafter)")
    check_out_dir(out, kind="export", overwrite=overwrite)
    check_safetensors_dir(drafter, what="--drafter")
    return export_drafter(
        drafter,
        format,
        out,
        overwrite=overwrite,
        dtype=cfg.weights_dtype,
        verifier=cfg.verifier,
        speculative_tokens=cfg.speculative_tokens,
        target_layers=cfg.target_layers,
        allow_other_target=allow_other_target,
    )
