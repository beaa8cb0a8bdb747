"""The `eyas` console entry point (cli.main): a usage error that click catches (unknown command or option, a
value of the wrong type, a missing option) is one line on stderr naming the command, exit 2, nothing on
stdout; help still prints and exits 0."""

from __future__ import annotations

import sys

import pytest

from eyas.cli import main


def _main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["eyas", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


@pytest.mark.parametrize(
    "args, needle",
    [
        (("train", "--steps", "abc", "--out", "x"), "eyas train: Invalid value for '--steps'"),
        (("prepare", "--bogus", "1"), "eyas prepare: No such option: --bogus"),
        (("frobnicate",), "eyas: No such command 'frobnicate'"),
        (("train", "--store", "x"), "eyas train: Missing option '--out'"),
    ],
)
def test_usage_errors_are_one_line_exit_2(monkeypatch, capsys, args, needle):
    code, out, err = _main(monkeypatch, capsys, *args)
    assert code == 2 and out == "", (code, out)
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
    assert "╭" not in err and "Usage:" not in err


def test_help_still_prints_and_exits_0(monkeypatch, capsys):
    code, out, err = _main(monkeypatch, capsys, "train", "--help")
    assert code == 0 and "--tokens-per-batch" in out and err == ""


def test_bad_input_found_by_a_command_keeps_its_own_line(monkeypatch, capsys, tmp_path):
    code, out, err = _main(monkeypatch, capsys, "verify", "--store", str(tmp_path / "missing"))
    assert code == 2 and err.count("\n") == 1 and "--store" in err and "is not a directory" in err, err


def test_a_ctrl_c_at_shutdown_is_no_traceback(tmp_path):
    """A Ctrl-C while atexit handlers run (just after a command printed its summary): the command's status, no
    KeyboardInterrupt traceback."""
    import subprocess

    script = (
        "import atexit, os, signal, sys, time\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(2)))  # runs last, as torch's\n"
        "sys.argv = ['eyas', 'verify', '--help']\n"
        "from eyas.cli import main\n"
        "main()\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--store" in r.stdout, r.stderr
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr
