"""Speculative decoding: the drafter as a function, exact replay of greedy decoding, acceptance metrics.

- drafters are read by eyas.drafter.reader (any of the three layouts, one `DrafterConfig`, weights
  keyed by SGLang's names, aux layer ids in eyas's convention).
- `functional`: the EAGLE-3 draft step written over those weights (step-0 pass over target features,
  tree/chain expansion steps with a KV buffer and an ancestor mask).
- `replay`: replay speculative decoding against a recorded greedy continuation (the fast path), chain
  and EAGLE-2 dynamic tree, batched over sequences in lock step.
- `reference`: a straightforward real speculative decoding loop (the slow path the replay is tested
  against): target verification with the real model, drafter recomputed from scratch every round.
- `metrics`: acceptance length, per-position rates, accepted/drafted, with written definitions.
- `generate`: evaluation prompts (MT-bench two turns) and batched greedy target generation.
- `report`: report.json, report.md and the acceptance-by-position plot.
- `run`: `eyas eval` end to end (`EvalConfig`, `run_eval`, `evaluate_to`).
- `speculative`: real batch-1 speculative decoding (chain / EAGLE-2 tree, one tree-masked verify forward,
  both KV caches kept to the accepted path, rejection sampling at temperature > 0) and the step-cost
  measurement behind eval's predicted speed-up.
- `generate_run`: `eyas generate` end to end: speculative vs target-only decoding in the same loop.

Run: `eyas eval --drafter DIR --out REPORT_DIR` (MT-bench, SmolLM2 by default);
`eyas generate --drafter DIR` (batch-1 speed-up against target-only decoding).
"""
