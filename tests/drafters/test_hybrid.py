"""The hybrid proposer (n-gram and corpus copies + DSpark under the drafting policy): lossless, current, reported.

Greedy: token for token the target alone's output, for every family, with and without an
image, one request and batched. Sampling (temperature 1, the confined target of
stat_helpers): the first three tokens follow the target's exact joint law (chi-square),
with rounds drafted by the model, copied by the n-gram and the corpus sources and skipped
all occurring.
"""

from __future__ import annotations

import torch
from stat_helpers import PROMPT, SUPPORT, chi_square_p_value, exact_first_tokens

from vlmspec.drafters.base import PerRequestProposer
from vlmspec.drafters.corpus_lookup import CorpusLookup, TokenCorpus
from vlmspec.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkProposer
from vlmspec.drafters.hybrid import CORPUS, MODEL, NGRAM, HybridProposer
from vlmspec.drafters.prompt_lookup import PromptLookup
from vlmspec.engine import SpecEngine
from vlmspec.scheduling.policy import NONE, DraftCosts, DraftingPolicy
from vlmspec.serving import BatchEngine
from vlmspec.types import ContextUpdate, DraftBlock, SamplingParams

COSTS = DraftCosts(
    verify_steps=(1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7), draft_steps={MODEL: 0.4, NGRAM: 0.0, CORPUS: 0.0}
)
REPEATING = "Repeat after me: one two three, one two three, one two three, one two three."


def untrained_drafter(target, **overrides) -> DSparkDrafter:
    torch.manual_seed(0)
    config = DSparkConfig.for_target(target, **{"head_rank": 16, "block_size": 4, **overrides})
    return DSparkDrafter.from_target(target, config)


def hybrid(target, corpus: TokenCorpus | None = None, *, smoothing: float = 1.0, **overrides) -> HybridProposer:
    """Switches on every round's outcome (smoothing 1), so every choice occurs in short generations."""
    policy = DraftingPolicy(COSTS, priors={MODEL: 1.0, NGRAM: 1.0, CORPUS: 1.0}, smoothing=smoothing, probe_every=4)
    ngram = PromptLookup(max_draft_tokens=4, max_ngram=3, min_ngram=1)
    lookup = None if corpus is None else CorpusLookup(corpus, max_draft_tokens=4, min_count=1)
    return HybridProposer(DSparkProposer(untrained_drafter(target, **overrides)), policy, ngram=ngram, corpus=lookup)


def answers_corpus(target, prompts) -> TokenCorpus:
    """The target alone's greedy answers with every fourth token changed: corpus copies both survive and fail."""
    engine = SpecEngine(target)
    answers = [
        engine.generate(image, prompt, max_new_tokens=16, speculative=False).token_ids for image, prompt in prompts
    ]
    return TokenCorpus.from_sequences([t + 1 if i % 4 == 3 else t for i, t in enumerate(a)] for a in answers)


def test_greedy_with_the_hybrid_equals_the_target_alone(family, make_target, astronaut):
    target = make_target(family)
    prompts = ((astronaut, PROMPT), (None, REPEATING))
    engine = SpecEngine(target, hybrid(target, answers_corpus(target, prompts)))
    sources = set()
    for image, prompt in prompts:
        alone = engine.generate(image, prompt, max_new_tokens=16, speculative=False)
        spec = engine.generate(image, prompt, max_new_tokens=16)
        assert spec.token_ids == alone.token_ids
        assert sum(spec.stats.rounds_by_source.values()) == spec.stats.rounds
        sources |= set(spec.stats.rounds_by_source)
    assert CORPUS in sources


