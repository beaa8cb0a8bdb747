"""`eyas regenerate`: replace every assistant turn with the target's own answer (see eyas/regen/).

The options are RegenConfig's fields (eyas/regen/run.py, via eyas/cli_options.py).
"""

from __future__ import annotations

from eyas.cli_options import options_from


@options_from("eyas.regen.run:RegenConfig")
def regenerate(cfg) -> dict:
    """Regenerate the assistant turns of a chat dataset with the target itself, turn by turn."""
    from eyas.common import check_out_path, require_owned
    from eyas.errors import EyasError
    from eyas.regen.run import regenerate as run

    # the output directory is checked here, before any source is read or model loaded
    check_out_path(cfg.out)
    if cfg.overwrite:
        require_owned(cfg.out, option="--overwrite", kind="regenerate")
    summary = run(cfg)
    if summary.get("conversations") and not summary.get("written"):  # nothing usable must not look like success
        reasons = ", ".join(f"{k}: {v}" for k, v in (summary.get("skipped") or {}).items()) or "none recorded"
        raise EyasError(
            f"--source {cfg.source}: none of its {summary['conversations']} conversations could be "
            f"regenerated (skipped: {reasons}); it needs user turns followed by assistant turns. "
            f"{cfg.out} holds no chats"
        )
    return summary
