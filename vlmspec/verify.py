"""Verification of draft blocks: greedy matching and lossless rejection sampling.

Pure tensor functions, batched over B requests. Request r drafted ``num_tokens[r]``
tokens x_0 .. x_{n-1} (its row is padded to gamma; padding is never looked at). The
target scored them in one forward pass: ``target_*[r, k]`` is the target's prediction for
draft slot k given everything before it, and slot ``num_tokens[r]`` (at most gamma) is
the bonus slot that follows a fully accepted block.

Vocabulary (the convention the field reports, see ``vlmspec.types``):

* **accepted** - a leading draft token that survived verification. Greedy: it equals the
  target's argmax. Sampled: it passed the test ``u < target_probs(x) / draft_probs(x)``.
* **recovered** - at the first rejection (slot k), the target's replacement. Greedy: the
  argmax at k. Sampled: a draw from the residual ``norm(max(target_probs - draft_probs, 0))``
  at k, which is what makes the output distribution exactly the target's.
* **bonus** - after a fully accepted block, one more token drawn from the target at slot
  ``num_tokens[r]`` (argmax when greedy). A row with ``num_tokens == 0`` gets only this.
* **tau** - tokens committed per round = accepted + 1 (the recovered or the bonus token).

``VerifyResult.num_accepted[r]`` counts the accepted tokens; ``next_tokens[r]`` is the
recovered token when ``num_accepted[r] < num_tokens[r]`` and the bonus token otherwise.

Randomness: row r draws ``num_tokens[r] + 1`` uniforms from ``generators[r]`` in one call
per round, the same count whatever happens (one acceptance test per draft, then one for
the next token). A row's draws depend only on its own seed and block, never on the width
of the batch it is verified in, so a request samples the same tokens alone or among
others. :func:`verify_rows` verifies rows whose sampling parameters differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vlmspec import sampling
from vlmspec.types import DraftBlock, SamplingParams, VerifyResult

__all__ = [
    "verify",
    "verify_greedy",
    "verify_rejection",
    "verify_rows",
    "rejection_from_uniforms",
    "reference_rejection_from_uniforms",
    "native_rejection_from_uniforms",
]


def verify(
    block: DraftBlock,
    target_logits: torch.Tensor,  # [B, gamma + 1, V] any float dtype
    params: SamplingParams,
    generators: Sequence[torch.Generator] | None = None,
) -> VerifyResult:
    """Verify ``block`` against the target's logits under the target's own sampling ``params``.

    Greedy params need no generators (any given are left untouched); sampling params need
    one ``torch.Generator`` per request. ``params.logit_bias`` applies to both: greedy
    matches the argmax of the biased logits.
    """
    if params.greedy:
        return verify_greedy(block, sampling.biased_logits(target_logits, params))
    if generators is None:
        raise ValueError("sampling (temperature > 0) needs generators: one torch.Generator per request")
    return verify_rejection(block, sampling.target_probs(target_logits, params), generators)


def verify_rows(
    block: DraftBlock,
    target_logits: torch.Tensor,  # [B, gamma + 1, V] any float dtype
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> VerifyResult:
    """:func:`verify` for a batch whose rows have their own sampling params (``params[r]`` for row r).

    Rows that share params are verified together. Since every row draws only its own
    uniforms, the grouping changes no result: row r gets what ``verify`` gives it alone.
    """
    if len(params) != block.tokens.shape[0]:
        raise ValueError(f"need one SamplingParams per row ({block.tokens.shape[0]}), got {len(params)}")
    if len(set(params)) == 1:
        return verify(block, target_logits, params[0], generators)
    device = block.tokens.device
    num_accepted = torch.zeros(len(params), dtype=torch.long, device=device)  # [B]
    next_tokens = torch.zeros(len(params), dtype=torch.long, device=device)  # [B]
    for group in dict.fromkeys(params):
        rows = [r for r, p in enumerate(params) if p == group]
        index = torch.tensor(rows, device=device)
        result = verify(
            block.select(index), target_logits[index.to(target_logits.device)], group, [generators[r] for r in rows]
        )
        num_accepted[index] = result.num_accepted.to(device)
        next_tokens[index] = result.next_tokens.to(device)
    return VerifyResult(num_accepted=num_accepted, next_tokens=next_tokens)


def verify_greedy(
    block: DraftBlock,
    target_logits: torch.Tensor,  # [B, gamma + 1, V] any float dtype
) -> VerifyResult:
    """Accept while the draft token equals the target's argmax; then emit the target's argmax.

    The next token is the argmax at the first mismatch (recovered) or at slot
    ``num_tokens[r]`` (bonus). Ties in the argmax go to the lowest index, as ``torch.argmax``.
    """
    tokens, num_tokens = _check_block(block, target_logits, "target_logits")
    # The walk in Python ints: a few ids a request, where each tensor op costs a dispatch every round.
    accepted, following = [], []
    for drafts, real, best in zip(tokens.tolist(), num_tokens.tolist(), sampling.greedy_ids(target_logits).tolist()):
        count = 0
        while count < real and drafts[count] == best[count]:
            count += 1
        accepted.append(count)
        following.append(best[count])
    device = target_logits.device
    return VerifyResult(
        num_accepted=torch.tensor(accepted, dtype=torch.long, device=device),  # [B]
        next_tokens=torch.tensor(following, dtype=torch.long, device=device),  # [B]
    )


def verify_rejection(
    block: DraftBlock,
    target_probs: torch.Tensor,  # [B, gamma + 1, V] float32, from vlmspec.sampling.target_probs
    generators: Sequence[torch.Generator],
) -> VerifyResult:
    """Lossless rejection sampling: the committed tokens follow ``target_probs`` exactly.

    Left to right, draft x_k is accepted with probability
    ``min(1, target_probs[k, x_k] / draft_probs[k, x_k])``. At the first rejection the
    recovered token is drawn from the residual at that slot; after a fully accepted block
    the bonus is drawn from ``target_probs`` at slot ``num_tokens[r]``. A block without
    ``draft_probs`` came from a deterministic drafter: its distribution is the one-hot of
    its token, so x_k survives with probability ``target_probs[k, x_k]`` and the residual
    is the target with x_k removed.
    """
    tokens, num_tokens = _check_block(block, target_probs, "target_probs")
    _check_probs(block, target_probs, generators)
    uniforms = _round_uniforms(generators, num_tokens, block.gamma, target_probs.device)  # [B, gamma + 1] float64
    return rejection_from_uniforms(block, target_probs, uniforms)


def rejection_from_uniforms(
    block: DraftBlock,
    target_probs: torch.Tensor,  # [B, gamma + 1, V] float32
    uniforms: torch.Tensor,  # [B, gamma + 1] float64: slot k < num_tokens[r] tests draft k, slot gamma the next token
) -> VerifyResult:
    """:func:`verify_rejection`'s accept tests and next-token draws for given uniforms (no generators).

    The native kernel where it applies (CPU tensors, the kernel built), else the PyTorch
    reference; both return the same tokens bit for bit.
    """
    if sampling.native_sampling_applies(target_probs):
        return native_rejection_from_uniforms(block, target_probs, uniforms)
    return reference_rejection_from_uniforms(block, target_probs, uniforms)


def native_rejection_from_uniforms(
    block: DraftBlock,
    target_probs: torch.Tensor,  # [B, gamma + 1, V] float32, on the CPU
    uniforms: torch.Tensor,  # [B, gamma + 1] float64
) -> VerifyResult:
    """:func:`rejection_from_uniforms` in one native call for all rows (``cpu_rejection.cpp``)."""
    num_accepted, next_tokens = torch.ops.vlmspec.rejection_sample(
        target_probs, block.draft_probs, block.tokens.long(), block.num_tokens.long(), uniforms.to(torch.float64)
    )
    return VerifyResult(num_accepted=num_accepted, next_tokens=next_tokens)


def reference_rejection_from_uniforms(
    block: DraftBlock,
    target_probs: torch.Tensor,  # [B, gamma + 1, V] float32
    uniforms: torch.Tensor,  # [B, gamma + 1] float64
) -> VerifyResult:
    """:func:`rejection_from_uniforms` in PyTorch tensor ops: the reference."""
    tokens, num_tokens = block.tokens.long(), block.num_tokens.long()
    batch, gamma = tokens.shape
    real = _real_slots(num_tokens, gamma)  # [B, gamma]
    safe_tokens = torch.where(real, tokens, 0)  # [B, gamma], padding may hold any id

    target_at_draft = _probs_of(target_probs[:, :gamma], safe_tokens)  # [B, gamma]
    if block.draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)  # one-hot drafts put all mass on x_k
    else:
        draft_at_draft = _probs_of(block.draft_probs, safe_tokens)  # [B, gamma]
    # u < t / d, written without a division: t >= d always passes, t == 0 never does.
    passed = uniforms[:, :gamma] * draft_at_draft < target_at_draft  # [B, gamma]
    num_accepted = _count_leading_true(passed & real)  # [B]

    rows = torch.arange(batch, device=target_probs.device)  # [B]
    target_at_next = target_probs[rows, num_accepted]  # [B, V]
    next_probs = _next_token_probs(block, safe_tokens, target_at_next, num_accepted, num_tokens)  # [B, V]
    next_tokens = sampling.reference_sample_from_uniforms(next_probs, uniforms[:, gamma])  # [B]
    return VerifyResult(num_accepted=num_accepted, next_tokens=next_tokens)


def _round_uniforms(
    generators: Sequence[torch.Generator],
    num_tokens: torch.Tensor,  # [B] int64
    gamma: int,
    device: torch.device,
) -> torch.Tensor:  # [B, gamma + 1] float64
    """Row r's ``num_tokens[r] + 1`` uniforms, one call on its generator: the acceptance tests in
    slots ``0 .. num_tokens[r] - 1``, the next token's in slot ``gamma`` (the rest are unused)."""
    counts = num_tokens.tolist()  # [B]
    flat = sampling.draw_row_uniforms(generators, [n + 1 for n in counts], device)  # [sum (n_r + 1)]
    if all(n == gamma for n in counts):  # every row verifies gamma drafts (the target alone: gamma 0): no gaps
        return flat.reshape(len(counts), gamma + 1)
    sizes = num_tokens.to(device) + 1  # [B]
    uniforms = torch.zeros(sizes.shape[0], gamma + 1, dtype=torch.float64, device=device)
    rows = torch.repeat_interleave(torch.arange(sizes.shape[0], device=device), sizes)
    within = torch.arange(flat.shape[0], device=device) - (torch.cumsum(sizes, 0) - sizes)[rows]
    columns = torch.where(within == num_tokens.to(device)[rows], gamma, within)  # each row's last draw -> slot gamma
    uniforms[rows, columns] = flat
    return uniforms


