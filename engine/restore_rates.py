"""The measured speeds that size a bidirectional restore's fronts (`engine.restore`): how
fast the model prefills, and how fast the slow tiers delivered to recent restores. Both are
learnt in the running process; until they are, a restore falls back to the plain meeting
point."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.stats import Tier

#: Tiers whose loads take longer than a step: the load front may leave their head to the
#: compute front. Host hits land within the step that issues them.
SLOW_TIERS = (Tier.DISK, Tier.REMOTE)
#: Seconds a restore must be expected to save over computing before the slow tiers are
#: consulted at all. Before a cold disk's first block lands, its index lookups and first
#: read cost tens of milliseconds, more than a short prefix takes to compute
#: (docs/BENCHMARKS.md, "Figures behind the engine's constants").
MIN_SAVING_S = 0.05
#: ... and while other requests run or wait, once the slow tiers' rates are measured: a
#: read must still be expected to save something, but the GPU time it saves serves the
#: others, so the margin for a wrong estimate is the lone request's alone
#: (`engine.restore_gate.RestoreGate.worth_reading`).
BUSY_MIN_SAVING_S = 0.001
#: A gate closed on measured rates is probed: the first prefix it turns away after a read
#: is read anyway, then every second, fourth, ... up to every this many.
MAX_PROBE_INTERVAL = 16


def worth_reading(num_tokens: int, prefill_tokens_per_s: float | None,
                  load_tokens_per_s: float | None, min_saving_s: float = MIN_SAVING_S,
                  load_latency_s: float = 0.0, fast_blocks_behind: bool = False) -> bool:
    """Whether `num_tokens` tokens still to come are worth looking for in the slow tiers:
    computing them alone (at the prefill rate P) must take `min_saving_s` longer than the
    two fronts together, or, while L is not known, at least `min_saving_s` at all. The
    fronts together: the model computes from the start while the tiers deliver L tokens/s
    once their first read ends, `load_latency_s` after the restore began, so they meet
    after (R + L * latency) / (P + L). When a fast tier (the host) holds some of them
    further on (`fast_blocks_behind`), reached only through the slow tiers' blocks, the rule
    is the one used while L is not known: the host's blocks are a sure saving, and the fronts size
    what the slow tiers read. True while P is not known (nothing to weigh it with), and
    always with `min_saving_s` 0."""
    if prefill_tokens_per_s is None or prefill_tokens_per_s <= 0:
        return True
    alone = num_tokens / prefill_tokens_per_s
    if load_tokens_per_s is None or fast_blocks_behind:
        return alone >= min_saving_s
    together = min(alone, (num_tokens + load_tokens_per_s * max(0.0, load_latency_s))
                   / (prefill_tokens_per_s + load_tokens_per_s))
    return alone - together >= min_saving_s


def _average(old: float | None, new: float) -> float:
    """Half the running average, half the newest sample: recent steps weigh most."""
    return new if old is None else (old + new) / 2


def prefill_keys(num_tokens: int, context: int) -> int:
    """Keys `num_tokens` new prompt tokens attend to in all, after `context` cached ones
    (each its context, the tokens before it in the chunk, and itself)."""
    return num_tokens * context + num_tokens * (num_tokens + 1) // 2


@dataclass(slots=True)
class PrefillRate:
    """How fast the model prefills, learnt from timed steps (`engine.step_timer`): a step of
    N prompt tokens attending to K keys in all (`prefill_keys`) takes about a*N + b*K
    seconds, a per token (the layers' matmuls) and b per key (attention). A chunk after a
    long context takes markedly longer than a fresh one (docs/BENCHMARKS.md, "Figures
    behind the engine's constants"), so one rate for both would give the compute front too
    much of a long prefix. a and b are fitted by least
    squares over recent steps, each step weighing twice the one before it; while the steps
    seen cannot tell them apart (all at one context) b is 0. None until a step was timed.
    `backlog_s`: seconds of prefill steps queued on the device and not finished yet (the
    engine sets it every step): a chunk claimed now starts computing only after them."""

    #: Decayed sums of the least squares: N*N, N*K, K*K, N*seconds, K*seconds.
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)
    per_token_s: float | None = None
    per_key_s: float = 0.0
    backlog_s: float = 0.0

    @property
    def tokens_per_s(self) -> float | None:
        """The rate with no context (1 / a); None until a step was timed."""
        return None if self.per_token_s is None else 1.0 / self.per_token_s

    def observe(self, num_tokens: int, seconds: float, num_keys: int = 0) -> None:
        """Count one step of `num_tokens` prompt tokens attending to `num_keys` keys that
        took `seconds` (steps with no tokens or no time are ignored)."""
        if num_tokens <= 0 or seconds <= 0:
            return
        n, k, y = float(num_tokens), float(num_keys), float(seconds)
        self._sums = [old / 2 + new for old, new in
                      zip(self._sums, (n * n, n * k, k * k, n * y, k * y))]
        nn, nk, kk, ny, ky = self._sums
        det = nn * kk - nk * nk
        if det > 1e-6 * nn * kk:  # steps at different contexts: both terms
            a, b = (ny * kk - ky * nk) / det, (ky * nn - ny * nk) / det
            if a > 0 and b >= 0:
                self.per_token_s, self.per_key_s = a, b
                return
        self.per_token_s, self.per_key_s = ny / nn, 0.0

    def observe_steps(self, steps: Iterable[tuple[int, int, float]]) -> None:
        """`observe` each (tokens, keys, seconds) of `steps` (`StepTimer.finished()`)."""
        for num_tokens, num_keys, seconds in steps:
            self.observe(num_tokens, seconds, num_keys)

    def seconds(self, num_tokens: int, context: int) -> float | None:
        """Expected seconds to compute `num_tokens` tokens after `context` (None: unknown)."""
        return self.step_seconds(num_tokens, prefill_keys(num_tokens, context))

    def step_seconds(self, num_tokens: int, num_keys: int) -> float | None:
        """Expected seconds of a step of `num_tokens` tokens attending to `num_keys` keys."""
        if self.per_token_s is None:
            return None
        return self.per_token_s * num_tokens + self.per_key_s * num_keys

    def head_pays(self, num_tokens: int, context: int, load_tokens_per_s: float,
                  others: int) -> bool:
        """Whether computing some of `num_tokens` tokens after `context` rather than loading
        them at `load_tokens_per_s` shortens the waiting of all the requests a step serves
        (this one and `others`): only while `others` times a token's seconds (on average
        over these tokens) stays below the 1/L a load of it takes. Serving many conversations
        behind a small host tier, heads sized for the request alone computed more than half
        of every prefix the disk held, at the others' cost (docs/BENCHMARKS.md, "The disk
        tier behind a small host tier"). True while the rate is unknown or `others` is 0."""
        if others <= 0 or num_tokens <= 0:
            return True
        seconds = self.seconds(num_tokens, context)
        if seconds is None:
            return True
        return others * seconds / num_tokens * load_tokens_per_s < 1.0

    def set_backlog(self, queued: list[tuple[int, int]]) -> None:
        """`backlog_s` from the (tokens, keys) of the prefill steps queued and not finished."""
        self.backlog_s = sum(self.step_seconds(n, k) or 0.0 for n, k in queued)

    def head_tokens(self, num_tokens: int, context: int, load_tokens_per_s: float,
                    backlog_s: float | None = None, others: int = 0) -> int:
        """Of `num_tokens` tokens after `context`, how many the model should compute (the
        head) while a tier delivering `load_tokens_per_s` loads the rest, so that both end
        together: h with backlog + a*h + b*(c*h + h*h/2) = (R - h) / L (the head starts once
        the queued steps ran; the loads are under way). 0 while the rate is unknown, or when
        the tier delivers everything before the queued steps end. `backlog_s` replaces the
        queued steps' seconds (`self.backlog_s`).

        `others`: requests that run beside this one. Each step's seconds hold up every one
        of them, so a token the head computes costs `others` times its seconds in their
        waiting, while sparing this request 1/L of its own; past `head_pays`, the head is 0
        and the tier delivers everything it holds."""
        if self.per_token_s is None or load_tokens_per_s <= 0:
            return 0
        if not self.head_pays(num_tokens, context, load_tokens_per_s, others):
            return 0
        linear = self.per_token_s + self.per_key_s * context + 1.0 / load_tokens_per_s
        rest = num_tokens / load_tokens_per_s - (self.backlog_s if backlog_s is None
                                                 else backlog_s)
        if rest <= 0:
            return 0
        if self.per_key_s == 0:
            head = rest / linear
        else:  # the positive root of b/2 h^2 + linear h - R/L = 0
            head = 2 * rest / (linear + math.sqrt(linear * linear + 2 * self.per_key_s * rest))
        return max(0, min(num_tokens, int(head)))


@dataclass(slots=True)
class TierRates:
    """Tokens per second each slow tier delivered to recent restores (tokens landed over
    the time that tier's reads were under way, timed on the I/O threads), averaged like
    `PrefillRate`. A new restore expects its slow tiers to do as well until they land.

    The rates only move when a tier is read, so a gate that closed on them (one cold read
    after start, a disk busy with writes for a while) would stay closed however fast the
    tier has become. So the gate is probed: `turned_away` says when a prefix it turned
    away is to be read anyway, and that read's rates replace the old ones (`observe` with
    `replace`) rather than being averaged with them."""

    tokens_per_s: dict[Tier, float] = field(default_factory=dict)
    #: Seconds from a restore's lookup (the tier's index included) to the end of the
    #: tier's first read.
    latency_s: dict[Tier, float] = field(default_factory=dict)
    #: Per slow tier: prefixes turned away since the last probe or read, and how many
    #: turned away make the next probe.
    _num_turned_away: dict[Tier, int] = field(default_factory=dict)
    _probe_every: dict[Tier, int] = field(default_factory=dict)

    def observe(self, tier: Tier, num_tokens: int, seconds: float,
                latency_s: float | None = None, replace: bool = False) -> None:
        """Count `num_tokens` tokens that `tier` delivered to one restore in `seconds`,
        its first read ending `latency_s` after the restore issued it; with `replace`
        (a probe's read) these figures replace the tier's average."""
        if num_tokens <= 0 or seconds <= 0:
            return
        old_rate = None if replace else self.tokens_per_s.get(tier)
        self.tokens_per_s[tier] = _average(old_rate, num_tokens / seconds)
        if latency_s is not None and latency_s >= 0:
            old_latency = None if replace else self.latency_s.get(tier)
            self.latency_s[tier] = _average(old_latency, latency_s)

    def opened(self, tiers: Iterable[Tier]) -> None:
        """The gate let a prefix through to the slow tiers in `tiers` on their rates: the
        next one it turns away is probed."""
        for tier in tiers:
            if tier in SLOW_TIERS:
                self._num_turned_away.pop(tier, None)
                self._probe_every.pop(tier, None)

    def turned_away(self, tiers: Iterable[Tier]) -> bool:
        """The gate turned a prefix away from the slow tiers in `tiers` on their measured
        rates: True when it is to be read anyway, a probe (the first turned away after a
        read, then every second, fourth, ... up to `MAX_PROBE_INTERVAL`: a tier that is
        still slow costs a probe now and then, one that became fast is noticed)."""
        slow = [tier for tier in tiers if tier in SLOW_TIERS]
        if not slow:
            return False
        for tier in slow:
            self._num_turned_away[tier] = self._num_turned_away.get(tier, 0) + 1
        if any(self._num_turned_away[t] < self._probe_every.get(t, 1) for t in slow):
            return False
        for tier in slow:
            self._num_turned_away[tier] = 0
            self._probe_every[tier] = min(MAX_PROBE_INTERVAL,
                                          2 * self._probe_every.get(tier, 1))
        return True

    def expected_latency(self, tiers: Iterable[Tier]) -> float:
        """The longest first-read latency among the slow tiers in `tiers` (0 if unknown)."""
        return max((self.latency_s.get(tier, 0.0) for tier in tiers if tier in SLOW_TIERS),
                   default=0.0)

    def expected(self, tiers: Iterable[Tier]) -> float | None:
        """The slowest rate among the slow tiers in `tiers`; None when none of them is slow
        or one of them has not been measured yet."""
        slow = {tier for tier in tiers if tier in SLOW_TIERS}
        if not slow or any(tier not in self.tokens_per_s for tier in slow):
            return None
        return min(self.tokens_per_s[tier] for tier in slow)


#: The share of a prefix a later restore is expected to compute while the prefill rate or the
#: slow tiers' rate is not measured yet: the fronts of equal speeds meet half way.
DEFAULT_HEAD_SHARE = 0.5


def expected_head_tokens(num_tokens: int, prefill: PrefillRate,
                         load_tokens_per_s: float | None) -> int:
    """Of a prefix of `num_tokens` tokens stored below the host, how many a later restore is
    expected to compute (its head) while the slow tiers load the rest at `load_tokens_per_s`:
    the meeting point of the two fronts (`PrefillRate.head_tokens`, nothing queued before
    it), or `DEFAULT_HEAD_SHARE` of the prefix while either rate is unknown. The blocks past
    it are those worth writing to the disk first."""
    if prefill.per_token_s is None or not load_tokens_per_s:
        return int(num_tokens * DEFAULT_HEAD_SHARE)
    return prefill.head_tokens(num_tokens, 0, load_tokens_per_s, backlog_s=0.0)
