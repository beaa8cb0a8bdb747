"""Training the drafter: data sources (data.py), processes and parallelism (dist.py), checkpoints
(checkpoint.py), metrics and plots (metrics.py) and the loop itself (loop.py)."""
