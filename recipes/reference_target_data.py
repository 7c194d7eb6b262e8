"""The reference target's training data: easy-vqa's questions and captions as chat turns, and their batches.

Part of ``recipes/build_reference_target.py`` (recipes/ is not a package: the recipe imports this
module after putting recipes/ on ``sys.path``). Owns what a training or held-out example is
(:class:`Example`), how easy-vqa's questions become examples and captions
(:func:`easy_vqa_examples`), the conversations phase 2 trains on (:func:`conversation_stream`)
and their token ids and padded batches (:func:`encode_conversation`, :func:`collate`).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from PIL import Image

COLORS = ("red", "green", "blue", "black", "gray", "teal", "brown", "yellow")
SHAPES = ("circle", "rectangle", "triangle")
CAPTION_PROMPTS = ("Describe the image.", "What is in this image?", "Describe this picture in a few words.")
# Phase 2 draws each turn's kind with these weights (easy-vqa itself is 74% yes/no questions).
KIND_WEIGHTS = {"caption": 0.3, "color": 0.2, "shape": 0.2, "yes/no": 0.3}


@dataclass(frozen=True)
class Example:
    """One chat turn about one image: the user asks ``prompt``, the assistant answers ``answer``."""

    image: str  # path of a 64 x 64 PNG
    prompt: str
    answer: str  # what the assistant says, e.g. "Blue." or "A blue circle."
    kind: str  # "yes/no", "color", "shape" or "caption"


# ------------------------------------------------------------------------------ data
def answer_kind(answer: str) -> str:
    if answer in ("yes", "no"):
        return "yes/no"
    if answer in COLORS:
        return "color"
    if answer in SHAPES:
        return "shape"
    raise ValueError(f"unexpected easy-vqa answer {answer!r}")


def image_attributes(
    questions: Sequence[str], answers: Sequence[str], image_ids: Sequence[int]
) -> dict[int, tuple[str, str]]:
    """(color, shape) of every image whose questions reveal both.

    A "what ..." answer states an attribute, and so does any color or shape the question
    names ("what color is the circle?"); a yes/no question states the attribute it names
    when the answer is "yes" and the question is not negated ("is there not a ..."), or
    the answer is "no" and it is.
    """
    found: dict[int, dict[str, str]] = defaultdict(dict)
    for question, answer, image_id in zip(questions, answers, image_ids):
        words = question.rstrip("?").split()
        named = [w for w in words if w in COLORS or w in SHAPES]
        if answer_kind(answer) != "yes/no":
            named.append(answer)
        elif (answer == "yes") == ("not" in words or "no" in words):
            named = []  # the named attribute is absent: says nothing about what is present
        for word in named:
            found[image_id]["color" if word in COLORS else "shape"] = word
    return {i: (f["color"], f["shape"]) for i, f in found.items() if len(f) == 2}


def caption(color: str, shape: str) -> str:
    return f"A {color} {shape}."


def spoken(answer: str) -> str:
    """easy-vqa's one-word answer as the assistant says it: "blue" -> "Blue."."""
    return answer.capitalize() + "."


def easy_vqa_examples(split: str) -> tuple[list[Example], list[Example]]:
    """(question examples, caption examples) of easy-vqa's ``split`` ("train" or "test")."""
    import easy_vqa

    if split == "train":
        questions, answers, image_ids = easy_vqa.get_train_questions()
        paths = easy_vqa.get_train_image_paths()
    else:
        questions, answers, image_ids = easy_vqa.get_test_questions()
        paths = easy_vqa.get_test_image_paths()
    qa = [
        Example(paths[i], q[0].upper() + q[1:], spoken(a), answer_kind(a))
        for q, a, i in zip(questions, answers, image_ids)
    ]
    attributes = image_attributes(questions, answers, image_ids)
    captions = [
        Example(paths[i], prompt, caption(*attributes[i]), "caption")
        for i in sorted(attributes)
        for prompt in CAPTION_PROMPTS
    ]
    return qa, captions


