"""Target adapters: the only part of vlmspec that knows Hugging Face and M-RoPE."""

from vlmspec.target.adapter import QwenVLTarget, RequestState, TargetStep, load_target, prefill_output
from vlmspec.target.inputs import TargetInputs, load_image
from vlmspec.target.positions import DEFAULT_POSITION_RULE, POSITION_RULES, text_stream_positions
from vlmspec.target.ragged import RaggedBatch, RaggedStep

__all__ = [
    "QwenVLTarget",
    "load_target",
    "prefill_output",
    "RaggedBatch",
    "RaggedStep",
    "RequestState",
    "TargetStep",
    "TargetInputs",
    "load_image",
    "DEFAULT_POSITION_RULE",
    "POSITION_RULES",
    "text_stream_positions",
]