def _next_token_probs(
    block: DraftBlock,
    safe_tokens: torch.Tensor,  # [B, gamma] int64, padding replaced by 0
    target_at_next: torch.Tensor,  # [B, V] float32, target_probs at slot num_accepted
    num_accepted: torch.Tensor,  # [B] int64
    num_tokens: torch.Tensor,  # [B] int64
) -> torch.Tensor:  # [B, V] float32
    """The target itself for a bonus, the residual at the rejected slot for a recovery.

    The residual is left unnormalised (the draw normalises by its float64 total), so that the
    native kernel, which never materialises it, draws the same token bit for bit.
    """
    gamma = block.gamma
    if gamma == 0:
        return target_at_next  # nothing was drafted: every row takes the bonus
    rows = torch.arange(safe_tokens.shape[0], device=safe_tokens.device)  # [B]
    slot = num_accepted.clamp(max=gamma - 1)  # [B]; bonus rows read a dummy slot, discarded below
    if block.draft_probs is None:
        rejected = safe_tokens[rows, slot].unsqueeze(1)  # [B, 1]
        draft_at_next = torch.zeros_like(target_at_next).scatter_(1, rejected, 1.0)  # [B, V] one-hot
    else:
        draft_at_next = block.draft_probs[rows, slot]  # [B, V]
    is_bonus = (num_accepted == num_tokens).unsqueeze(1)  # [B, 1]
    return torch.where(is_bonus, target_at_next, sampling.positive_residual(target_at_next, draft_at_next))


