"""Logits -> probabilities exactly as target-only sampling applies them, and seeded draws.

``target_probs`` reproduces the warper chain of Hugging Face ``generate``, with OpenAI's
``logit_bias`` in front::

    float32 logits + logit_bias -> [greedy: argmax] -> / temperature -> top-k -> top-p -> min-p -> softmax

so that speculative decoding and the target alone sample from the same distribution. The
bias comes first, before greedy too, so greedy verification, sampled verification and the
target alone all see the biased logits. A temperature below
:data:`vlmspec.types.GREEDY_BELOW_TEMPERATURE` is greedy (as in vLLM), so no finite
temperature can overflow the division. min-p sits where transformers puts its
``MinPLogitsWarper`` (after top-p); vLLM applies it before top-k/top-p, which differs only
when top-p and min-p are both set. min-p keeps a token when its probability is at least
``min_p`` times the largest (llama.cpp's and vLLM's rule, after temperature); that ratio does
not depend on which other tokens survived, so min-p commutes with top-k.

Three tie rules are fixed on purpose:

* top-k keeps every token whose logit equals the k-th largest (as transformers'
  ``TopKLogitsWarper`` does), so more than k tokens survive when the boundary is tied.
  Ties are common with bf16 logits, and keeping them is what makes the support match.
* top-p keeps the smallest set of most-probable tokens whose cumulative probability
  reaches ``top_p``; among tied tokens the lower index is kept first (deterministic,
  like ``torch.argmax``). The arithmetic (ascending cumulative sum compared with
  ``1 - top_p``) is the same as transformers'. After top-k only the surviving tokens are
  sorted (a few dozen instead of the whole vocabulary); their softmax may then differ from
  transformers' in the last bit, which could move the nucleus boundary only when the tail
  mass lies within float32 rounding of ``1 - top_p``.
* min-p keeps every token tied with the threshold (``probs >= min_p * max``, as transformers).

Every random draw takes an explicit ``torch.Generator``, one per batch row; nothing here
touches the global RNG. Draws use the inverse CDF in float64, which never returns a token
of zero probability (see :func:`sample_from_uniforms`).

Two implementations, one law. The PyTorch code here is the reference
(:func:`reference_target_probs`, :func:`reference_sample_from_uniforms`). On the CPU, where
vlmspec's kernel builds (:func:`native_sampling_applies`), :func:`target_probs` and
:func:`sample_from_uniforms` run ``vlmspec/kernels/cpu_sampling.cpp`` instead: one call for
all rows, three passes over the vocabulary and no full sort (top-p sorts only the tokens
above a threshold that provably holds the nucleus). The draws take the same uniforms from
the same generators. Given the same probabilities, the native draw returns the reference's
token bit for bit (the same float64 running sum in index order). The native probabilities
match the reference's to float32 rounding (their exp and sums differ in the last bits), with
the same support except where a token's top-p tail mass or min-p ratio lies within that
rounding of its threshold; so a token can differ only when a uniform falls within about
1e-6 of a CDF boundary (tests/test_native_sampling.py checks both, and runs the statistical
tests through both).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vlmspec.kernels import cpu_kernels
from vlmspec.types import SamplingParams

__all__ = [
    "target_probs",
    "reference_target_probs",
    "native_target_probs",
    "native_sampling_applies",
    "greedy_ids",
    "greedy_one_hot",
    "mask_top_k",
    "mask_top_p",
    "mask_min_p",
    "biased_logits",
    "residual_probs",
    "positive_residual",
    "draw_uniforms",
    "draw_row_uniforms",
    "sample_from_uniforms",
    "reference_sample_from_uniforms",
    "native_sample_from_uniforms",
    "sample",
]


def target_probs(
    logits: torch.Tensor,  # [..., V] any float dtype
    params: SamplingParams,
) -> torch.Tensor:  # [..., V] float32
    """The float32 distribution the target alone samples from under ``params``.

    ``logit_bias`` is added first. Greedy (see :attr:`SamplingParams.greedy`) then gives the
    one-hot of the argmax (ties -> lowest index). Otherwise: divided by the temperature,
    then top-k, then top-p, then min-p, then softmax; the order of transformers' ``generate``.
    Runs the native kernel where it applies (:func:`native_sampling_applies`), else the reference.
    """
    if native_sampling_applies(logits):
        return native_target_probs(logits, params)
    return reference_target_probs(logits, params)


def native_sampling_applies(tensor: torch.Tensor) -> bool:
    """Whether the native sampler serves this tensor: a CPU tensor, and vlmspec's CPU kernel built here."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and cpu_kernels.kernel_available()