def test_greedy_batched_with_the_hybrid_equals_each_request_alone(make_target, astronaut, coffee):
    target = make_target("qwen2_5_vl")
    requests = [
        {"images": astronaut, "prompt": PROMPT, "max_new_tokens": 12},
        {"prompt": REPEATING, "max_new_tokens": 16},
        {"images": coffee, "prompt": "What is this?", "max_new_tokens": 10},
    ]
    alone = BatchEngine(target).generate_many(requests)
    corpus = answers_corpus(target, [(astronaut, PROMPT)])
    results = BatchEngine(target, hybrid(target, corpus), max_batch_size=2).generate_many(requests)
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]
    sources = set().union(*(r.stats.rounds_by_source for r in results))
    assert {MODEL, NGRAM, CORPUS} <= sources  # the repeating prompt gets copies, the others the model and the corpus


def test_sampling_with_the_hybrid_follows_the_target_distribution(confined_target, astronaut):
    """250 seeded generations at temperature 1: the first three tokens fit the exact joint (p > 1e-3).

    Round 1 drafts with the model (the priors say it pays); round 2's choice follows round
    1's outcome, whether the anchor repeats a token seen before (an n-gram copy) and
    whether the last two tokens are among the few pairs the corpus holds (a corpus copy).
    """
    params = SamplingParams(temperature=1.0)
    joint = exact_first_tokens(confined_target, astronaut, params)
    a, b, c, d = SUPPORT
    corpus = TokenCorpus.from_sequences([[a, b, c, a, b], [c, d, c]])  # 5 of the 16 pairs
    engine = SpecEngine(confined_target, hybrid(confined_target, corpus, block_size=3))
    index = {seq: i for i, seq in enumerate(joint)}
    counts = torch.zeros(len(joint), dtype=torch.float64)
    sources: dict[str, int] = {}
    runs = 250
    for seed in range(runs):
        result = engine.generate(astronaut, PROMPT, max_new_tokens=3, temperature=1.0, seed=seed)
        counts[index[tuple(result.token_ids)]] += 1
        for source, n in result.stats.rounds_by_source.items():
            sources[source] = sources.get(source, 0) + n
    assert {MODEL, NGRAM, CORPUS, NONE} <= set(sources), f"every choice must occur for the test to bite: {sources}"
    expected = runs * torch.tensor(list(joint.values()), dtype=torch.float64)
    assert chi_square_p_value(counts, expected) > 1e-3


class RecordingModel(PerRequestProposer):
    """TEST HELPER: a model source that drafts one fixed token and records every span it absorbs."""

    max_draft_tokens = 2

    def new_state(self) -> list[torch.Tensor]:
        return []

    def propose_one(self, state, update: ContextUpdate, params, generator) -> DraftBlock:
        state.append(update.token_ids.clone())
        return DraftBlock(torch.tensor([[7, 7]]), torch.tensor([2]), confidences=torch.full((1, 2), 0.5))


def test_the_model_absorbs_every_span_in_order_even_after_rounds_it_sat_out():
    policy = DraftingPolicy(COSTS, priors={MODEL: 0.0, NGRAM: 0.0}, probe_every=3)  # none, except probes
    proposer = HybridProposer(RecordingModel(), policy)
    state = proposer.new_state()
    spans = [torch.arange(5), torch.tensor([5]), torch.tensor([6]), torch.tensor([7]), torch.tensor([8, 9])]
    choices = []
    for i, span in enumerate(spans):
        update = ContextUpdate(span, span, None, anchor=100 + i, anchor_position=int(span[-1]) + 1)
        block = proposer.propose([state], [update], [SamplingParams()], [torch.Generator()])
        choices.append(block.sources[0])
    assert choices == [NONE, NONE, NONE, MODEL, NONE]  # the probe after 3 idle rounds
    absorbed = torch.cat(state.model)
    assert torch.equal(absorbed, torch.arange(8))  # spans 0-3 in one update, in order, nothing twice
    assert len(state.pending) == 1 and torch.equal(state.pending[0].token_ids, spans[4])  # waits for the next