def _probs_of(
    probs: torch.Tensor,  # [B, gamma, V]
    tokens: torch.Tensor,  # [B, gamma] int64
) -> torch.Tensor:  # [B, gamma]
    """The probability each slot's distribution gives its own token, in one gather."""
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _real_slots(num_tokens: torch.Tensor, gamma: int) -> torch.Tensor:  # num_tokens [B] -> [B, gamma] bool
    """True where a slot holds a real draft token, False on padding."""
    return torch.arange(gamma, device=num_tokens.device) < num_tokens.unsqueeze(1)


def _count_leading_true(mask: torch.Tensor) -> torch.Tensor:  # mask [B, gamma] bool -> [B] int64
    """Length of the all-True prefix of each row: the first False truncates the rest."""
    return mask.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _check_block(
    block: DraftBlock,
    target: torch.Tensor,  # [B, gamma + 1, V]
    target_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [B, gamma] int64, num_tokens [B] int64
    """Validate shapes and ranges of a block against the target tensor (reads the block on the host)."""
    tokens, num_tokens = block.tokens, block.num_tokens
    if tokens.dim() != 2 or tokens.dtype.is_floating_point:
        raise ValueError(f"block.tokens must be an integer tensor [B, gamma], got {tuple(tokens.shape)} {tokens.dtype}")
    batch, gamma = tokens.shape
    if num_tokens.shape != (batch,) or num_tokens.dtype.is_floating_point:
        raise ValueError(f"block.num_tokens must be an integer tensor [B] = [{batch}], got {tuple(num_tokens.shape)}")
    if target.dim() != 3 or target.shape[:2] != (batch, gamma + 1) or not target.is_floating_point():
        raise ValueError(
            f"{target_name} must be a float tensor [B, gamma + 1, V] = [{batch}, {gamma + 1}, V] "
            f"(one slot per draft token plus the bonus slot), got {tuple(target.shape)} {target.dtype}"
        )
    tokens, num_tokens = tokens.long(), num_tokens.long()
    vocab = target.shape[2]
    # As Python ints: a round's block is a few ids a request, where each tensor comparison costs a dispatch.
    counts, rows = num_tokens.tolist(), tokens.tolist()
    out_of_range = any(not 0 <= n <= gamma for n in counts) or any(
        not 0 <= token < vocab for row, n in zip(rows, counts) for token in row[:n]
    )
    if out_of_range:
        raise ValueError(
            f"block has num_tokens outside [0, gamma={gamma}] or real draft tokens outside the target's "
            f"vocabulary [0, {vocab}); clamp num_tokens and map draft ids into the target's vocabulary"
        )
    return tokens, num_tokens


def _check_probs(
    block: DraftBlock,
    target_probs: torch.Tensor,  # [B, gamma + 1, V]
    generators: Sequence[torch.Generator],
) -> None:
    if target_probs.dtype != torch.float32:
        raise ValueError(
            f"target_probs must be float32, got {target_probs.dtype}; build them with vlmspec.sampling.target_probs"
        )
    draft_probs = block.draft_probs
    if draft_probs is not None:
        expected = (*block.tokens.shape, target_probs.shape[2])
        if tuple(draft_probs.shape) != expected:
            raise ValueError(
                f"block.draft_probs must have shape [B, gamma, V] = {list(expected)} (V of the target; pad a "
                f"smaller draft vocabulary with zeros), got {list(draft_probs.shape)}"
            )
        if draft_probs.dtype != torch.float32:
            raise ValueError(
                f"block.draft_probs must be float32, the distribution the drafts were sampled from, got "
                f"{draft_probs.dtype}; sample the drafts from float32 probabilities and pass those"
            )
    if isinstance(generators, torch.Generator) or len(generators) != block.tokens.shape[0]:
        raise ValueError(
            f"need one torch.Generator per request ({block.tokens.shape[0]}), got "
            f"{'a single generator' if isinstance(generators, torch.Generator) else len(generators)}"
        )
