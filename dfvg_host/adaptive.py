"""Adaptive speculation length for chain drafting: γ chosen per round from what was measured.

Rule
----
Before each round the decoder asks :meth:`AdaptiveLength.choose` for γ and, after it,
tells :meth:`AdaptiveLength.observe` what happened. The controller keeps running
estimates of

* the **acceptance per draft position**, conditional on reaching it: ``a_i`` = P(draft
  i accepted | drafts 1..i-1 accepted). A round with γ drafts and ``k`` accepted judged
  positions ``1..min(k + 1, γ)``, of which ``1..k`` were accepted; positions after the
  first rejection were not judged and say nothing. Under greedy or sampled drafting
  ``a_i`` does not depend on γ (the drafts themselves do not), so one set of estimates
  prices every γ;
* the **verification time** as a function of the tokens verified, ``T_v(m) = a + b·m``
  with ``m = γ + 1`` (the pending token and γ drafts), fitted online (weighted least
  squares with exponential forgetting) to the *measured* target time of each round;
* the **draft time** of one request drafting ``n`` tokens, ``T_d(n) = c + d·n``, fitted
  the same way to the *modelled* engine + PCIe time of each request (``c``: the link
  model's per-request transfers and the engine's fixed cycles; ``d``: one engine forward
  and its bytes). Requests that feed more than two tokens (the prompt, a replay after a
  reset) are left out by the decoders, as their time is mostly the feed;
* the measured **host time** per round (a constant).

With them, for each γ in ``[gamma_min, gamma_max]``:

* expected tokens per round. The round commits its accepted drafts and one more token
  (the correction or the bonus), so ``E[tokens] = 1 + E[accepted]``, and ``E[accepted] =
  Σ_{i=1..γ} P(accepted ≥ i)``, where accepting at least ``i`` drafts means accepting
  each of 1..i in turn: ``P(accepted ≥ i) = Π_{j=1..i} a_j``. Hence
  ``E(γ) = 1 + Σ_{i=1..γ} Π_{j=1..i} a_j``;
* expected round time, serial: ``T(γ) = T_d(γ) + T_v(γ + 1) + h``. Pipelined
  (:class:`~dfvg_host.pipelined.PipelinedDecoder`: the continuation drafts γ + 1 tokens
  during verification; after a miss the next round drafts serially):
  ``T(γ) = T_v(γ + 1) + max(0, T_d(γ + 1) − T_v(γ + 1)) + (1 − P_hit)·T_d(γ) + h`` with
  ``P_hit = Π_{j=1..γ+1} a_j`` (all γ accepted, and the engine's guess of the bonus
  token right, priced as one more position);

and it picks the γ maximising ``E(γ) / T(γ)``, the expected tokens per second (ties go
to the smaller γ). Until it has one verification time and one draft time it returns
``gamma_init``.

Exploring
---------
Positions beyond the γ in use are never judged, so they have no data of their own. Two
things keep the estimates from locking γ in:

* **Shrinkage to the pooled acceptance**: ``a_i = (s_i + k·ᾱ) / (n_i + k)``, with
  ``(s_i, n_i)`` position i's forgetting counts and ``ᾱ`` the acceptance pooled over all
  judged positions (itself starting from ``prior_acceptance``). An unexplored position
  is priced at ``ᾱ``, a fair guess rather than an arbitrary optimistic one: with high
  acceptance γ grows at once, with low acceptance deep positions do not tempt it.
* **Probes**: every ``probe_every``-th choice is the best γ plus one (capped at
  ``gamma_max``), so the next position keeps being judged (acceptance at deep positions
  is often *higher* than the pooled figure — easy spans are long — which shrinkage alone
  would never find) and the verification fit sees more than one ``m`` (its slope is
  otherwise unidentified: with a single ``m`` the fit is flat). A probe costs one extra
  draft in one round of ``probe_every``. Probes are decided by the choice count, never by
  a draw.

Forgetting (``decay`` per observed round, on every estimate) keeps about ``1/(1 −
decay)`` rounds in view, so the controller follows a change of text or load: old
counts fade and the position estimates fall back towards the pooled one.

Smurfs' trend rule (raise γ while the cost per token falls, lower it when it rises) is
not used: it is a one-step hill climb on a measured figure that, on a shared host,
jitters by more than one γ step changes it, and it needs several rounds at each γ to
see a trend. The model above uses the same measurements (the cost per token is
``T(γ)/E(γ)``) but prices every γ at once from estimates that are shared between them.

Losslessness
------------
γ depends on past rounds only (their acceptance counts, measured and modelled times)
and on the choice count, never on the current round's drafts or the verifier's draws.
Given the past, γ is fixed before the round's randomness is drawn, so the round is an
ordinary fixed-length round and rejection sampling stays exact; greedy output is the
target's greedy decoding whatever γ is. Since γ depends on measured *wall* time, a
sampled generation with a given seed is not reproducible run to run (other γ, other
counters): the same distribution, not the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["AdaptiveLength", "RoundFacts", "LinearFit"]


@dataclass(frozen=True)
class RoundFacts:
    """What one round tells the controller.

    Members
    -------
    drafted : int
        Drafts the target judged (the γ the round used, after any truncation).
    accepted : int
        Drafts accepted, 0..drafted.
    verify_s : float
        Measured target time of the round's verification (``drafted + 1`` tokens).
    host_s : float or None
        Measured host time of the round, if known.
    draft_requests : sequence of (int, float)
        Draft requests made in the round that drafted from a short feed: (tokens drafted,
        modelled engine + PCIe seconds) each.
    """
    drafted: int
    accepted: int
    verify_s: float
    host_s: float | None = None
    draft_requests: Sequence[tuple[int, float]] = ()


@dataclass
class LinearFit:
    """``y ≈ a + b·x`` by least squares over exponentially forgotten observations.

    Members
    -------
    decay : float
        Weight kept by the past at each :meth:`update` (1: never forget).
    unidentified : str
        The fit while every ``x`` seen is the same: ``"flat"`` (``b = 0``) or
        ``"proportional"`` (``a = 0``, ``b = ȳ / x̄``).
    """
    decay: float = 0.95
    unidentified: str = "flat"
    sw: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def update(self, x: float, y: float) -> None:
        k = self.decay
        self.sw, self.sx, self.sy = k * self.sw + 1, k * self.sx + x, k * self.sy + y
        self.sxx, self.sxy = k * self.sxx + x * x, k * self.sxy + x * y

    @property
    def known(self) -> bool:
        return self.sw > 0

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)``, both >= 0; ``(0, 0)`` before any observation."""
        if not self.known:
            return 0.0, 0.0
        mx, my = self.sx / self.sw, self.sy / self.sw
        var = self.sxx / self.sw - mx * mx
        if var <= 1e-9 * max(1.0, mx * mx):
            if self.unidentified == "proportional" and mx > 0:
                return 0.0, max(0.0, my / mx)
            return max(0.0, my), 0.0
        b = max(0.0, (self.sxy / self.sw - mx * my) / var)
        a = my - b * mx
        if a < 0:                          # refit through the origin
            a, b = 0.0, max(0.0, self.sxy / self.sxx)
        return a, b

    def predict(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


class AdaptiveLength:
    """Chooses the speculation length γ of each chain round (module docstring).

    Members
    -------
    gamma_min, gamma_max : int
        The range γ is chosen in.
    gamma_init : int
        γ until one verification and one draft time have been seen.
    probe_every : int
        Every this many choices, the best γ plus one (0: never probe).
    decay : float
        Weight kept by the past per observed round, for every estimate.
    prior_acceptance : float
        The pooled acceptance before any round (weight of one judged position).
    shrink : float
        Pseudo-counts pulling each position's acceptance towards the pooled one.
    pipelined : bool
        Price rounds as :class:`~dfvg_host.pipelined.PipelinedDecoder` runs them (set by
        that decoder).
    choices : int
        Choices made so far.
    probes : int
        How many of them were probes.
    rounds : int
        Rounds observed.
    """

    #: ``gamma_max`` when not given.
    DEFAULT_GAMMA_MAX = 16

    def __init__(self, gamma_min: int = 1, gamma_max: int = DEFAULT_GAMMA_MAX, *, gamma_init: int = 4,
                 probe_every: int = 8, decay: float = 0.95, prior_acceptance: float = 0.6,
                 shrink: float = 2.0, pipelined: bool = False):
        if not 1 <= gamma_min <= gamma_max:
            raise ValueError(f"need 1 <= gamma_min <= gamma_max, got {gamma_min}, {gamma_max}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not 0 <= prior_acceptance <= 1:
            raise ValueError(f"prior_acceptance must be in [0, 1], got {prior_acceptance}")
        if probe_every < 0 or shrink <= 0:
            raise ValueError("probe_every must be >= 0 and shrink > 0")
        self.gamma_min, self.gamma_max = gamma_min, gamma_max
        self.gamma_init = min(max(gamma_init, gamma_min), gamma_max)
        self.probe_every = probe_every
        self.decay = decay
        self.prior_acceptance = prior_acceptance
        self.shrink = shrink
        self.pipelined = pipelined
        self.reset()

    def reset(self) -> None:
        """Forget everything observed."""
        n = self.gamma_max + 1                 # positions 1..gamma_max+1 (the bonus guess)
        self._judged = [0.0] * n
        self._accepted = [0.0] * n
        self._pool_judged = 0.0
        self._pool_accepted = 0.0
        self._verify = LinearFit(self.decay, "flat")
        self._draft = LinearFit(self.decay, "proportional")
        self._host = 0.0
        self._host_w = 0.0
        self.choices = 0
        self.probes = 0
        self.rounds = 0
        self.best = self.gamma_init

    # -- estimates -----------------------------------------------------------------------
    @property
    def pooled_acceptance(self) -> float:
        return ((self._pool_accepted + self.prior_acceptance) / (self._pool_judged + 1.0))

    def acceptance(self, position: int) -> float:
        """``a_position`` (1-based): P(accepted | every earlier draft accepted)."""
        i = position - 1
        pooled = self.pooled_acceptance
        if i >= len(self._judged):
            return pooled
        return (self._accepted[i] + self.shrink * pooled) / (self._judged[i] + self.shrink)

    def expected_tokens(self, gamma: int) -> float:
        """``E(γ) = 1 + Σ_{i=1..γ} Π_{j=1..i} a_j``: tokens committed per round."""
        total, run = 1.0, 1.0
        for i in range(1, gamma + 1):
            run *= self.acceptance(i)
            total += run
        return total

    @property
    def ready(self) -> bool:
        """Whether a verification and a draft time have been seen."""
        return self._verify.known and self._draft.known

    def expected_round_seconds(self, gamma: int) -> float:
        """``T(γ)``, serial or pipelined (module docstring)."""
        t_v = self._verify.predict(gamma + 1)
        h = self._host / self._host_w if self._host_w else 0.0
        if not self.pipelined:
            return self._draft.predict(gamma) + t_v + h
        hit = 1.0
        for i in range(1, gamma + 2):
            hit *= self.acceptance(i)
        return (t_v + max(0.0, self._draft.predict(gamma + 1) - t_v)
                + (1.0 - hit) * self._draft.predict(gamma) + h)

    def tokens_per_second(self, gamma: int) -> float:
        t = self.expected_round_seconds(gamma)
        return self.expected_tokens(gamma) / t if t > 0 else float("inf")

    def best_gamma(self) -> int:
        """The γ maximising expected tokens per second (``gamma_init`` until :attr:`ready`)."""
        if not self.ready:
            return self.gamma_init
        best, rate = self.gamma_min, -1.0
        for g in range(self.gamma_min, self.gamma_max + 1):
            r = self.tokens_per_second(g)
            if r > rate * (1 + 1e-9):
                best, rate = g, r
        return best

    # -- the decoder's side --------------------------------------------------------------
    def choose(self) -> int:
        """γ for the next round: the best, or a probe one above it (module docstring)."""
        self.choices += 1
        self.best = self.best_gamma()
        if self.probe_every and self.choices % self.probe_every == 0 and self.best < self.gamma_max:
            self.probes += 1
            return self.best + 1
        return self.best

    def observe(self, facts: RoundFacts) -> None:
        """Take in one round's outcome (:class:`RoundFacts`)."""
        k = self.decay
        self.rounds += 1
        if facts.drafted > 0:
            self._judged = [k * x for x in self._judged]
            self._accepted = [k * x for x in self._accepted]
            self._pool_judged *= k
            self._pool_accepted *= k
            judged = min(facts.accepted + 1, facts.drafted, len(self._judged))
            for i in range(judged):
                self._judged[i] += 1
                self._accepted[i] += i < facts.accepted
            self._pool_judged += judged
            self._pool_accepted += min(facts.accepted, judged)
        self._verify.update(facts.drafted + 1, facts.verify_s)
        for tokens, seconds in facts.draft_requests:
            if tokens > 0:
                self._draft.update(tokens, seconds)
        if facts.host_s is not None:
            self._host = k * self._host + max(0.0, facts.host_s)
            self._host_w = k * self._host_w + 1

    def describe(self) -> dict:
        """The current estimates, for reports."""
        a, b = self._verify.coefficients()
        c, d = self._draft.coefficients()
        return dict(best_gamma=self.best_gamma(), choices=self.choices, probes=self.probes,
                    rounds=self.rounds, pooled_acceptance=self.pooled_acceptance,
                    acceptance=[self.acceptance(i) for i in range(1, self.gamma_max + 1)],
                    verify_s=dict(intercept=a, per_token=b), draft_s=dict(intercept=c, per_token=d),
                    host_s=self._host / self._host_w if self._host_w else 0.0,
                    pipelined=self.pipelined)
