"""Acceptance metrics with explicit names and written definitions (copied into every report).

Input: for every sequence, the number of draft tokens accepted in each drafting round.
"""

from __future__ import annotations

from typing import Any

DEFINITIONS = {
    "round": "one drafting round = one target verification forward; the prefill that produces the first token is not a round",
    "accepted": "draft tokens of a round equal to the target's greedy tokens, along the longest matching draft path",
    "acceptance_length": "tau = 1 + accepted / rounds: tokens gained per target forward, counting the target's bonus token",
    "per_position_acceptance": "entry j = fraction of rounds whose accepted length is at least j+1 (draft position j accepted)",
    "conditional_acceptance": "entry j = rounds accepting position j / rounds that accepted positions 0..j-1",
    "accepted_per_drafted": "accepted / (rounds x draft tokens submitted per round): chain k, tree --tree-tokens",
    "predicted_speedup_bs1": "tau x target-only decode step / speculative round (step_costs_s.round_s), step costs measured on the eval's device after a prefill of the median sequence length with the batch-1 engine for that device (step_costs_s.engine): on CUDA `static` (`eyas generate --engine static`; round = its draft + verify + walk with the result's device->host read + commit, target step = its round without a drafter), elsewhere `plain` (round = draft + drafter update + verify, host bookkeeping excluded); `eyas generate` measures the real loop; each cost is the median of repeats run until their spread settles. None (with `withheld` saying why) where the timings cannot back it: a range wider than 20% of the value, or a value above tau (a round cannot cost less than one target step)",
    "predicted_speedup_bs1_range": "the predicted speed-up from the timings' quartiles: upper-quartile target step / lower-quartile round, and the other way round",
    "end_of_sequence": "draft positions past the end of the recorded greedy continuation (max-new-tokens or EOS) count as rejected",
}


def summarize(rounds_per_sequence: list[list[int]], *, depth: int, drafted_per_round: int) -> dict[str, Any]:
    """Totals, tau and the per-position rates for one drafting mode."""
    hist = [0] * (depth + 1)
    for rounds in rounds_per_sequence:
        for a in rounds:
            if not 0 <= a <= depth:
                raise ValueError(f"accepted length {a} outside 0..{depth}")
            hist[a] += 1
    n_rounds = sum(hist)
    accepted = sum(a * n for a, n in enumerate(hist))
    at_least = [sum(hist[j:]) for j in range(depth + 1)]  # at_least[j] = rounds accepting >= j tokens
    return {
        "rounds": n_rounds,
        "accepted": accepted,
        "drafted": n_rounds * drafted_per_round,
        "drafted_per_round": drafted_per_round,
        "acceptance_length": 1.0 + accepted / n_rounds if n_rounds else None,
        "accepted_per_drafted": accepted / (n_rounds * drafted_per_round) if n_rounds else None,
        "per_position_acceptance": [at_least[j + 1] / n_rounds if n_rounds else None for j in range(depth)],
        "conditional_acceptance": [at_least[j + 1] / at_least[j] if at_least[j] else None for j in range(depth)],
        "accepted_length_histogram": hist,
    }
