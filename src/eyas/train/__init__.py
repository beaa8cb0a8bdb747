"""Training the drafter: data sources (data.py), their order (plans.py), packed batches (batches.py) made
ahead of the step (prefetch.py), processes and parallelism (dist.py), checkpoints (checkpoint.py), metrics and
plots (metrics.py), the entry point (loop.py), what it builds before the first step (builders.py, checks.py),
the steps (step.py), their reports (report.py) and evaluations (evaluate.py)."""
