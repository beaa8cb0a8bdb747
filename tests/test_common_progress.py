"""common.progress: a long job reports count, rate and ETA on stderr, as a bar on a terminal and as
lines elsewhere; common.warn_gpu_sized: one warning where GPU-sized defaults run on a CPU."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.common import LineProgress, progress, warn_gpu_sized


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_line_progress_logs_rate_and_eta_every_interval(capsys):
    clock = FakeClock()
    bar = LineProgress(100, "generate", "tok", every=30.0, clock=clock)
    clock.t = 10.0
    bar.update(10)  # before the interval: quiet
    assert capsys.readouterr().err == ""
    clock.t = 40.0
    bar.update(30)  # 40 tok in 40 s: 1 tok/s, 60 to go
    err = capsys.readouterr().err
    assert err == "generate: 40/100 tok | 1 tok/s | 40s elapsed | eta 1m\n"
    clock.t = 100.0
    bar.update(60)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == "generate: 100/100 tok | 1 tok/s | 2m elapsed"


def test_a_short_job_stays_quiet_off_a_terminal(capsys):
    bar = progress(5, "replay", "seq")  # pytest's stderr is not a terminal
    assert isinstance(bar, LineProgress)
    bar.update(5)
    bar.close()
    assert capsys.readouterr().err == ""
    quiet = progress(5, "regen", "conv", lines=False)  # a caller that logs its own lines
    assert not isinstance(quiet, LineProgress) and quiet.disable


@dataclass(kw_only=True)
class _Cfg:
    limit: int | None = None
    max_new_tokens: int = 256


def test_gpu_sized_defaults_on_a_cpu_warn_once_naming_what_shortens_them(capsys):
    shorter = {"limit": 4, "max_new_tokens": 48}
    assert warn_gpu_sized(_Cfg(), "cpu", command="eval", shorter=shorter) == ["--limit 4", "--max-new-tokens 48"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("eval: warning:") and "--limit 4 --max-new-tokens 48" in err
    assert warn_gpu_sized(_Cfg(limit=2), "cpu", command="eval", shorter=shorter) == ["--max-new-tokens 48"]
    capsys.readouterr()
    assert warn_gpu_sized(_Cfg(), "cuda:0", command="eval", shorter=shorter) == []
    assert warn_gpu_sized(_Cfg(limit=2, max_new_tokens=48), "cpu", command="eval", shorter=shorter) == []
    assert capsys.readouterr().err == ""
