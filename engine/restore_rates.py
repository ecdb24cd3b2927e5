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
    the time from a restore's start to its last landing from that tier), averaged like
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
