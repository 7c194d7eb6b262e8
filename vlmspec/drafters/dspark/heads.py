"""Sequential heads: the small left-to-right stage after the parallel backbone.

The backbone gives base logits ``U_k`` for every block position in one pass. A head adds
a bias that depends on the tokens drawn before position k,
``p_k(v) = softmax(U_k(v) + B_k(x_0, x_<k, v))``, so each p_k is an ordinary softmax
and its exact probabilities are available for lossless rejection sampling.

Every head has the same two entry points:

* ``teacher_forced(hidden, base_logits, prev_tokens)`` for training, with
  ``prev_tokens = [anchor, ground_truth[:-1]]``;
* ``sample(hidden, base_logits, anchor, token_ids, temperature, generator)`` for
  drafting: draws x_1..x_gamma left to right and returns the float32 corrected logits and
  the distributions the tokens were drawn from.

Logits live in the *draft vocabulary*: column j is target token ``token_ids[j]`` (all of
the target's ids, or a reduced set of the most frequent ones). Previous tokens are
always target ids, so W1 embeds the whole target vocabulary and only W2 is reduced.

Kinds: :class:`NoHead` (DFlash, parallel only), :class:`VanillaMarkovHead`
(``B = W2(W1[prev])``), :class:`GatedMarkovHead` (``B = W2(sigmoid(W_g[h; W1[prev]]) * W1[prev])``)
and :class:`RNNHead` (a GRU-style state across the block). The sampling loop costs one
r x V GEMM per step; the full-vocabulary LM head is applied once, before the head, by the
caller.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
from torch import nn

from vlmspec.drafters.dspark.config import DSparkConfig
from vlmspec.sampling import sample_from_uniforms


@dataclass
class HeadSample:
    """What a head's sampling loop returns."""

    tokens: torch.Tensor  # [B, G] int64 target ids
    logits: torch.Tensor  # [B, G, N] float32 corrected logits over the draft vocabulary (before temperature)
    probs: torch.Tensor | None  # [B, G, N] float32 distributions drawn from; None when greedy (one-hot)


