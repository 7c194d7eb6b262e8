"""The drafting policy: before a round, whether a request drafts at all, and from which source.

A drafting round costs ``T_draft`` whether or not its drafts survive (docs/design.md §21),
so a request whose drafts rarely survive is faster with the target alone. The policy
compares, per request and per round, the expected target steps per committed token of
each way to run the round, in units of one target step ``T(1)``:

* a source ``s`` that drafts ``d`` tokens, of which ``a_s`` are expected to survive:
  ``(1 + a_s)`` tokens for ``T_draft(s) + T_verify(1 + v)`` with ``v = min(d, a_s + 1)``
  drafts verified (verification usually ends one past the accepted prefix);
* no drafts: 1 token for ``T_verify(1) = 1`` step.

``a_s`` is what earlier rounds of the same request showed: the mean of the accepted drafts
of the rounds that drafted from ``s``, with the prior counted as ``prior_rounds`` rounds, until
the newest round's weight falls to ``smoothing``; from there on an exponential average. A
short memory (the plain exponential average) declines rounds that pay: a drafter that
averages 0.5-0.7 accepted drafts where the break-even is about a quarter dips below it for
a few unlucky rounds and then waits for a probe (docs/design.md §21.5). And the
costs are measured (:class:`DraftCosts`): ``T_verify`` from the SPS table, ``T_draft / T(1)``
from a drafting round timed beside the target's step (the table's
:class:`~vlmspec.scheduling.tables.DraftTiming`, or measured when the drafter is loaded),
never a remembered constant. A source not chosen for
``probe_every`` rounds is tried once (its evidence would otherwise never change). A probe
costs a drafting round, so a source whose last round had no draft survive waits twice as
long before the next one (up to ``max_probe_every``), and one whose draft survived goes back
to ``probe_every``: on a request where a source never pays, its probes thin out
geometrically instead of costing one round in ``probe_every`` for the whole answer.

**Non-anticipation** (§9, applied to drafting): every input of :func:`choose_source` is
known before the round's drafts are sampled: the evidence of earlier rounds, the costs,
and the draft length a deterministic source offers (an n-gram match is a function of the
committed tokens). The choice never looks at a draft the round samples, so whatever is
chosen, verification keeps the target's distribution; ``tests/scheduling/test_policy.py``
checks it statistically, and that a policy which peeks at its draft is caught.

Everything here is numbers in, numbers out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vlmspec.scheduling.tables import BatchSPSTable, SPSTable

NONE = "none"  # the round drafts nothing: the target alone for one token


@dataclass(frozen=True)
class DraftCosts:
    """What a round costs in target steps: ``T_verify(n) / T(1)`` and each source's ``T_draft / T(1)``."""

    verify_steps: tuple[float, ...]  # [N] T_verify(n) / T(1) for n = 1 .. N (non-decreasing)
    draft_steps: Mapping[str, float]  # source -> T_draft / T(1) (0 for a copy from the context)

    def __post_init__(self) -> None:
        if not self.verify_steps or any(v <= 0 for v in self.verify_steps):
            raise ValueError(f"verify_steps must be positive step ratios for n = 1, 2, ...; got {self.verify_steps}")
        if any(cost < 0 for cost in self.draft_steps.values()):
            raise ValueError(f"draft_steps must be >= 0 target steps per round, got {dict(self.draft_steps)}")

    @classmethod
    def from_table(cls, table: SPSTable | BatchSPSTable, draft_steps: Mapping[str, float] | None = None) -> DraftCosts:
        """Verify costs from a measured SPS table (one request's curve); drafting costs as given, else the
        table's own (its :class:`~vlmspec.scheduling.tables.DraftTiming`: ``T_draft / T(1)`` timed in one run).
        """
        curve = table.for_requests(1)
        if draft_steps is None:
            if curve.drafting is None:
                raise ValueError(
                    "this SPS table carries no measured drafting costs: measure them with `vlmspec profile "
                    "--drafter NAME` (or time a round with vlmspec.targets.profile.profile_draft_round) and pass "
                    "draft_steps"
                )
            draft_steps = curve.drafting.steps()
        return cls(tuple(curve.sps(1) / curve.sps(n) for n in range(1, curve.max_tokens + 1)), dict(draft_steps))

    def verify(self, tokens: int) -> float:
        """``T_verify(tokens) / T(1)``; past the table, the last entry grown linearly in tokens."""
        n = max(int(tokens), 1)
        table = self.verify_steps
        return table[n - 1] if n <= len(table) else table[-1] * n / len(table)


@dataclass
class SourceEvidence:
    """What earlier rounds of one request showed about one draft source."""

    accepted: float  # expected accepted drafts per round it drafts (mean from a prior, then exponential)
    wait: int  # idle rounds after which it is probed: grows after rounds where nothing survived
    rounds: int = 0  # rounds it has drafted for this request
    idle: int = 0  # rounds since it last drafted


