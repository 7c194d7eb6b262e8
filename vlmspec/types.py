"""Dataclasses that cross module boundaries.

Vocabulary used everywhere in vlmspec (the convention the field reports):

* a draft token is **accepted** when it survives verification;
* at the first rejection the target's resample is the **recovered** token;
* after a fully accepted block the target samples one more, the **bonus** token;
* tau = accepted + 1 per round (the +1 is the recovered or bonus token).

:class:`SpecStats` counts a generation's rounds, :meth:`SpecStats.merge` pools several
generations, and :class:`RoundRecord` is what the engine reports about each round.

Distributions are named ``draft_probs`` and ``target_probs``; both are float32.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any

import torch

# How a target's M-RoPE positions map to a drafter's 1-D positions (see vlmspec.targets.positions).
DEFAULT_POSITION_RULE = "interpolate"


# Temperatures below this sample as greedy (argmax), as in vLLM: dividing logits by a
# smaller one overflows float32 (1e-45 is denormal, 1e-300 rounds to 0), and at 1e-5 a
# logit gap of 1e-3 already gives odds of e^100, so nothing but an exact tie could be drawn.
GREEDY_BELOW_TEMPERATURE = 1e-5
# The range OpenAI's API accepts for a logit_bias value: -100 bans a token, +100 forces it.
LOGIT_BIAS_RANGE = (-100.0, 100.0)


@dataclass(frozen=True)
class SamplingParams:
    """How the target alone would sample. ``temperature == 0`` means greedy (argmax).

    This is the distribution only: what a proposer, :func:`vlmspec.sampling.target_probs`
    and verification need. Requests that share it are verified together, whatever their
    seeds. A request's other options (length, seed, stop strings) are in :class:`RequestOptions`.

    The chain (see :mod:`vlmspec.sampling`): ``logit_bias`` is added to the raw logits, then
    greedy takes the argmax; otherwise temperature, top-k, top-p, min-p, softmax.

    * ``temperature``: 0, or any finite value below :data:`GREEDY_BELOW_TEMPERATURE`, is greedy.
    * ``min_p``: after temperature, keep the tokens whose probability is at least ``min_p``
      times the most probable token's (llama.cpp's and vLLM's rule); None or 0 keeps all.
    * ``logit_bias``: token id -> a value in [-100, 100] added to that token's logit (OpenAI's
      ``logit_bias``). Given as a mapping (JSON's decimal-string keys are accepted) or pairs;
      stored as a tuple of ``(token_id, bias)`` pairs sorted by id, so params stay hashable
      (``dict(params.logit_bias)`` gives the mapping back). An empty mapping is stored as None.
      Ids are checked against the vocabulary where it is known: :meth:`check_vocabulary`.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    logit_bias: Mapping[int, float] | Iterable[tuple[int, float]] | None = None  # stored: ((id, bias), ...) or None

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None and (not _is_integer(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1, or None for no top-k, got {self.top_k!r}")
        if self.top_p is not None and not (_is_real(self.top_p) and 0.0 < self.top_p <= 1.0):  # NaN fails too
            raise ValueError(f"top_p must be a number in (0, 1], or None for no top-p, got {self.top_p!r}")
        if self.min_p is not None and not (_is_real(self.min_p) and 0.0 <= self.min_p <= 1.0):  # NaN fails too
            raise ValueError(f"min_p must be a number in [0, 1], or None for no min-p, got {self.min_p!r}")
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))  # frozen: the one normalisation

    @property
    def greedy(self) -> bool:
        """Whether the target takes the argmax: temperature 0, or below :data:`GREEDY_BELOW_TEMPERATURE`."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise ValueError if ``logit_bias`` names a token id outside ``[0, vocab_size)``.

        :func:`vlmspec.sampling.target_probs` checks it against the logits; a host that knows
        the vocabulary at admission (a server) calls it there, before any work.
        """
        if self.logit_bias and self.logit_bias[-1][0] >= vocab_size:  # pairs are sorted by id
            outside = [token for token, _ in self.logit_bias if token >= vocab_size]
            raise ValueError(
                f"logit_bias names token ids {outside[:8]} outside the vocabulary [0, {vocab_size}); "
                "use ids of the model's tokenizer"
            )


# The seeds torch.Generator.manual_seed accepts.
SEED_RANGE = (-(2**63), 2**64)


@dataclass(frozen=True)
class RequestOptions(SamplingParams):
    """Everything a caller chooses about one request besides its inputs: the one request-options object.

    Every entry point builds it and hands it down unchanged: ``SpecEngine.generate`` and
    ``.stream``, ``BatchEngine.add_request``, the ``vlmspec`` command and the HTTP server,
    down to the step API (``SpecDecoder.new_request``). Keyword arguments become one with
    :meth:`build`, the only place that turns them into options, so the fields and their
    defaults below are written once, checked once (here, in ``__post_init__``: a
    ValueError names the field and its valid range) and stop strings normalised once
    (a string or a list of strings becomes a tuple).

    It extends :class:`SamplingParams` rather than holding one so that its fields read
    flat (``RequestOptions(max_new_tokens=64, temperature=0.7, seed=1)``), as the keywords
    do; :attr:`sampling` is the distribution part alone, which proposers and verification
    take (rows with different seeds or lengths still share it, and verify together).
    """

    max_new_tokens: int = 128  # most tokens to generate (EOS included)
    seed: int = 0  # seeds the request's own torch.Generator: its draws do not depend on other requests
    stop: tuple[str, ...] = ()  # generation ends at the token that completes one (a str or a list is accepted)
    # False: the target alone (nothing drafted) through the same host, on the same KV rows: the baseline
    # SpecEngine.generate(..., speculative=False) runs, and a host's way to serve one request undrafted.
    speculative: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _is_integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_integer(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64) (torch.Generator's seeds), got {self.seed!r}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be True or False, got {self.speculative!r}")
        object.__setattr__(self, "stop", _stop_strings(self.stop))  # frozen: the one normalisation

    @classmethod
    def build(cls, options: RequestOptions | None = None, **overrides: Any) -> RequestOptions:
        """``options`` (default: the defaults) with the fields named in ``overrides`` replaced.

        >>> RequestOptions.build(max_new_tokens=64, temperature=0.7)
        >>> RequestOptions.build(options, seed=2)  # the same options, another seed

        Raises TypeError for a name that is no field (a typo), ValueError for a bad value.
        """
        if options is not None and not isinstance(options, RequestOptions):
            raise TypeError(f"options must be a vlmspec.types.RequestOptions, got {type(options).__name__}")
        unknown = sorted(set(overrides) - set(cls.names()))
        if unknown:
            raise TypeError(f"unknown request options {unknown}; the request options are {', '.join(cls.names())}")
        if not overrides:
            return options if options is not None else cls()
        return replace(options, **overrides) if options is not None else cls(**overrides)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, as keywords of :meth:`build` (and of ``generate``, ``stream``, ``add_request``)."""
        return tuple(f.name for f in fields(cls))

    @cached_property
    def sampling(self) -> SamplingParams:
        """The distribution alone (temperature, top-k, top-p, min-p, logit bias): what proposers and verification take."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            logit_bias=self.logit_bias,
        )


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _logit_bias_pairs(
    logit_bias: Mapping[int, float] | Iterable[tuple[int, float]] | None,
) -> tuple[tuple[int, float], ...] | None:
    """``logit_bias`` as ``((token_id, bias), ...)`` sorted by id, or None when it biases nothing.

    Keys may be integers or decimal strings (JSON object keys, as OpenAI clients send them);
    values must be finite numbers in :data:`LOGIT_BIAS_RANGE`.
    """
    if logit_bias is None:
        return None
    if isinstance(logit_bias, (str, bytes)):
        raise ValueError(f"logit_bias must map token ids to biases, e.g. {{50256: -100}}, got {logit_bias!r}")
    try:
        pairs = list(logit_bias.items()) if isinstance(logit_bias, Mapping) else [tuple(p) for p in logit_bias]
    except TypeError:
        raise ValueError(f"logit_bias must map token ids to biases, e.g. {{50256: -100}}, got {logit_bias!r}") from None
    low, high = LOGIT_BIAS_RANGE
    by_token: dict[int, float] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, e.g. {{50256: -100}}, got the entry {pair!r}")
        key, value = pair
        token = _token_id(key)
        if token is None:
            raise ValueError(
                f"logit_bias keys must be token ids (integers >= 0, or their decimal strings), got {key!r}"
            )
        if not _is_real(value) or not low <= value <= high:  # NaN and infinities fail too
            raise ValueError(
                f"logit_bias values must be numbers in [{low:g}, {high:g}], got {value!r} for token {token}"
            )
        if token in by_token:
            raise ValueError(f"logit_bias names token {token} twice")
        by_token[token] = float(value)
    return tuple(sorted(by_token.items())) or None


def _token_id(key: object) -> int | None:
    """``key`` as a token id (an integer >= 0, or its decimal string), or None when it is not one."""
    if _is_integer(key):
        token = int(key)
    elif isinstance(key, str) and key.strip().isdecimal():
        token = int(key)
    else:
        return None
    return token if token >= 0 else None


def _stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (one string, a list of them, or None)."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}")
    return stops


