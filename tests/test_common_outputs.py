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
    with pytest.raises(EyasError, match=r"^--out .*ours already exists: pass --overwrite to replace it, or choose "
                                        r"another --out$"):
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
