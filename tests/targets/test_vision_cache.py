"""The vision tower's output cache: the same images skip the encoder and give the same prompt, other images do not."""

import pytest
import torch
from PIL import Image

from vlmspec.targets.families import VisionCache


def test_a_later_prompt_about_the_same_image_reuses_the_towers_output(make_target, family, astronaut, coffee):
    target = make_target(family)
    target.vision_cache = VisionCache(max_entries=1)
    picture, other = astronaut.resize((64, 64)), Image.fromarray(coffee).resize((64, 64))
    first = target.row_prompt(target.build_inputs(picture, "Describe it."))
    assert (target.vision_cache.hits, target.vision_cache.misses) == (0, 1)
    again = target.row_prompt(target.build_inputs(picture, "And the colours?"))  # another turn, the same picture
    assert (target.vision_cache.hits, target.vision_cache.misses) == (1, 1)
    assert again.vision.embeds is first.vision.embeds
    fresh = VisionCache(max_entries=0)  # no caching: the tower runs again, and computes the same
    target.vision_cache = fresh
    uncached = target.row_prompt(target.build_inputs(picture, "And the colours?"))
    assert fresh.misses == 1 and len(fresh) == 0
    assert torch.equal(uncached.vision.embeds, again.vision.embeds)
    assert all(torch.equal(a, b) for a, b in zip(uncached.vision.deepstack, again.vision.deepstack, strict=True))
    target.vision_cache = VisionCache(max_entries=1)
    target.row_prompt(target.build_inputs(picture, "Describe it."))
    different = target.row_prompt(target.build_inputs(other, "Describe it."))  # other pixels: a miss, LRU evicts
    assert (target.vision_cache.hits, target.vision_cache.misses, len(target.vision_cache)) == (0, 2, 1)
    assert not torch.equal(different.vision.embeds, first.vision.embeds)


def test_a_negative_size_is_refused():
    with pytest.raises(ValueError, match="max_entries"):
        VisionCache(max_entries=-1)