def reference_target_probs(
    logits: torch.Tensor,  # [..., V] any float dtype
    params: SamplingParams,
) -> torch.Tensor:  # [..., V] float32
    """:func:`target_probs` in PyTorch: the reference (and the path where the kernel is unavailable)."""
    _check_logits(logits)
    scores = biased_logits(logits, params)  # the caller's logits are never modified
    if params.greedy:
        return greedy_one_hot(scores)
    scores = scores.float() / _float32_temperature(params)
    if params.top_k is not None:
        scores = mask_top_k(scores, params.top_k)
    if params.top_p is not None and params.top_p < 1.0:
        # after top-k only a few scores are finite: sort those, not all of V
        num_candidates = _most_finite_per_row(scores) if params.top_k is not None else None
        scores = mask_top_p(scores, params.top_p, num_candidates)
    if params.min_p:
        scores = mask_min_p(scores, params.min_p)
    return torch.softmax(scores, dim=-1)


def native_target_probs(
    logits: torch.Tensor,  # [..., V] any float dtype, on the CPU
    params: SamplingParams,
) -> torch.Tensor:  # [..., V] float32
    """:func:`target_probs` through the native kernel (``cpu_sampling.cpp``), every row in one call.

    Raises RuntimeError where the kernel is unavailable (see :func:`native_sampling_applies`).
    """
    _check_logits(logits)
    if not native_sampling_applies(logits):
        raise RuntimeError(
            "the native sampler needs CPU logits and vlmspec's CPU kernel (a C++ compiler; VLMSPEC_CPU_KERNEL "
            "not 0); use vlmspec.sampling.target_probs, which falls back to the PyTorch reference"
        )
    if params.greedy:
        return greedy_one_hot(biased_logits(logits, params))
    if params.logit_bias:
        params.check_vocabulary(logits.shape[-1])
    if logits.dtype not in (torch.float32, torch.bfloat16):
        logits = logits.float()  # exact for float16; float64 is rounded as the reference's .float() rounds it
    rows = logits.reshape(-1, logits.shape[-1])  # [N, V]
    ids, values = _bias_tensors(params)
    probs = torch.ops.vlmspec.sampling_warp(
        rows,
        _float32_temperature(params),
        params.top_k or 0,
        1.0 if params.top_p is None else float(params.top_p),
        float(params.min_p or 0.0),
        ids,
        values,
    )
    return probs.reshape(logits.shape)


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _float32_temperature(params: SamplingParams) -> float:
    """The divisor both implementations use: a huge temperature stays finite in float32 (so -inf / T stays -inf)."""
    return min(float(params.temperature), _FLOAT32_MAX)


