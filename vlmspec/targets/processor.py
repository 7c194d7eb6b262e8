"""Qwen-VL processors without a video processor: the loading code and the one transformers patch it needs.

vlmspec answers questions about images; it never processes video. A Qwen-VL processor is
therefore assembled from its tokenizer, image processor and chat template with
``video_processor=None`` (``AutoProcessor`` would build the video processor, which needs
torchvision). :func:`allow_processor_without_video` lets transformers accept that None.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def allow_processor_without_video() -> None:
    """Let a Qwen-VL processor be built with ``video_processor=None`` (idempotent; a global patch).

    What it works around (transformers 5.x): ``ProcessorMixin.__init__`` checks every
    sub-processor with ``check_argument_for_proper_class``. For ``video_processor`` that
    resolves ``VideoProcessorMixin``, which transformers only provides when torchvision is
    installed, and torchvision cannot be imported beside the CPU torch wheel; without it
    the lookup fails (``VIDEO_PROCESSOR_MAPPING`` is a dummy object), and with it a None
    argument still fails the ``isinstance`` check. The patch skips the check for a None
    video processor only; every other argument is checked as before.

    When it can go: once transformers accepts ``video_processor=None`` for the Qwen-VL
    processors (an optional sub-processor), or once vlmspec builds the real video processor
    (torchvision importable beside the torch it runs on).
    """
    from transformers import ProcessorMixin

    original = ProcessorMixin.check_argument_for_proper_class
    if getattr(original, "_vlmspec_patched", False):
        return

    def check(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return original(self, argument_name, argument)

    check._vlmspec_patched = True
    ProcessorMixin.check_argument_for_proper_class = check


def load_processor(path: str | os.PathLike, model_type: str):
    """The Qwen-VL processor of a local model directory, built from its parts.

    ``AutoProcessor`` would also build the video processor, which needs torchvision;
    images never need it, so the processor is assembled from the tokenizer, the image
    processor and the chat template with ``video_processor=None``.
    """
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    from vlmspec.targets.families import family_spec

    allow_processor_without_video()
    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
    processor_class = getattr(transformers, family_spec(model_type).processor)
    return processor_class(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=_chat_template(path, tokenizer),
    )


def _chat_template(path: Path, tokenizer) -> str:
    """The processor's chat template (chat_template.jinja / .json), else the tokenizer's."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").is_file():
        return json.loads((path / "chat_template.json").read_text())["chat_template"]
    if tokenizer.chat_template:
        return tokenizer.chat_template
    raise ValueError(f"no chat template in {str(path)!r}: add chat_template.jinja (the model's processor template)")
