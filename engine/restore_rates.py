"""The measured speeds that size a bidirectional restore's fronts (`engine.restore`): how
fast the model prefills, and how fast the slow tiers delivered to recent restores. Both are
learnt in the running process; until they are, a restore falls back to the plain meeting
point."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.stats import Tier

#: Tiers whose loads take longer than a step: the load front may leave their head to the
#: compute front. Host hits land within the step that issues them.
SLOW_TIERS = (Tier.DISK, Tier.REMOTE)
#: Seconds a restore must be expected to save over computing before the slow tiers are
#: consulted at all. Before a cold disk's first block lands, its index lookups and first
#: read cost tens of milliseconds: on a lent H100 a 1K-token prefix (25 ms to compute)
#: took 140 ms to restore from a cold disk, an 8K one 1.16x its compute time.
MIN_SAVING_S = 0.05


def worth_reading(num_tokens: int, prefill_tokens_per_s: float | None,
                  load_tokens_per_s: float | None, min_saving_s: float = MIN_SAVING_S) -> bool:
    """Whether `num_tokens` tokens still to come are worth looking for in the slow tiers:
    computing them alone (at the prefill rate P) must take `min_saving_s` longer than the
    two fronts together (P + L, L the slow tiers' rate), or, while L is not known, at
    least `min_saving_s` at all. True while P is not known (nothing to weigh it with), and
    always with `min_saving_s` 0."""
    if prefill_tokens_per_s is None or prefill_tokens_per_s <= 0:
        return True
    alone = num_tokens / prefill_tokens_per_s
    if load_tokens_per_s is None:
        return alone >= min_saving_s
    together = num_tokens / (prefill_tokens_per_s + load_tokens_per_s)
    return alone - together >= min_saving_s


def _average(old: float | None, new: float) -> float:
    """Half the running average, half the newest sample: recent steps weigh most."""
    return new if old is None else (old + new) / 2


@dataclass(slots=True)
class PrefillRate:
    """Tokens per second the model computes in prefill steps, averaged over recent steps
    (None until one was timed: `engine.step_timer`); sizes a restore's claims."""

    tokens_per_s: float | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Count one step of `num_tokens` tokens that took `seconds`."""
        if num_tokens <= 0 or seconds <= 0:
            return
        self.tokens_per_s = _average(self.tokens_per_s, num_tokens / seconds)


@dataclass(slots=True)
class TierRates:
    """Tokens per second each slow tier delivered to recent restores (tokens landed over
    the time that tier's reads were under way, timed on the I/O threads), averaged like
    `PrefillRate`. A new restore expects its slow tiers to do as well until they land."""

    tokens_per_s: dict[Tier, float] = field(default_factory=dict)

    def observe(self, tier: Tier, num_tokens: int, seconds: float) -> None:
        """Count `num_tokens` tokens that `tier` delivered to one restore in `seconds`."""
        if num_tokens <= 0 or seconds <= 0:
            return
        self.tokens_per_s[tier] = _average(self.tokens_per_s.get(tier), num_tokens / seconds)

    def expected(self, tiers: Iterable[Tier]) -> float | None:
        """The slowest rate among the slow tiers in `tiers`; None when none of them is slow
        or one of them has not been measured yet."""
        slow = {tier for tier in tiers if tier in SLOW_TIERS}
        if not slow or any(tier not in self.tokens_per_s for tier in slow):
            return None
        return min(self.tokens_per_s[tier] for tier in slow)