def conversation_stream(examples: list[Example], turns: int, seed: int) -> Iterator[list[Example]]:
    """Endless conversations of ``turns`` exchanges about one random training image.

    Each turn's kind is drawn by :data:`KIND_WEIGHTS` (among the kinds the image has), so
    shape and color questions are not drowned by easy-vqa's many yes/no questions.
    """
    by_image: dict[str, dict[str, list[Example]]] = defaultdict(lambda: defaultdict(list))
    for example in examples:
        by_image[example.image][example.kind].append(example)
    images = sorted(by_image)
    rng = random.Random(seed)
    while True:
        pool = by_image[images[rng.randrange(len(images))]]
        kinds = [kind for kind in KIND_WEIGHTS if pool[kind]]
        chosen = rng.choices(kinds, weights=[KIND_WEIGHTS[kind] for kind in kinds], k=turns)
        yield [pool[kind][rng.randrange(len(pool[kind]))] for kind in chosen]


def heldout_sample(
    qa: list[Example], captions: list[Example], num_questions: int, num_captions: int, seed: int
) -> list[Example]:
    """A fixed random sample of test questions plus captions (first caption prompt only)."""
    rng = random.Random(seed)
    first_prompt = [c for c in captions if c.prompt == CAPTION_PROMPTS[0]]
    return rng.sample(qa, min(num_questions, len(qa))) + rng.sample(first_prompt, min(num_captions, len(first_prompt)))


# -------------------------------------------------------------------------- batching
def encode_conversation(processor, turns: list[Example]) -> dict[str, torch.Tensor]:
    """Token ids of a chat about one image (shown in the first turn); ``answer_mask`` marks the targets.

    Each user turn is rendered by the chat template exactly as an inference prompt would be
    (what a turn adds is the template's text for the longer conversation minus the text
    so far), and each answer is the assistant's words plus ``<|im_end|>``.
    """
    tokenizer = processor.tokenizer
    messages: list[dict] = []
    pieces: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # (ids [n], mm types [n], is answer)
    said = ""  # the conversation's text so far
    for index, turn in enumerate(turns):
        content = [{"type": "image"}] * (index == 0) + [{"type": "text", "text": turn.prompt}]
        messages.append({"role": "user", "content": content})
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text.startswith(said), "the chat template must render a conversation as a prefix of its continuation"
        if index == 0:
            with Image.open(turn.image) as image:
                encoded = processor(text=[text], images=[image.convert("RGB")], return_tensors="pt")
            pieces.append((encoded["input_ids"][0], encoded["mm_token_type_ids"][0], False))
        else:
            ids = tokenizer(text[len(said) :], add_special_tokens=False, return_tensors="pt").input_ids[0]
            pieces.append((ids, torch.zeros_like(ids), False))
        answer = tokenizer(turn.answer + "<|im_end|>", add_special_tokens=False, return_tensors="pt").input_ids[0]
        pieces.append((answer, torch.zeros_like(answer), True))
        messages.append({"role": "assistant", "content": turn.answer})
        said = text + turn.answer + "<|im_end|>"
    return {
        "input_ids": torch.cat([ids for ids, _, _ in pieces]),
        "mm_token_type_ids": torch.cat([types for _, types, _ in pieces]),
        "answer_mask": torch.cat([torch.full_like(ids, is_answer, dtype=torch.bool) for ids, _, is_answer in pieces]),
        "pixel_values": encoded["pixel_values"],
        "image_grid_thw": encoded["image_grid_thw"],
    }


def collate(items: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch; the pixel patches of all images are concatenated (Qwen-VL's layout)."""
    length = max(item["input_ids"].numel() for item in items)

    def pad(values: list[torch.Tensor], fill) -> torch.Tensor:  # B x [l] -> [B, length]
        return torch.stack([torch.nn.functional.pad(v, (0, length - v.numel()), value=fill) for v in values])

    return {
        "input_ids": pad([it["input_ids"] for it in items], pad_id),  # [B, L]
        "attention_mask": pad([torch.ones_like(it["input_ids"]) for it in items], 0),  # [B, L]
        "mm_token_type_ids": pad([it["mm_token_type_ids"] for it in items], 0),  # [B, L]
        "answer_mask": pad([it["answer_mask"] for it in items], False),  # [B, L]
        "pixel_values": torch.cat([it["pixel_values"] for it in items]),  # [B * patches, C * T * P * P]
        "image_grid_thw": torch.cat([it["image_grid_thw"] for it in items]),  # [B, 3]
    }
