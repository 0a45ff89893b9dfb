"""Reward shaping that depends on the response, not on its correctness.

DAPO's soft overlong punishment (Yu et al. 2025, eq. 13). With L the response length in tokens
(EOS included), L_max = generator.max_new_tokens, L_cache = reward.overlong_buffer and
f = reward.overlong_penalty:

    R_length(L) = 0                                 if L <= L_max - L_cache
                = ((L_max - L_cache) - L) / L_cache * f    if L_max - L_cache < L <= L_max
                = -f                                if L > L_max

so the penalty ramps linearly from 0 to -f over the last L_cache tokens of the budget. It is added
to the task reward of every training sample (not to the held-out evaluation).
"""

from __future__ import annotations


def overlong_penalty(length: int, max_len: int, buffer: int, factor: float) -> float:
    """R_length(L) above; 0 when `buffer` is 0 (off)."""
    if buffer <= 0:
        return 0.0
    start = max_len - buffer
    if length <= start:
        return 0.0
    if length <= max_len:
        return (start - length) / buffer * factor
    return -factor
