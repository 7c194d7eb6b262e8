"""Training of the reference target's vision tower + merger: phase 1 (color/shape) and phase 2 (chat turns).

Part of ``recipes/build_reference_target.py`` (recipes/ is not a package: the recipe imports this
module after putting recipes/ on ``sys.path``). Phase 1 (:func:`pretrain_vision`) classifies each
image's color and shape with a throwaway head, without the language model; phase 2
(:func:`train_vision`) trains through the frozen language model on the answer tokens only, with
the shared chat prefix's keys/values computed once (:class:`SharedPrefix`).
"""

from __future__ import annotations

import inspect
import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from PIL import Image
from reference_target_checks import evaluate
from reference_target_data import CAPTION_PROMPTS, COLORS, SHAPES, Example, collate, encode_conversation
from tqdm import tqdm

from vlmspec import reference as ref
from vlmspec.targets import QwenVLTarget
from vlmspec.targets.adapter import resolve_dtype


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