@dataclass
class ContextUpdate:
    """What the engine tells a proposer about one request at the start of a round.

    ``token_ids`` is the span committed since the last round whose target features are
    now known (at the first round: the whole prompt). The ``anchor`` is the last
    committed token: the target has not processed it yet, so it has no features; it is
    the first input of the next draft block.
    """

    token_ids: torch.Tensor  # [n] int64, newly committed tokens that have target features
    positions: torch.Tensor  # [n] int64, their 1-D text-stream positions (see vlmspec.targets.positions)
    features: torch.Tensor | None  # [n, m * d_target] hooked target features, or None if none were asked for
    anchor: int  # last committed token id
    anchor_position: int  # its 1-D text-stream position

    @classmethod
    def joined(cls, updates: Sequence[ContextUpdate]) -> ContextUpdate:
        """One update holding consecutive spans (rounds a proposer sat out, then the last), anchored as the last."""
        if len(updates) == 1:
            return updates[0]
        features = None
        if all(u.features is not None for u in updates):
            features = torch.cat([u.features.to(updates[0].features.device) for u in updates])
        return cls(
            token_ids=torch.cat([u.token_ids for u in updates]),
            positions=torch.cat([u.positions for u in updates]),
            features=features,
            anchor=updates[-1].anchor,
            anchor_position=updates[-1].anchor_position,
        )