def _bias_tensors(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:  # ids [n] int64, values [n] float32
    pairs = params.logit_bias or ()
    ids = torch.tensor([token for token, _ in pairs], dtype=torch.int64)
    return ids, torch.tensor([value for _, value in pairs], dtype=torch.float32)


def biased_logits(
    logits: torch.Tensor,  # [..., V] any float dtype
    params: SamplingParams,
) -> torch.Tensor:  # [..., V]: ``logits`` itself without a bias, else a float32 copy with the bias added
    """``logits`` plus ``params.logit_bias`` (token id -> additive bias), in float32 when biased.

    Raises ValueError when a biased id lies outside the vocabulary (the last dim).
    """
    if not params.logit_bias:
        return logits
    params.check_vocabulary(logits.shape[-1])
    ids = torch.tensor([token for token, _ in params.logit_bias], device=logits.device)  # [n]
    bias = torch.tensor([value for _, value in params.logit_bias], dtype=torch.float32, device=logits.device)  # [n]
    return logits.float().index_add(-1, ids, bias.expand(*logits.shape[:-1], -1))


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:  # logits [..., V] -> [...] int64
    """``logits.argmax(dim=-1)``: the first largest logit of each row (a NaN counts as the largest, as there).

    The native kernel takes float32 and bfloat16 CPU logits (:func:`native_sampling_applies`);
    ATen's argmax reads a row one element at a time, about 42 us for the reference target's
    49,156 ids on the 2-core EPYC, on every verification.
    """
    if logits.dtype in (torch.float32, torch.bfloat16) and logits.dim() >= 1 and native_sampling_applies(logits):
        return torch.ops.vlmspec.greedy_ids(logits)
    return logits.argmax(dim=-1)


def greedy_one_hot(logits: torch.Tensor) -> torch.Tensor:  # logits [..., V] -> [..., V] float32
    """One-hot float32 of the argmax over the last dim (ties -> lowest index, as ``torch.argmax``)."""
    _check_logits(logits)
    best = greedy_ids(logits)[..., None]  # [..., 1]
    return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, best, 1.0)


def mask_top_k(
    scores: torch.Tensor,  # [..., V] float32
    top_k: int,
) -> torch.Tensor:  # [..., V] float32
    """Set to -inf every score below the k-th largest; ties with the k-th largest survive."""
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    if top_k >= scores.shape[-1]:
        return scores
    kth_largest = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # [..., 1]
    return scores.masked_fill(scores < kth_largest, float("-inf"))


def mask_top_p(
    scores: torch.Tensor,  # [..., V] float32
    top_p: float,
    num_candidates: int | None = None,
) -> torch.Tensor:  # [..., V] float32
    """Keep the smallest most-probable set whose probability reaches ``top_p``; -inf elsewhere.

    A token is dropped when the probability of all tokens ranked at or below it is
    ``<= 1 - top_p``. The most probable token always survives. Ties are ranked by index:
    the lower index counts as more probable, so it is kept first.

    ``num_candidates``: when no row has more than this many finite scores (after top-k),
    only that many per row are sorted instead of all of V. The ranking and the tie rule
    are the same; the softmax over fewer terms can differ in the last float32 bit.
    """
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")
    sorted_desc, order_desc = _sort_descending_ties_by_index(scores, num_candidates)  # [..., m] each
    # Accumulate the tail mass in ascending order (small values first, as transformers does).
    sorted_asc = sorted_desc.flip(-1)  # [..., m]
    tail_mass = torch.softmax(sorted_asc, dim=-1).cumsum(dim=-1)  # [..., m], mass at or below each rank
    drop_asc = tail_mass <= (1.0 - top_p)  # [..., m]
    drop_asc[..., -1] = False  # the most probable token always survives
    drop = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)  # [..., V]
    drop.scatter_(-1, order_desc, drop_asc.flip(-1))  # back to vocabulary order
    return scores.masked_fill(drop, float("-inf"))


def mask_min_p(
    scores: torch.Tensor,  # [..., V] float32, after temperature
    min_p: float,
) -> torch.Tensor:  # [..., V] float32
    """Set to -inf every score whose probability is below ``min_p`` times the row's largest.

    The arithmetic of transformers' ``MinPLogitsWarper`` (``probs < min_p * max(probs)`` is
    removed). The most probable token always survives since ``min_p <= 1``.
    """
    if not (isinstance(min_p, (int, float)) and 0.0 <= min_p <= 1.0):
        raise ValueError(f"min_p must lie in [0, 1], got {min_p!r}")
    probs = torch.softmax(scores, dim=-1)  # [..., V]
    threshold = min_p * probs.amax(dim=-1, keepdim=True)  # [..., 1]
    return scores.masked_fill(probs < threshold, float("-inf"))


