"""Target adapters: the only part of vlmspec that knows Hugging Face and M-RoPE."""

from vlmspec.targets.adapter import QwenVLTarget, RequestState, TargetStep, prefill_output
from vlmspec.targets.inputs import TargetInputs, load_image
from vlmspec.targets.positions import DEFAULT_POSITION_RULE, POSITION_RULES, text_stream_positions
from vlmspec.targets.prompts import RowPrompt
from vlmspec.targets.ragged import RaggedBatch, RaggedStep

__all__ = [
    "QwenVLTarget",
    "prefill_output",
    "RaggedBatch",
    "RaggedStep",
    "RowPrompt",
    "RequestState",
    "TargetStep",
    "TargetInputs",
    "load_image",
    "DEFAULT_POSITION_RULE",
    "POSITION_RULES",
    "text_stream_positions",
]