def draw(
    logits: torch.Tensor,  # [B, V] float32
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # tokens [B] int64, probs [B, V] float32 or None
    """Draw one token per row from ``softmax(logits / temperature)``; argmax at temperature 0.

    One float64 uniform per row comes from ``generator`` (on the generator's own device)
    and is inverted through the float64 CDF of the returned float32 ``probs``
    (:func:`vlmspec.sampling.sample_from_uniforms`), so the token follows exactly those
    probabilities; a float32 CDF over 150k tokens would be off by ~1e-3 in total variation.
    """
    if temperature == 0:
        return logits.argmax(dim=-1), None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    device = generator.device if generator is not None else probs.device
    uniforms = torch.rand(probs.shape[0], generator=generator, device=device, dtype=torch.float64)  # [B]
    return sample_from_uniforms(probs, uniforms.to(probs.device)), probs


class SequentialHead(nn.Module, abc.ABC):
    """Interface of all heads (see the module docstring)."""

    #: Width of the head's token embedding W1 (0 when the head has none).
    token_dim: int = 0

    def token_features(self, tokens: torch.Tensor) -> torch.Tensor | None:  # [...] -> [..., r] or None
        """The head's embedding of ``tokens`` (the Markov feature the confidence head may use)."""
        return None

    @abc.abstractmethod
    def teacher_forced(
        self,
        hidden: torch.Tensor,  # [B, G, d] backbone states
        base_logits: torch.Tensor,  # [B, G, N] float32 over the draft vocabulary
        prev_tokens: torch.Tensor,  # [B, G] int64 target ids: [anchor, x_1 .. x_{G-1}]
    ) -> torch.Tensor:  # [B, G, N] float32 corrected logits
        """Corrected logits when the previous tokens are known (training)."""

    @abc.abstractmethod
    def sample(
        self,
        hidden: torch.Tensor,  # [B, G, d]
        base_logits: torch.Tensor,  # [B, G, N] float32 over the draft vocabulary
        anchor: torch.Tensor,  # [B] int64 last committed token
        token_ids: torch.Tensor,  # [N] int64 target id of each draft-vocabulary column
        temperature: float,
        generator: torch.Generator | None,
    ) -> HeadSample:
        """Draw the block left to right, each position given the token drawn before it."""


class NoHead(SequentialHead):
    """DFlash: no sequential bias; every position is drawn from its base logits at once."""

    def teacher_forced(self, hidden, base_logits, prev_tokens):
        return base_logits

    def sample(self, hidden, base_logits, anchor, token_ids, temperature, generator):
        if temperature == 0:  # no dependency between positions: one argmax for the block
            return HeadSample(token_ids[base_logits.argmax(dim=-1)], base_logits, None)
        # Position by position: temporaries stay [B, N].
        batch, gamma, _ = base_logits.shape
        tokens = anchor.new_empty(batch, gamma)
        probs = torch.empty_like(base_logits)
        for k in range(gamma):
            tokens[:, k], probs[:, k] = draw(base_logits[:, k], temperature, generator)
        return HeadSample(token_ids[tokens], base_logits, probs)


class LowRankHead(SequentialHead):
    """A head whose bias is ``B_k = W2(z_k)`` for an r-wide code ``z_k`` of the prefix; W1 embeds tokens.

    Subclasses define :meth:`code` (one position, given the previous token's embedding
    and a recurrent state). The codes are r-wide and cheap; the r x V GEMM ``W2`` is the
    costly part: the sampling loop applies it once per step, the teacher-forced form
    once for the whole block.
    """

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.token_dim = config.head_rank
        self.embed = nn.Embedding(config.target_vocab_size, config.head_rank)  # W1, over target ids
        self.out = nn.Linear(config.head_rank, config.num_draft_tokens, bias=False)  # W2, over the draft vocabulary

    def token_features(self, tokens):
        return self.embed(tokens)

    def initial_state(self, hidden: torch.Tensor) -> torch.Tensor | None:  # hidden [B, G, d]
        return None

    @abc.abstractmethod
    def code(
        self,
        state: torch.Tensor | None,  # [B, r] or None
        hidden: torch.Tensor,  # [B, d] backbone state at this position
        prev: torch.Tensor,  # [B, r] W1 of the previous token
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # code z_k [B, r], next state
        """The bias code of one position and the state carried to the next."""

    def teacher_forced(self, hidden, base_logits, prev_tokens):
        prev = self.embed(prev_tokens)  # [B, G, r]
        state = self.initial_state(hidden)
        codes = []
        for k in range(hidden.shape[1]):
            z, state = self.code(state, hidden[:, k], prev[:, k])
            codes.append(z)
        return base_logits + self.out(torch.stack(codes, dim=1)).float()

    def sample(self, hidden, base_logits, anchor, token_ids, temperature, generator):
        batch, gamma, _ = base_logits.shape
        tokens = anchor.new_empty(batch, gamma)
        logits = torch.empty_like(base_logits)  # filled in place: no per-step [B, N] allocations
        probs = None if temperature == 0 else torch.empty_like(base_logits)
        token, state = anchor, self.initial_state(hidden)
        for k in range(gamma):
            z, state = self.code(state, hidden[:, k], self.embed(token))
            torch.add(base_logits[:, k], self.out(z).float(), out=logits[:, k])
            column, step_probs = draw(logits[:, k], temperature, generator)
            token = token_ids[column]  # the next position's W1 reads a target id
            tokens[:, k] = token
            if probs is not None:
                probs[:, k] = step_probs
        return HeadSample(tokens, logits, probs)


class VanillaMarkovHead(LowRankHead):
    """First-order low-rank bigram bias: ``B_k = W2(W1[x_{k-1}])``."""

    def code(self, state, hidden, prev):
        return prev, None


class GatedMarkovHead(LowRankHead):
    """Bigram bias gated by the backbone: ``B_k = W2(sigmoid(W_g[h_k; W1[x_{k-1}]]) * W1[x_{k-1}])``."""

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__(config)
        self.gate = nn.Linear(config.hidden_size + config.head_rank, config.head_rank)

    def code(self, state, hidden, prev):
        return torch.sigmoid(self.gate(torch.cat((hidden, prev), dim=-1))) * prev, None


class RNNHead(LowRankHead):
    """GRU-style recurrent bias across the block.

    ``g, c, o = chunk(W_joint [s_{k-1}; W1[x_{k-1}]; h_k], 3)``;
    ``s_k = sigmoid(g) * s_{k-1} + (1 - sigmoid(g)) * tanh(c)``; ``B_k = W2(tanh(o))``.
    The state starts at zero for every block.
    """

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__(config)
        self.joint = nn.Linear(2 * config.head_rank + config.hidden_size, 3 * config.head_rank)

    def initial_state(self, hidden):
        return hidden.new_zeros(hidden.shape[0], self.token_dim)

    def code(self, state, hidden, prev):
        gate, candidate, output = self.joint(torch.cat((state, prev, hidden), dim=-1)).chunk(3, dim=-1)
        keep = torch.sigmoid(gate)
        return torch.tanh(output), keep * state + (1 - keep) * torch.tanh(candidate)


HEADS: dict[str, type[SequentialHead]] = {
    "none": NoHead,
    "vanilla": VanillaMarkovHead,
    "gated": GatedMarkovHead,
    "rnn": RNNHead,
}


def build_head(config: DSparkConfig) -> SequentialHead:
    """The sequential head named by ``config.head_kind``."""
    head_class = HEADS[config.head_kind]
    return head_class() if head_class is NoHead else head_class(config)


__all__ = [
    "GatedMarkovHead",
    "HEADS",
    "HeadSample",
    "LowRankHead",
    "NoHead",
    "RNNHead",
    "SequentialHead",
    "VanillaMarkovHead",
    "build_head",
    "draw",
]
