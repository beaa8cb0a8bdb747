"""`eyas train`: train an EAGLE-3 drafter offline from a store or online with the target in the loop.

Same command on one CPU process, one GPU, or N GPUs:
    eyas train --data prepared/ --out run/ --steps 200                      (online, one process)
    torchrun --nproc_per_node 8 -m eyas train --store store/ --out run/ --fsdp   (offline, 8 GPUs)
The options are TrainConfig's fields (eyas/train/loop.py, via eyas/cli_options.py); see that file for
the order of work and the metric definitions.
"""

from __future__ import annotations

from eyas.cli_options import options_from


@options_from("eyas.train.loop:TrainConfig")
def train(cfg) -> dict:
    """Train an EAGLE-3 drafter with training-time test (offline --store or online --data)."""
    from eyas.train.loop import run

    return run(cfg)
