"""common.check_out_dir: the one check of an output directory that a stage writes whole (export, prepare, eval):
eyas's and this stage's, and new unless --overwrite; --overwrite is suggested only where it would work."""

from __future__ import annotations

import pytest

from eyas.common import check_out_dir, write_marker
from eyas.errors import EyasError


def test_check_out_dir_refuses_what_is_not_ours_before_saying_it_exists(tmp_path):
    check_out_dir(tmp_path / "new", kind="export", overwrite=False)
    ours = tmp_path / "ours"
    ours.mkdir()
    write_marker(ours, kind="export")
    (ours / "config.json").write_text("{}")
    with pytest.raises(
        EyasError,
        match=r"^--out .*ours already exists: pass --overwrite to replace it, or choose "
        r"another --out$",
    ):
        check_out_dir(ours, kind="export", overwrite=False)
    check_out_dir(ours, kind="export", overwrite=True)
    with pytest.raises(EyasError, match=r"^--overwrite: .*ours is an eyas `export` output, not a `prepare` output"):
        check_out_dir(ours, kind="prepare", overwrite=True)
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    for overwrite, option in ((False, "--out"), (True, "--overwrite")):
        with pytest.raises(EyasError, match=rf"^{option}: .*user holds files eyas did not create") as err:
            check_out_dir(user, kind="eval", overwrite=overwrite, empty_ok=True)
        assert "pass --overwrite" not in str(err.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(EyasError, match="is an existing file, not a directory"):
        check_out_dir(tmp_path / "file", kind="eval", overwrite=True)


def test_check_out_dir_takes_an_empty_directory_only_where_asked(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(EyasError, match=r"empty already exists: pass --overwrite"):
        check_out_dir(empty, kind="prepare", overwrite=False)  # written by a rename: the folder must not exist
    check_out_dir(empty, kind="eval", overwrite=False, empty_ok=True)
    write_marker(empty, kind="eval")
    with pytest.raises(EyasError, match=r"empty already exists and is not empty: pass --overwrite"):
        check_out_dir(empty, kind="eval", overwrite=False, empty_ok=True)


def test_export_with_overwrite_refuses_a_users_directory_before_reading_the_drafter(tmp_path):
    """export_drafter checks its --out as the CLI does (before, with overwrite, only once the export was written)."""
    from eyas.export.formats import export_drafter

    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(EyasError, match=r"^--overwrite: .*user holds files eyas did not create"):
        export_drafter(tmp_path / "no-drafter", "sglang", user, overwrite=True)
    assert [p.name for p in user.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_outputs_get_the_mode_the_umask_gives(tmp_path, tiny_target_dir, umask):
    """Atomic writes (mkstemp/mkdtemp: owner-only) end with the mode any new file gets: weights, a checkpoint,
    an export folder and its files, a report folder and its files."""
    import os
    import stat
    from pathlib import Path

    import torch

    from eyas.common import atomic_directory, atomic_write_json, current_umask
    from eyas.drafter.model import DrafterConfig, Eagle3Drafter
    from eyas.export.formats import export_drafter
    from eyas.target import load_target, model_identity
    from eyas.train.checkpoint import save_checkpoint

    def mode(p):
        return stat.S_IMODE(os.stat(p).st_mode)

    target = load_target(tiny_target_dir)
    cfg = DrafterConfig.from_target_config(target.config, draft_vocab_size=300, aux_layer_ids=[1, 2, 3])
    model = Eagle3Drafter(cfg)
    model.reset_parameters(seed=0)
    model.set_vocab(torch.arange(0, 3000, 10))
    old = os.umask(umask)
    try:
        assert current_umask() == umask
        weights = model.save(tmp_path / "drafter", target=model_identity(tiny_target_dir)) / "model.safetensors"
        lin = torch.nn.Linear(2, 2)
        opt = torch.optim.AdamW(lin.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        ckpt = save_checkpoint(
            tmp_path / "ck" / "step-000001.safetensors",
            model=lin,
            optimizer=opt,
            scheduler=sched,
            step=1,
            identity={},
            extra={},
            is_main=True,
        )
        export = Path(export_drafter(tmp_path / "drafter", "sglang", tmp_path / "export")["out"])
        with atomic_directory(tmp_path / "eval", kind="eval") as tmp:
            atomic_write_json(tmp / "report.json", {"ok": True})
    finally:
        os.umask(old)
    files, folders = 0o666 & ~umask, 0o777 & ~umask
    assert mode(weights) == mode(ckpt) == mode(tmp_path / "eval" / "report.json") == files
    assert mode(export) == mode(tmp_path / "eval") == folders
    assert {mode(p) for p in export.iterdir()} == {files}
