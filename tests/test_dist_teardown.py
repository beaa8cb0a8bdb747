"""eyas.train.dist.teardown frees the process group at once, its gloo threads joined.

A group that outlives destroy_process_group() keeps gloo's worker and socket-loop threads running
into interpreter shutdown, where they race the exit: now and then a rank of a finished data-parallel
capture aborted with "terminate called without an active exception". The holder was a module
imported after the group existed that binds `group.WORLD` as a default argument
(torch.distributed.nn.functional, pulled in by transformers when it loads a config): init_group imports
it first. Without that import (or with plain init_process_group) the group stays referenced and the
test fails.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, sys, time, weakref
    import torch.distributed as tdist
    from eyas.train import dist as dd

    def gloo_threads():
        names = []
        for t in os.listdir("/proc/self/task"):
            try:
                names.append(open(f"/proc/self/task/{t}/comm").read().strip())
            except OSError:
                pass
        return [n for n in names if "gloo" in n]

    dd.init_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    import torch.distributed.nn.functional as F  # imported by init_group, before the group: binds None
    assert F.all_reduce.__defaults__[-1] is None, F.all_reduce.__defaults__
    ref = weakref.ref(tdist.group.WORLD)
    for _ in range(200):  # the threads name themselves once started
        if gloo_threads():
            break
        time.sleep(0.01)
    assert gloo_threads(), "no gloo threads to check"
    dd.teardown(None)
    assert not tdist.is_initialized()
    assert ref() is None, f"the group is still referenced {sys.getrefcount(ref()) - 1} times"
    for _ in range(200):  # a joined thread leaves /proc a moment after
        if not gloo_threads():
            break
        time.sleep(0.01)
    assert not gloo_threads(), gloo_threads()
    print("freed")
""")


def test_teardown_frees_the_group_and_joins_its_threads(tmp_path):
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "rendezvous")],
        capture_output=True,
        text=True,
        timeout=120,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)},
    )
    assert res.returncode == 0 and res.stdout.strip() == "freed", res.stderr[-3000:]