@dataclass
class DraftingPolicy:
    """The causal per-request choice of a draft source (see the module docstring).

    ``priors``: accepted drafts per round each source is credited with before any evidence;
    ``smoothing``: the least weight of the newest round in the average; ``prior_rounds``: how
    many rounds the prior counts as while the average is still a mean (None: ``1 / smoothing
    - 1``, so that every round weighs ``smoothing``: a plain exponential average);
    ``probe_every``: a source idle this many rounds is tried once; ``max_probe_every``: the
    longest wait between probes of a source whose drafts keep failing (the wait doubles after
    each such round).
    """

    costs: DraftCosts
    priors: Mapping[str, float] = field(default_factory=dict)
    smoothing: float = 0.3
    probe_every: int = 16
    max_probe_every: int = 64
    prior_rounds: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must lie in (0, 1], got {self.smoothing}")
        if self.prior_rounds is not None and self.prior_rounds < 0:
            raise ValueError(
                f"prior_rounds must be >= 0 rounds (or None for 1 / smoothing - 1), got {self.prior_rounds}"
            )
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1 round, got {self.probe_every}")
        if self.max_probe_every < self.probe_every:
            raise ValueError(
                f"max_probe_every ({self.max_probe_every}) must be >= probe_every ({self.probe_every}) rounds"
            )

    def new_evidence(self, sources: Sequence[str]) -> dict[str, SourceEvidence]:
        """A request's evidence before its first round: the priors."""
        return {source: SourceEvidence(float(self.priors.get(source, 1.0)), self.probe_every) for source in sources}

    def choose(self, evidence: Mapping[str, SourceEvidence], offers: Mapping[str, int]) -> str:
        """The source to draft from this round, or :data:`NONE`. ``offers``: source -> drafts it can give (> 0)."""
        return choose_source(evidence, offers, self.costs)

    def observe(self, evidence: Mapping[str, SourceEvidence], chosen: str, accepted: int | None) -> None:
        """Record a finished round: ``chosen`` drafted and ``accepted`` of its drafts survived (None: unknown)."""
        for source, seen in evidence.items():
            seen.idle = 0 if source == chosen else seen.idle + 1
        if chosen != NONE and accepted is not None:
            seen = evidence[chosen]
            seen.accepted += self.newest_weight(seen.rounds) * (accepted - seen.accepted)
            seen.rounds += 1
            seen.wait = self.probe_every if accepted > 0 else min(2 * seen.wait, self.max_probe_every)

    def newest_weight(self, rounds_before: int) -> float:
        """The weight of a source's newest round in its average, after ``rounds_before`` earlier rounds."""
        prior_rounds = 1.0 / self.smoothing - 1.0 if self.prior_rounds is None else self.prior_rounds
        return max(self.smoothing, 1.0 / (prior_rounds + rounds_before + 1.0))


def planned_drafts(accepted: float, offered: int) -> int:
    """Drafts worth verifying from a source expected to have ``accepted`` survive: one past them, at most ``offered``.

    Verification usually ends one past the accepted prefix, so more costs verify slots that
    rarely pay; a proposer cuts a deterministic source's drafts (an n-gram copy, verified
    whole) to this length, and a scheduler does the like for a model's from its confidences.
    """
    return min(offered, max(1, round(accepted) + 1))


def expected_steps_per_token(accepted: float, drafts: int, draft_steps: float, costs: DraftCosts) -> float:
    """Target steps a committed token costs when a round offers ``drafts`` of which ``accepted`` survive.

    The round verifies :func:`planned_drafts` of them.
    """
    return (draft_steps + costs.verify(1 + planned_drafts(accepted, drafts))) / (1.0 + min(accepted, drafts))


def choose_source(
    evidence: Mapping[str, SourceEvidence],
    offers: Mapping[str, int],
    costs: DraftCosts,
) -> str:
    """The offered source with the fewest expected target steps per token, if fewer than the target alone's 1.

    A source idle for its ``wait`` rounds or more is chosen to refresh its evidence (the
    most idle first). Only sources in ``offers`` with at least one draft compete.
    """
    offered = {source: n for source, n in offers.items() if n > 0 and source in evidence}
    overdue = [s for s in offered if evidence[s].idle >= evidence[s].wait]
    if overdue:
        return max(overdue, key=lambda s: evidence[s].idle)
    best, best_cost = NONE, costs.verify(1)
    for source, drafts in offered.items():
        cost = expected_steps_per_token(evidence[source].accepted, drafts, costs.draft_steps.get(source, 0.0), costs)
        if cost < best_cost:
            best, best_cost = source, cost
    return best
