import pytest
import torch

from vlmspec.targets.positions import text_stream_positions


def image_prompt_positions():
    """Two text tokens, a 2 x 3 merged image starting at 2, then two text tokens."""
    t = [0, 1, 2, 2, 2, 2, 2, 2, 5, 6]
    h = [0, 1, 2, 2, 2, 3, 3, 3, 5, 6]
    w = [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]
    mask = torch.tensor([False, False] + [True] * 6 + [False, False])
    return torch.tensor([t, h, w]), mask


def test_text_tokens_keep_the_target_position_and_text_resumes_where_the_target_does():
    mrope, mask = image_prompt_positions()
    for rule in ("interpolate", "temporal"):
        positions = text_stream_positions(mrope, mask, rule)
        assert positions[:2].tolist() == [0, 1]
        assert positions[8:].tolist() == [5, 6]
        assert (torch.diff(positions) >= 0).all(), "positions must be monotone"


def test_interpolate_spreads_image_tokens_over_the_reserved_span():
    mrope, mask = image_prompt_positions()
    # span = 5 - 2 = 3 positions for 6 tokens: 2 + floor(i * 3 / 6)
    assert text_stream_positions(mrope, mask, "interpolate")[2:8].tolist() == [2, 2, 3, 3, 4, 4]
    assert text_stream_positions(mrope, mask, "temporal")[2:8].tolist() == [2] * 6


def test_unknown_rule_is_refused():
    mrope, mask = image_prompt_positions()
    with pytest.raises(ValueError, match="interpolate"):
        text_stream_positions(mrope, mask, "diagonal")


def test_real_prompt_positions_match_the_targets_rope_index(make_target, astronaut):
    target = make_target("qwen2_vl")
    inputs = target.build_inputs([astronaut, astronaut], "Compare the two pictures.")
    state, step = target.prefill(inputs)
    mrope, delta = target.model.model.get_rope_index(
        inputs.input_ids,
        mm_token_type_ids=inputs.model_kwargs["mm_token_type_ids"],
        image_grid_thw=inputs.model_kwargs["image_grid_thw"],
    )
    text = (mrope[0, 0] == mrope[1, 0]) & (mrope[1, 0] == mrope[2, 0]) & (inputs.input_ids[0] != 151655)
    assert torch.equal(step.positions[text], mrope[0, 0][text])
    assert int(step.positions[-1]) + 1 == inputs.length + state.rope_delta == int(mrope.max()) + 1
    assert state.rope_delta == int(delta)
