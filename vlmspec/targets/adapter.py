"""The target adapter: the face of vlmspec.targets, the only package that knows Hugging Face, Qwen-VL and M-RoPE.

A :class:`QwenVLTarget` wraps one loaded model and its processor and is shared by all
requests. Everything that belongs to a request (KV cache, ``rope_delta``, committed
length, 1-D positions) lives in a :class:`RequestState`; the model's own
``rope_deltas`` attribute is never read or written, because every forward gets explicit
position ids computed here. Per-family facts live in :mod:`vlmspec.targets.families`;
prompts for the runner's prefill (vision tower, M-RoPE positions) in :mod:`vlmspec.targets.prompts`.

What it does not know: drafting, verification rules, scheduling.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from vlmspec.targets.families import SUPPORTED_MODEL_TYPES, VisionCache, family_spec, language_model
from vlmspec.targets.inputs import (
    ImageLike,
    TargetInputs,
    chat_messages,
    count_image_slots,
    load_images,
)
from vlmspec.targets.packed import check_fast_path
from vlmspec.targets.positions import DEFAULT_POSITION_RULE, check_position_rule
from vlmspec.targets.processor import load_processor
from vlmspec.targets.prompts import RowPrompt, drafter_positions, prompt_positions, row_prompt
from vlmspec.targets.settings import DECODE_MODES, check_attention, check_decode_mode, resolve_dtype
from vlmspec.types import PrefillOutput

# The helpers importers found here before they moved (settings, families, processor) stay importable from here.
__all__ = [
    "DECODE_MODES",
    "SUPPORTED_MODEL_TYPES",
    "QwenVLTarget",
    "RequestState",
    "TargetStep",
    "check_decode_mode",
    "load_processor",
    "prefill_output",
    "resolve_dtype",
]


@dataclass
class TargetStep:
    """What one target forward returns for the tokens it was fed."""

    logits: torch.Tensor  # [n, V] float32, prediction for the token after each input
    features: torch.Tensor | None  # [n, m * d] hooked decoder-layer outputs (model dtype), or None
    positions: torch.Tensor  # [n] int64, 1-D text-stream positions of the inputs


@dataclass
class RequestState:
    """Per-request state of the target; never shared between requests."""

    cache: object  # transformers DynamicCache
    rope_delta: int  # M-RoPE position minus cache index, for every token after the prompt
    length: int  # tokens held in the cache
    feature_layers: tuple[int, ...]
    position_rule: str
    prompt_length: int
    uncommitted: int = 0  # tokens of the last verify not yet confirmed by rollback()
    broken: bool = field(default=False)  # a forward failed mid-way: the cache cannot be trusted


class QwenVLTarget:
    """A Qwen2-VL, Qwen2.5-VL or Qwen3-VL model plus its processor, driven request by request.

    Build with :meth:`from_pretrained` (a local directory) or wrap objects you already
    have: ``QwenVLTarget(model, processor)``.
    """

    def __init__(self, model: nn.Module, processor, *, name: str | None = None, decode: str = "fast") -> None:
        self.spec = family_spec(getattr(model.config, "model_type", None))  # what vlmspec knows of its family
        if not hasattr(processor, "apply_chat_template") or not hasattr(processor, "tokenizer"):
            raise TypeError("processor must be the model's transformers processor (AutoProcessor.from_pretrained(...))")
        self.model = model.eval()
        self.processor = processor
        self.family = self.spec.name
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self._text_config = model.config.get_text_config()
        self._layers = language_model(model).layers
        # transformers 5.x renamed `past_key_values` to `cache`; accept both generations.
        forward_parameters = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_parameters else "past_key_values"
        self.decode = check_decode_mode(decode)
        if self.decode == "fast":
            check_fast_path(model)  # refused now, naming decode="reference", not at the first step
        self._packed = None  # the PackedDecoder, built on the first fast forward
        self.vision_cache = VisionCache()  # the vision tower's outputs of recent prompts' images, by their pixels

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        dtype: str | torch.dtype = "float32",
        attn_implementation: str = "sdpa",
        device: str | torch.device = "cpu",
        decode: str = "fast",
    ) -> QwenVLTarget:
        """Load a Qwen-VL model and its processor from a local directory (no hub access).

        ``decode`` picks how decode/verify forwards run (:data:`DECODE_MODES`).
        """
        from transformers import AutoConfig, AutoModelForImageTextToText

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {str(path)!r}: pass the directory of a saved Qwen-VL model")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{str(path)!r} holds a {config.model_type!r} model; vlmspec supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        check_attention(attn_implementation)
        model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation, local_files_only=True
        ).to(device)
        return cls(model, load_processor(path, config.model_type), name=str(path), decode=decode)

    def to_device(self, device: str | torch.device) -> QwenVLTarget:
        self.model.to(device)
        self._packed = None  # packed weights are per device
        self.vision_cache.clear()  # and so are the vision tower's stored outputs
        return self

    def packed_decoder(self):
        """The fast decode forward over this model's weights (:mod:`vlmspec.targets.packed`).

        Built on first use and again whenever a weight has changed since (in place or replaced).
        """
        if self._packed is None or not self._packed.matches():
            from vlmspec.targets.packed import PackedDecoder

            self._packed = PackedDecoder(self.model)
        return self._packed

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Save model, tokenizer, image processor and chat template so :meth:`from_pretrained` reloads them."""
        path = Path(path)
        self.model.save_pretrained(path)
        self.processor.tokenizer.save_pretrained(path)
        self.processor.image_processor.save_pretrained(path)
        (path / "chat_template.jinja").write_text(self.processor.chat_template or self.tokenizer.chat_template)

    # --------------------------------------------------------------- properties
    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def device(self) -> torch.device:
        return self.output_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.output_head.weight.dtype

    @property
    def input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def output_head(self) -> nn.Linear:
        # The families' heads are the model's `lm_head` child: a dict lookup, where get_output_embeddings walks
        # transformers' accessors (14 us a call; device, dtype and vocab_size read it several times a step).
        head = self.model._modules.get("lm_head")
        return head if head is not None else self.model.get_output_embeddings()

    @property
    def final_norm(self) -> nn.Module:
        return language_model(self.model).norm

    @property
    def vocab_size(self) -> int:
        return self.output_head.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self._text_config.hidden_size

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The language model's decoder layers (read-only use: hooks, a drafter's warm start)."""
        return self._layers

    @property
    def text_config(self):
        """The language model's transformers config (layer shapes, norm eps, rope)."""
        return self._text_config

    @property
    def rope_theta(self) -> float:
        return float(self._text_config.rope_parameters.get("rope_theta", 10000.0))

    @property
    def unused_token_ids(self) -> tuple[int, ...]:
        """Ids no sequence here contains: rows past the tokenizer, then the video placeholder (vlmspec feeds
        no videos), so a drafter's MASK can be an embedding row even without spare rows (``mask_token_id``)."""
        spare = tuple(range(len(self.tokenizer), self.vocab_size))
        video = getattr(self.model.config, "video_token_id", None)
        return spare + ((video,) if video is not None and video < self.vocab_size else ())

    @property
    def max_context(self) -> int:
        return self._text_config.max_position_embeddings

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Tokens that end generation, as the model's generation config lists them."""
        ids = getattr(self.model.generation_config, "eos_token_id", None)
        if ids is None:
            ids = [self.tokenizer.convert_tokens_to_ids("<|im_end|>"), self.tokenizer.eos_token_id]
        ids = [ids] if isinstance(ids, int) else list(ids)
        return tuple(sorted({int(i) for i in ids if i is not None and i >= 0}))

    # ------------------------------------------------------------------- inputs
    def build_inputs(
        self,
        images: ImageLike | Sequence[ImageLike] | None = None,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
    ) -> TargetInputs:
        """Processor inputs for one request: images plus a prompt, or chat messages with image slots."""
        pil_images = load_images(images)
        if messages is None:
            messages = chat_messages(prompt, len(pil_images))
        elif prompt is not None:
            raise ValueError("pass either prompt or messages, not both")
        slots = count_image_slots(messages)
        if slots != len(pil_images):
            raise ValueError(f"the messages have {slots} image slot(s) but {len(pil_images)} image(s) were given")
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        encoded = self.processor(text=[text], images=pil_images or None, return_tensors="pt")
        if encoded["input_ids"].shape[1] >= self.max_context:
            raise ValueError(
                f"the prompt is {encoded['input_ids'].shape[1]} tokens long but the model's context is "
                f"{self.max_context}; shorten the prompt or use smaller images"
            )
        kwargs = {key: value.to(self.device) for key, value in encoded.items() if isinstance(value, torch.Tensor)}
        if "pixel_values" in kwargs:
            kwargs["pixel_values"] = kwargs["pixel_values"].to(self.dtype)
        return TargetInputs(input_ids=kwargs["input_ids"], model_kwargs=kwargs, num_images=len(pil_images))

    def sequence_inputs(self, input_ids: torch.Tensor, images: ImageLike | Sequence[ImageLike] | None = None):
        """Inputs (TargetInputs) of a whole sequence already in tokens ([L] int64, image placeholders included).

        The images go through :meth:`build_inputs`' image processor: the prompt's own vision inputs.
        """
        ids = input_ids.view(1, -1).to(self.device)
        kwargs: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        pil_images = load_images(images)
        if pil_images:
            vision = self.processor.image_processor(images=pil_images, return_tensors="pt")
            kwargs["pixel_values"] = vision["pixel_values"].to(self.device, self.dtype)
            kwargs["image_grid_thw"] = vision["image_grid_thw"].to(self.device)
            kwargs["mm_token_type_ids"] = (ids == self.model.config.image_token_id).long()
            expected = int(kwargs["image_grid_thw"].prod(-1).sum()) // self.processor.image_processor.merge_size**2
            found = int(kwargs["mm_token_type_ids"].sum())
            if found != expected:
                raise ValueError(
                    f"the sequence has {found} image placeholder tokens but its {len(pil_images)} image(s) make "
                    f"{expected}: pass the images the sequence was built with, in order"
                )
        return TargetInputs(input_ids=ids, model_kwargs=kwargs, num_images=len(pil_images))

    # ---------------------------------------------------------------- forwards
    def check_feature_layers(self, layers: Sequence[int]) -> tuple[int, ...]:
        """Validate hook layer ids: existing decoder layers, never the final one."""
        layers = tuple(int(i) for i in layers)
        last = self.num_layers - 1
        for i in layers:
            if not 0 <= i < last:
                raise ValueError(
                    f"feature layer {i} is not allowed: use decoder layers 0..{last - 1}. The final layer ({last}) is "
                    "refused because transformers reports it after the final norm, unlike every other layer, so "
                    "training caches and inference would disagree."
                )
        return layers

    @torch.no_grad()
    def prefill(
        self,
        inputs: TargetInputs,
        *,
        feature_layers: Sequence[int] = (),
        position_rule: str = DEFAULT_POSITION_RULE,
    ) -> tuple[RequestState, TargetStep]:
        """Run the prompt (with its images) and open a request.

        Returns the request state and a step whose logits hold only the last prompt
        token's prediction ([1, V]) while features and positions cover the whole prompt.
        """
        from transformers import DynamicCache

        layers = self.check_feature_layers(feature_layers)
        check_position_rule(position_rule)
        mrope, rope_delta = prompt_positions(self.model, inputs)
        positions_1d = drafter_positions(self.model, inputs, mrope, position_rule)
        state = RequestState(
            cache=DynamicCache(config=self.model.config),
            rope_delta=rope_delta,
            length=0,
            feature_layers=layers,
            position_rule=position_rule,
            prompt_length=inputs.length,
        )
        kwargs = {k: v for k, v in inputs.model_kwargs.items() if k not in ("input_ids", "attention_mask")}
        logits, features = self._forward(state, inputs.input_ids, mrope, logits_to_keep=1, **kwargs)
        state.length = inputs.length
        return state, TargetStep(logits=logits[0], features=features, positions=positions_1d)

    @torch.no_grad()
    def verify(self, state: RequestState, tokens: Sequence[int] | torch.Tensor) -> TargetStep:
        """One forward over ``tokens`` appended after the committed ones.

        Returns logits for every input ([n, V]: row i predicts the token after input i).
        Call :meth:`rollback` afterwards to keep the accepted prefix.
        """
        if state.broken:
            raise RuntimeError("this request's cache was corrupted by an earlier error; start a new request")
        if state.uncommitted:
            raise RuntimeError("verify() called twice without rollback(); call rollback(state, keep) first")
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(1, -1)
        n = ids.shape[1]
        if state.length + n > self.max_context:
            raise ValueError(f"generation reached the model's context length ({self.max_context} tokens)")
        index = torch.arange(state.length, state.length + n, device=self.device)
        mrope = (index + state.rope_delta).view(1, 1, n).expand(3, 1, n)
        logits, features = self._forward(state, ids, mrope)
        state.length += n
        state.uncommitted = n
        return TargetStep(logits=logits[0], features=features, positions=(index + state.rope_delta).cpu())

    def rollback(self, state: RequestState, keep: int) -> None:
        """Keep the first ``keep`` tokens of the last verify in the cache and drop the rest."""
        assert 0 <= keep <= state.uncommitted, (keep, state.uncommitted)
        drop = state.uncommitted - keep
        if drop:
            state.cache.crop(-drop)  # DynamicCache.crop takes a negative count from the end
        state.length -= drop
        state.uncommitted = 0

    @torch.no_grad()
    def forward_sequence(
        self, inputs: TargetInputs, feature_layers: Sequence[int], position_rule: str = DEFAULT_POSITION_RULE
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Features, final-norm hidden states and 1-D positions of a whole sequence (for training caches).

        Returns features [L, m * d], last_hidden [L, d] (after the final norm, before the
        LM head) and positions [L].
        """
        layers = self.check_feature_layers(feature_layers)
        mrope, _ = prompt_positions(self.model, inputs)
        positions_1d = drafter_positions(self.model, inputs, mrope, position_rule)
        kwargs = {k: v for k, v in inputs.model_kwargs.items() if k not in ("input_ids", "attention_mask")}
        with self._capture([*layers], final_norm=True) as captured:
            self.model(
                input_ids=inputs.input_ids,
                position_ids=self._with_text_row(mrope, 0),
                use_cache=False,
                logits_to_keep=1,
                **kwargs,
            )
        features = torch.cat([captured[i][0] for i in layers], dim=-1) if layers else None
        return features, captured["norm"][0], positions_1d

    def text_positions(self, inputs: TargetInputs, position_rule: str = DEFAULT_POSITION_RULE) -> torch.Tensor:
        """1-D text-stream positions [L] of a whole sequence (the drafter's positions), without a forward."""
        check_position_rule(position_rule)
        mrope, _ = prompt_positions(self.model, inputs)
        return drafter_positions(self.model, inputs, mrope, position_rule)

    def row_prompt(self, inputs: TargetInputs, position_rule: str = DEFAULT_POSITION_RULE) -> RowPrompt:
        """A prompt for the runner's prefill (:meth:`RaggedBatch.prefill`): its images through the vision tower.

        The M-RoPE positions and rope_delta are this request's own; ``position_rule`` sets the
        drafter's 1-D positions of the image tokens (:mod:`vlmspec.targets.positions`).
        """
        return row_prompt(self.model, self.spec, inputs, position_rule, self.vision_cache)

    # ---------------------------------------------------------------- internals
    @torch.inference_mode()
    def generate_greedy(self, inputs: TargetInputs, max_new_tokens: int, **options) -> list[int]:  # -> new ids
        """transformers' own ``generate()``, greedy, stopping on this target's EOS ids: the baseline users know.

        Any sampling settings in the checkpoint's generation config are overridden; ``options``
        go to ``generate()`` (e.g. ``prompt_lookup_num_tokens``: transformers' prompt lookup).
        """
        eos = list(self.eos_token_ids)
        output = self.model.generate(
            **inputs.model_kwargs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            temperature=None,
            top_k=None,
            top_p=None,
            repetition_penalty=1.0,
            eos_token_id=eos,
            pad_token_id=eos[0],
            **options,
        )
        return output[0, inputs.length :].tolist()

    @staticmethod
    def _with_text_row(mrope: torch.Tensor, start: int) -> torch.Tensor:
        """Prepend the plain cache-index row the language model uses for masks: [3, 1, n] -> [4, 1, n]."""
        n = mrope.shape[-1]
        text_row = torch.arange(start, start + n, device=mrope.device).view(1, 1, n)
        return torch.cat([text_row, mrope], dim=0)

    def _forward(self, state: RequestState, ids: torch.Tensor, mrope: torch.Tensor, logits_to_keep: int = 0, **kwargs):
        try:
            with self._capture(state.feature_layers) as captured:
                out = self.model(
                    input_ids=ids,
                    position_ids=self._with_text_row(mrope, state.length),
                    **{self._cache_kwarg: state.cache},
                    use_cache=True,
                    logits_to_keep=logits_to_keep,
                    **kwargs,
                )
        except Exception:
            state.broken = True  # a failed forward can leave some cache layers one entry longer
            raise
        features = torch.cat([captured[i][0] for i in state.feature_layers], dim=-1) if state.feature_layers else None
        return out.logits.float(), features

    @contextmanager
    def _capture(self, layers: Sequence[int], final_norm: bool = False):
        """Forward hooks that record decoder-layer outputs (and optionally the final norm's)."""
        captured: dict = {}
        handles = []

        def keep(key):
            def hook(module, args, output):
                captured[key] = output[0] if isinstance(output, tuple) else output

            return hook

        for i in layers:
            handles.append(self._layers[i].register_forward_hook(keep(i)))
        if final_norm:
            handles.append(self.final_norm.register_forward_hook(keep("norm")))
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()


def prefill_output(inputs: TargetInputs, step: TargetStep, rope_delta: int = 0) -> PrefillOutput:
    """What ``SpecDecoder.start`` needs from a prefill (``rope_delta``: the request state's; 0 for text)."""
    return PrefillOutput(
        token_ids=inputs.input_ids[0].cpu(),
        positions=step.positions,
        features=step.features,
        logits=step.logits[-1],
        next_position=inputs.length + rope_delta,  # decoding continues at cache index + rope_delta
    )