class SamplingModel(RecordingModel):
    """TEST HELPER: a model source that drafts from a fixed distribution and returns it as draft_probs."""

    probs = torch.softmax(torch.arange(6, dtype=torch.float32), dim=0)  # [6] over a 6-token vocabulary

    def propose_one(self, state, update: ContextUpdate, params, generator) -> DraftBlock:
        state.append(update.token_ids.clone())
        tokens = torch.multinomial(self.probs, 2, replacement=True, generator=generator)[None]
        probs = self.probs.expand(1, 2, -1).clone()
        return DraftBlock(tokens, torch.tensor([2]), draft_probs=probs, confidences=torch.full((1, 2), 0.5))


def test_a_mixed_block_carries_each_source_s_exact_draft_distribution():
    """One step, three requests: the model's row keeps the distribution it sampled from; copies are one-hot."""
    policy = DraftingPolicy(COSTS, priors={MODEL: 1.0, NGRAM: 1.0, CORPUS: 1.0})
    corpus = CorpusLookup(TokenCorpus.from_sequences([[1, 2, 3, 4], [1, 2, 3, 4]]), max_draft_tokens=2)
    proposer = HybridProposer(
        SamplingModel(), policy, ngram=PromptLookup(max_draft_tokens=2, max_ngram=2), corpus=corpus
    )
    states = [proposer.new_state() for _ in range(3)]
    spans = [torch.tensor([7, 0]), torch.tensor([0, 1]), torch.tensor([0, 5, 1, 2, 5, 1])]  # model, corpus, n-gram
    anchors = [5, 2, 2]
    updates = [ContextUpdate(s, torch.arange(len(s)), None, a, len(s)) for s, a in zip(spans, anchors)]
    params = [SamplingParams(temperature=1.0)] * 3
    block = proposer.propose(states, updates, params, [torch.Generator().manual_seed(i) for i in range(3)])
    assert block.sources == (MODEL, CORPUS, NGRAM)
    assert torch.equal(block.draft_probs[0], SamplingModel.probs.expand(2, -1))
    assert block.tokens[1].tolist() == [3, 4] and block.tokens[2].tolist() == [5, 1]
    for row in (1, 2):
        assert torch.equal(block.draft_probs[row], torch.nn.functional.one_hot(block.tokens[row], 6).float())


def test_rows_that_all_draft_from_the_model_or_all_sit_out_give_the_row_by_row_block():
    """The model-alone proposer's common rounds (every row drafts, or none does) skip the per-row restacking."""
    updates = [ContextUpdate(torch.tensor([3, 4]), torch.arange(2), None, 5, 2) for _ in range(2)]
    params = [SamplingParams(temperature=1.0)] * 2
    drafting = HybridProposer(SamplingModel(), DraftingPolicy(COSTS, priors={MODEL: 1.0}))
    states = [drafting.new_state() for _ in range(2)]
    block = drafting.propose(states, updates, params, [torch.Generator().manual_seed(i) for i in range(2)])
    alone = [
        SamplingModel().propose_one([], u, p, torch.Generator().manual_seed(i))
        for i, (u, p) in enumerate(zip(updates, params))
    ]
    assert block.sources == (MODEL, MODEL) and block.num_tokens.tolist() == [2, 2]
    assert torch.equal(block.tokens, torch.cat([b.tokens for b in alone]))
    assert torch.equal(block.draft_probs, torch.cat([b.draft_probs for b in alone]))
    assert torch.equal(block.confidences, torch.cat([b.confidences for b in alone]))
    assert [(s.last_source, s.last_drafts) for s in states] == [(MODEL, 2), (MODEL, 2)]
    sitting_out = HybridProposer(RecordingModel(), DraftingPolicy(COSTS, priors={MODEL: 0.0}, probe_every=8))
    states = [sitting_out.new_state() for _ in range(2)]
    block = sitting_out.propose(states, updates, [SamplingParams()] * 2, [torch.Generator()] * 2)
    assert block.sources == (NONE, NONE) and tuple(block.tokens.shape) == (2, 0) and block.num_tokens.tolist() == [0, 0]
    assert tuple(block.confidences.shape) == (2, 0) and block.draft_probs is None
    assert [(s.last_source, s.last_drafts) for s in states] == [(NONE, 0), (NONE, 0)]