def _sort_descending_ties_by_index(
    scores: torch.Tensor,  # [..., V]
    num_candidates: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # values [..., m], vocabulary indices [..., m]
    """The m largest scores in descending order, equal scores in ascending index order.

    m = V unless ``num_candidates`` is smaller; every score outside the m must be -inf.
    """
    if num_candidates is None or num_candidates >= scores.shape[-1]:
        return torch.sort(scores, dim=-1, descending=True, stable=True)
    values, indices = torch.topk(scores, num_candidates, dim=-1)  # [..., m]; ties in no defined order
    indices, by_index = indices.sort(dim=-1)  # [..., m], ascending index
    values = values.gather(-1, by_index)
    values, by_value = values.sort(dim=-1, descending=True, stable=True)  # keeps the index order of ties
    return values, indices.gather(-1, by_value)


def _most_finite_per_row(scores: torch.Tensor) -> int:  # scores [..., V]
    """The largest number of finite scores in any row (one host sync)."""
    if scores.numel() == 0:
        return scores.shape[-1]
    return int((scores > float("-inf")).sum(dim=-1).max())


def residual_probs(
    target_probs: torch.Tensor,  # [..., V] float32
    draft_probs: torch.Tensor,  # [..., V] float32
) -> torch.Tensor:  # [..., V] float32
    """Normalised ``max(target_probs - draft_probs, 0)``: where the target resamples after a rejection.

    Where the residual is all zeros (only when target == draft, so a rejection cannot
    happen except through rounding) the target itself is returned; any token drawn from
    it is then correct.
    """
    residual = positive_residual(target_probs, draft_probs)  # [..., V]
    return residual / residual.sum(dim=-1, keepdim=True)


def positive_residual(
    target_probs: torch.Tensor,  # [..., V] float32
    draft_probs: torch.Tensor,  # [..., V] float32
) -> torch.Tensor:  # [..., V] float32, unnormalised
    """``max(target_probs - draft_probs, 0)``, or ``target_probs`` where that is all zeros: :func:`residual_probs`
    before normalising. Verification draws from it as it is (the draw divides by the float64 total), which is
    what lets the native kernel, which never builds it, draw the same token bit for bit."""
    residual = (target_probs - draft_probs).clamp_min_(0.0)  # [..., V]
    has_mass = (residual > 0).any(dim=-1, keepdim=True)  # [..., 1]
    return torch.where(has_mass, residual, target_probs)


def draw_uniforms(
    generators: Sequence[torch.Generator],
    num_per_row: int,
    device: torch.device | str,
) -> torch.Tensor:  # [B, num_per_row] float64 in [0, 1)
    """``num_per_row`` uniforms for each row, row r drawn from ``generators[r]`` in one call.

    Draws happen on each generator's own device and are then moved to ``device``, so CPU
    generators work with CUDA tensors (and CUDA generators with CUDA tensors avoid a copy).
    """
    _check_generators(generators)
    rows = [torch.rand(num_per_row, generator=g, device=g.device, dtype=torch.float64) for g in generators]
    if not rows:
        return torch.empty(0, num_per_row, dtype=torch.float64, device=device)
    return torch.stack(rows).to(device)


def draw_row_uniforms(
    generators: Sequence[torch.Generator],
    counts: Sequence[int],
    device: torch.device | str,
) -> torch.Tensor:  # [sum(counts)] float64 in [0, 1)
    """``counts[r]`` uniforms from ``generators[r]`` (one call per row), concatenated row after row.

    The ragged form of :func:`draw_uniforms`: each row draws only as many as it needs, so
    what a row gets does not depend on how many the other rows need.
    """
    _check_generators(generators)
    rows = [
        torch.rand(n, generator=g, device=g.device, dtype=torch.float64)
        for g, n in zip(generators, counts, strict=True)
    ]
    if not rows:
        return torch.empty(0, dtype=torch.float64, device=device)
    return (rows[0] if len(rows) == 1 else torch.cat(rows)).to(device)


def sample_from_uniforms(
    probs: torch.Tensor,  # [B, V] float, non-negative, each row with positive mass
    uniforms: torch.Tensor,  # [B] float64 in [0, 1)
) -> torch.Tensor:  # [B] int64
    """Inverse-CDF draw: token i with probability ``probs[i] / probs.sum()``, per row.

    With ``u`` in [0, 1), ``v = (1 - u) * total`` lies in (0, total]; the first index whose
    cumulative mass is ``>= v`` has a cumulative mass strictly above its predecessor's,
    so its probability is positive: a zero-probability token is never returned, and the
    index never runs past the vocabulary. Rows need not be normalised. The native kernel
    (where it applies) returns the reference's token bit for bit.
    """
    _check_draw(probs, uniforms)
    if probs.dtype == torch.float32 and native_sampling_applies(probs):
        return native_sample_from_uniforms(probs, uniforms)
    return reference_sample_from_uniforms(probs, uniforms)


def reference_sample_from_uniforms(
    probs: torch.Tensor,  # [B, V] float, non-negative, each row with positive mass
    uniforms: torch.Tensor,  # [B] float64 in [0, 1)
) -> torch.Tensor:  # [B] int64
    """:func:`sample_from_uniforms` in PyTorch: a float64 cumsum and ``searchsorted`` (the reference)."""
    _check_draw(probs, uniforms)
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # [B, V]
    targets = (1.0 - uniforms.to(cdf)).unsqueeze(-1) * cdf[:, -1:]  # [B, 1] in (0, total]
    return torch.searchsorted(cdf, targets, right=False).squeeze(-1)  # [B] int64


def native_sample_from_uniforms(
    probs: torch.Tensor,  # [B, V] float, non-negative, each row with positive mass, on the CPU
    uniforms: torch.Tensor,  # [B] float64 in [0, 1)
) -> torch.Tensor:  # [B] int64
    """:func:`sample_from_uniforms` through the native kernel: the same float64 running sum, without a [B, V] copy."""
    _check_draw(probs, uniforms)
    if probs.dtype != torch.float32:
        raise ValueError(f"the native draw takes float32 probabilities (as target_probs makes them), got {probs.dtype}")
    none = torch.zeros(probs.shape[0], dtype=torch.int64)  # [B]
    _, tokens = torch.ops.vlmspec.rejection_sample(
        probs[:, None, :], None, none[:, None][:, :0], none, uniforms.to(torch.float64)[:, None]
    )
    return tokens


def _check_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> None:
    if probs.dim() != 2 or uniforms.shape != probs.shape[:1]:  # broadcasting would draw wrong tokens silently
        raise ValueError(f"probs must be [B, V] and uniforms [B], got {tuple(probs.shape)} and {tuple(uniforms.shape)}")


def sample(
    probs: torch.Tensor,  # [B, V] float32
    generators: Sequence[torch.Generator],
) -> torch.Tensor:  # [B] int64
    """One token per row, row r drawn with ``generators[r]`` (one uniform per row)."""
    if probs.dim() != 2 or not probs.is_floating_point():
        raise ValueError(f"probs must be a float tensor of shape [B, V], got {tuple(probs.shape)} {probs.dtype}")
    _check_generators(generators)
    if len(generators) != probs.shape[0]:
        raise ValueError(f"need one torch.Generator per row: {probs.shape[0]} rows, {len(generators)} generators")
    if probs.shape[1] == 0 or not bool((probs.sum(dim=-1) > 0).all()):
        raise ValueError("every row of probs needs positive mass; build it with vlmspec.sampling.target_probs")
    uniforms = draw_uniforms(generators, 1, probs.device)[:, 0]  # [B]
    return sample_from_uniforms(probs, uniforms)


def _check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() == 0:
        raise ValueError(
            "logits must be a floating-point tensor of shape [..., V]; pass the model's logits as they are"
        )
    if logits.shape[-1] == 0:
        raise ValueError("logits have an empty vocabulary dimension (V == 0)")


def _check_generators(generators: Sequence[torch.Generator]) -> None:
    if isinstance(generators, torch.Generator) or not all(isinstance(g, torch.Generator) for g in generators):
        raise ValueError(
            "generators must be a list with one torch.Generator per row, "
            "e.g. [torch.Generator().manual_seed(seed + r) for r in range(B)]"
        )
