"""What one request may cost the server, checked before the work it would cause.

Every limit is a field of :class:`RequestLimits` (``ServerConfig(limits=...)``) and a flag of
``vlmspec serve`` (:data:`FLAGS`); a request over one gets a 4xx whose message names the
flag. The order of the checks is the order of the costs they guard:

1. **admission** (429 with ``Retry-After``): before the body is read, so a full server
   spends nothing on a request it will not run;
2. **the body** (413, ``max_body_bytes``): ``Content-Length`` before reading, and the bytes
   counted while reading (reading stops at the cap);
3. **the JSON fields** (400): ``n`` (``max_choices``), stop strings (``max_stop_strings``,
   ``max_stop_length``), ``logit_bias`` (``max_logit_bias``), the number of images (``max_images``);
4. **the images' headers** (400): each image's encoded size and pixels
   (:class:`~vlmspec.targets.inputs.ImageLimits`) and the request's total pixels
   (``max_total_pixels``), all read before any image is decoded;
5. **the prompt** (400, ``max_prompt_tokens``): a text longer than that many tokens could
   span is refused before tokenising; otherwise the tokenised prompt is checked. Images
   are decoded and prompts tokenised on the server's preprocessing thread, never on the
   engine's, one request at a time.

Memory a hostile client can claim is then bounded by these numbers: see the limits table
in docs/serving.md ("Limits").
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# The vlmspec serve flag that sets each field (error messages name it).
FLAGS = {
    "max_body_bytes": "--max-request-bytes",
    "max_images": "--max-images-per-request",
    "max_total_pixels": "--max-request-pixels",
    "max_prompt_tokens": "--max-prompt-tokens",
    "max_stop_strings": "--max-stop-strings",
    "max_stop_length": "--max-stop-length",
    "max_choices": "--max-choices",
    "max_logit_bias": "--max-logit-bias",
}
RETRY_AFTER_S = 1  # what a 429 tells a client to wait: a decode step takes well under a second


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one chat-completions request (each image's own caps are :class:`~vlmspec.targets.inputs.ImageLimits`).

    * ``max_body_bytes`` 50 MiB: the request body, as OpenAI caps a request's images (50 MB).
    * ``max_images`` 8 and ``max_total_pixels`` 80,000,000: a request's images together
      (two images at the per-image cap), read from their headers before any is decoded.
    * ``max_prompt_tokens`` None: the model's context less one (room for one answer token).
    * ``max_stop_strings`` 4 (OpenAI's limit) and ``max_stop_length`` 256 characters: every
      step matches the stop strings against the answer's tail.
    * ``max_choices`` 8: ``n``; each choice is a request of its own and takes a place.
    * ``max_logit_bias`` 300: tokens a ``logit_bias`` may name (each is added to the logits every step).
    """

    max_body_bytes: int = 50 * 1024 * 1024
    max_images: int = 8
    max_total_pixels: int = 80_000_000
    max_prompt_tokens: int | None = None
    max_stop_strings: int = 4
    max_stop_length: int = 256
    max_choices: int = 8
    max_logit_bias: int = 300

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None and field.name == "max_prompt_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"RequestLimits.{field.name} ({FLAGS[field.name]}) must be an integer >= 1, got {value!r}"
                )

    def prompt_tokens(self, context: int) -> int:
        """The prompt-length cap for a model of ``context`` tokens (one slot stays for the answer)."""
        room = context - 1
        return room if self.max_prompt_tokens is None else min(self.max_prompt_tokens, room)


DEFAULT_REQUEST_LIMITS = RequestLimits()
