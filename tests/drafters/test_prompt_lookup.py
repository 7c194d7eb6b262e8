import pytest
import torch

from vlmspec.drafters.prompt_lookup import PromptLookup
from vlmspec.types import ContextUpdate, SamplingParams


def update(tokens, anchor):
    tokens = torch.tensor(tokens)
    return ContextUpdate(tokens, torch.arange(len(tokens)), None, anchor, len(tokens))


def propose(lookup, state, update):
    """One request through the batched protocol."""
    return lookup.propose([state], [update], [SamplingParams()], [torch.Generator()])


def test_copies_what_followed_the_latest_match_of_the_longest_ngram():
    lookup = PromptLookup(max_draft_tokens=3, max_ngram=2)
    state = lookup.new_state()
    # History 5 6 7 8 1 5 6 9 9 then the anchor 5: the 2-gram (9, 5) never occurred before,
    # the 1-gram (5) last occurred at index 5, followed by 6 9 9.
    block = propose(lookup, state, update([5, 6, 7, 8, 1, 5, 6, 9, 9], anchor=5))
    assert block.num_tokens.tolist() == [3] and block.tokens[0].tolist() == [6, 9, 9]
    assert block.draft_probs is None and block.confidences is None


def test_prefers_the_longer_ngram_and_keeps_history_across_rounds():
    lookup = PromptLookup(max_draft_tokens=2, max_ngram=3)
    state = lookup.new_state()
    propose(lookup, state, update([1, 2, 3, 4, 9, 2, 3, 7], anchor=1))
    # next round commits [1 (old anchor), 2] and the new anchor 3: tail (1, 2, 3) matched at 0 -> 4 9
    block = propose(lookup, state, update([1, 2], anchor=3))
    assert block.tokens[0, : int(block.num_tokens[0])].tolist() == [4, 9]


def test_no_match_drafts_nothing():
    lookup = PromptLookup()
    block = propose(lookup, lookup.new_state(), update([1, 2, 3], anchor=4))
    assert block.num_tokens.tolist() == [0]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_draft_tokens"):
        PromptLookup(max_draft_tokens=0)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(max_ngram=1, min_ngram=2)


def test_a_batch_of_requests_gets_each_its_own_lookup_padded_to_the_longest():
    lookup = PromptLookup(max_draft_tokens=3, max_ngram=2)
    updates = [update([5, 6, 7, 8, 1, 5, 6, 9, 9], anchor=5), update([1, 2, 3], anchor=4), update([7, 3, 4], anchor=3)]
    block = lookup.propose(
        [lookup.new_state() for _ in updates], updates, [SamplingParams()] * 3, [torch.Generator()] * 3
    )
    assert block.tokens.shape == (3, 3) and block.num_tokens.tolist() == [3, 0, 2]
    assert block.tokens[0].tolist() == [6, 9, 9] and block.tokens[2, :2].tolist() == [4, 3]