@dataclass
class PrefillOutput:
    """What a host's prefill of one request hands to the step API (``SpecDecoder.start``)."""

    token_ids: torch.Tensor  # [L] int64, the prompt
    positions: torch.Tensor  # [L] int64, the prompt's 1-D text-stream positions (see vlmspec.targets.positions)
    features: torch.Tensor | None  # [L, m * d_target] hooked target features of the prompt, or None
    logits: torch.Tensor  # [V] the target's prediction after the last prompt token
    next_position: int  # 1-D position of the first generated token (prompt length + rope_delta for Qwen-VL)


@dataclass
class DraftBlock:
    """A proposal for a batch of requests.

    Rows may hold fewer than ``gamma`` real drafts: ``num_tokens[r]`` says how many; the
    rest of the row is padding and is never verified.
    """

    tokens: torch.Tensor  # [B, gamma] int64
    num_tokens: torch.Tensor  # [B] int64, drafted tokens per request (<= gamma)
    # The float32 distribution each token was actually drawn from (after any sequential
    # bias and temperature); None means the drafter is deterministic (one-hot).
    draft_probs: torch.Tensor | None = None  # [B, gamma, V] float32
    # Conditional survival probability of each position given the ones before survived.
    confidences: torch.Tensor | None = None  # [B, gamma] float32
    # Where each row's drafts came from, for a proposer that chooses per request (e.g. "ngram",
    # "corpus", "model", "none" for a row that drafts nothing this round); None: one source for all.
    sources: tuple[str, ...] | None = None  # [B]

    @property
    def gamma(self) -> int:
        return self.tokens.shape[1]

    def select(self, rows: torch.Tensor | Sequence[int]) -> DraftBlock:
        """The block of the requests in ``rows`` ([b] indices, in that order)."""
        index = torch.as_tensor(rows, dtype=torch.long)
        pick = lambda t: None if t is None else t[index.to(t.device)]  # noqa: E731
        sources = None if self.sources is None else tuple(self.sources[int(i)] for i in index)
        return DraftBlock(
            pick(self.tokens), pick(self.num_tokens), pick(self.draft_probs), pick(self.confidences), sources
        )

    def scattered(self, rows: Sequence[int], total: int) -> DraftBlock:
        """This block of ``len(rows)`` requests placed at ``rows`` of a block of ``total``; the others draft nothing.

        Rows not in ``rows`` get no drafts (``num_tokens`` 0; source ``"none"`` where the
        proposer names sources): how a step holds requests that do not speculate beside ones that do.
        """
        index = torch.as_tensor(list(rows), dtype=torch.long)

        def place(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            full = t.new_zeros((total, *t.shape[1:]))
            full[index.to(t.device)] = t
            return full

        sources = None
        if self.sources is not None:  # a proposer that names its sources: the other rows' is "none"
            sources = ["none"] * total
            for i, row in enumerate(index.tolist()):
                sources[row] = self.sources[i]
        return DraftBlock(
            place(self.tokens),
            place(self.num_tokens),
            place(self.draft_probs),
            place(self.confidences),
            None if sources is None else tuple(sources),
        )

    def truncated(self, lengths: torch.Tensor) -> DraftBlock:
        """The block cut to ``min(num_tokens, lengths)`` drafts per request: the slots the target will verify.

        lengths: [B] int64, e.g. a scheduler's decision. The tensors are cut to the longest
        kept row, so a verify forward and its random draws cover only those slots.
        """
        num_tokens = torch.minimum(self.num_tokens, lengths.to(self.num_tokens))  # [B]
        width = int(num_tokens.max()) if num_tokens.numel() else 0
        return DraftBlock(
            tokens=self.tokens[:, :width],
            num_tokens=num_tokens,
            draft_probs=None if self.draft_probs is None else self.draft_probs[:, :width],
            confidences=None if self.confidences is None else self.confidences[:, :width],
            sources=self.sources,
        )


@dataclass
class VerifyResult:
    """Outcome of verifying one block per request."""

    num_accepted: torch.Tensor  # [B] int64, leading draft tokens that survived
    next_tokens: torch.Tensor  # [B] int64, the recovered token (after a rejection) or the bonus token


@dataclass
class RoundRecord:
    """What one speculative round of one request did, as the engine reports it.

    ``tokens`` are what the round committed: the accepted drafts, then the recovered or
    bonus token (``accepted + 1`` tokens), or fewer when EOS, a stop string or the length
    limit ended the generation inside the round. ``accepted`` is verification's count
    either way, so every round's outcome is known, the last one included.
    """

    drafted: int  # draft tokens the proposer offered
    verified: int  # drafts sent to the target: the scheduler's choice, cut to the room left
    accepted: int  # leading verified drafts that survived
    # Raw conditional confidences the scheduler saw (entries at or beyond ``drafted`` are
    # padding); None when the proposer has no confidence head.
    confidences: torch.Tensor | None  # [gamma] float32, on the CPU
    tokens: list[int]  # committed this round, in order
    source: str | None = None  # where the drafts came from, when the proposer chooses per round ("none": skipped)


# SpecStats fields that several generations pool by summing (see SpecStats.merge).
_SUMMED_STATS = (
    "rounds",
    "new_tokens",
    "accepted",
    "drafted",
    "verified",
    "prefill_s",
    "draft_s",
    "verify_s",
    "total_s",
)


@dataclass
class SpecStats:
    """Statistics of one generation. ``tau`` counts accepted + 1 per round."""

    rounds: int = 0
    new_tokens: int = 0
    accepted: int = 0  # accepted draft tokens over all rounds
    drafted: int = 0  # draft tokens proposed over all rounds
    verified: int = 0  # draft tokens sent to the target (after scheduling)
    # accepted_by_position[k] / verified_by_position[k]: acceptance of draft position k+1
    # counted over the rounds in which that position was verified.
    accepted_by_position: list[int] = field(default_factory=list)
    verified_by_position: list[int] = field(default_factory=list)
    verified_lengths: list[int] = field(default_factory=list)  # per round
    rounds_by_source: dict[str, int] = field(default_factory=dict)  # a choosing proposer's sources ("none": skipped)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @classmethod
    def merge(cls, stats: Iterable[SpecStats]) -> SpecStats:
        """Pooled statistics of several generations: the one definition of pooled tau and acceptance.

        Counts and times are summed, per-position counts position by position, and the
        per-round lengths are concatenated. So the result's ``tau`` is tau over every
        round of all the generations (not the mean of their taus), and its
        ``acceptance_by_position`` pools, for each position, the rounds that verified it.
        """
        merged = cls()
        for s in stats:
            for name in _SUMMED_STATS:
                setattr(merged, name, getattr(merged, name) + getattr(s, name))
            _add_counts(merged.accepted_by_position, s.accepted_by_position)
            _add_counts(merged.verified_by_position, s.verified_by_position)
            merged.verified_lengths.extend(s.verified_lengths)
            for source, count in s.rounds_by_source.items():
                merged.rounds_by_source[source] = merged.rounds_by_source.get(source, 0) + count
        return merged

    @property
    def tau(self) -> float:
        """Mean tokens committed per round (accepted drafts + the recovered/bonus token); 0 without rounds."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Per draft position: accepted / verified over the rounds that verified it (NaN if none did)."""
        return [a / v if v else float("nan") for a, v in zip(self.accepted_by_position, self.verified_by_position)]

    @property
    def other_s(self) -> float:
        """Time spent outside the two models' forwards (the engine's own overhead)."""
        return max(self.total_s - self.prefill_s - self.draft_s - self.verify_s, 0.0)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def mean_verified_length(self) -> float:
        return sum(self.verified_lengths) / len(self.verified_lengths) if self.verified_lengths else 0.0

    def record_round(self, drafted: int, verified: int, accepted: int) -> None:
        """Count one round: ``drafted`` proposed, the first ``verified`` checked, the first ``accepted`` kept."""
        self.rounds += 1
        self.drafted += drafted
        self.verified += verified
        self.accepted += accepted
        self.verified_lengths.append(verified)
        _add_counts(self.verified_by_position, [1] * verified)
        _add_counts(self.accepted_by_position, [1] * accepted + [0] * (verified - accepted))  # same length

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "new_tokens": self.new_tokens,
            "tau": self.tau,
            "accepted": self.accepted,
            "drafted": self.drafted,
            "verified": self.verified,
            "mean_verified_length": self.mean_verified_length,
            "acceptance_by_position": self.acceptance_by_position,
            "verified_by_position": list(self.verified_by_position),
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "other_s": self.other_s,
            "total_s": self.total_s,
            "tokens_per_s": self.tokens_per_s,
        }


def _add_counts(total: list[int], counts: Sequence[int]) -> None:
    """``total[k] += counts[k]`` for every k, growing ``total`` with zeros as needed."""
    total.extend([0] * (len(counts) - len(total)))
    for k, count in enumerate(counts):
        total[k] += count


@dataclass
class GenerationResult:
    """What ``SpecEngine.generate`` returns (and ``BatchEngine`` for each request)."""

    text: str
    token_ids: list[int]  # generated tokens (EOS included when generation ended on it)
    stats: SpecStats
    # "eos", "stop", "length" (max_new_tokens) or "context" (the model's context window ended it first);
    # a BatchEngine request may also end in "abort" or "error"
    finish_reason: str
    error: BaseException | None = None  # what ended a request with finish_reason "error"
    prompt_tokens: int = 0  # tokens of the prompt the target prefilled (vision tokens included)
    cached_tokens: int = 0  # of them, tokens found in the prefix cache (not computed again)
