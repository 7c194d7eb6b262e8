"""CPU kernels for decode and verify steps on x86 (AVX2 + FMA, AVX-512 where present): linears, RMSNorm, attention.

A decode step of a small model on a CPU is mostly ``x @ W.T`` for one to eight rows of
``x``: its cost is the time to read ``W`` from memory. Neither library torch ships reads
it at the machine's bandwidth for so few rows. On the 2-core AMD EPYC (AVX2) of this
project's tests, for the reference target's LM head (576 x 49,156, float32; a torch sum
reads 21 GB/s there):

=========================  ==========  ==========
                           1 row       8 rows
=========================  ==========  ==========
ATen ``F.linear``           8.5 GB/s    3.1 GB/s
oneDNN, weight reordered   11.5 GB/s    5.4 GB/s
this kernel                  18 GB/s    7-9 GB/s
=========================  ==========  ==========

and bfloat16 weights, which oneDNN cannot use without native bfloat16, are read at half
the bytes (``benchmarks/target_step.py`` measures every linear of the model and the
whole step, per backend). The kernel reads the
model's own weight tensors, so it needs no packed copy.

On CPUs with AVX-512 the linears take a 512-bit form chosen at run time, and bfloat16
weights times bfloat16 activations use AVX512-BF16's dot product (``vdpbf16ps``, exact
products summed in float32) over a packed copy of each weight (16 outputs per vector,
k-major), kept on 2 MB pages and written straight in the activations' dtype. On the 2-core
AVX-512 EPYC, a pass over every linear of the reference target in bfloat16 (outside
Python) read at 31 GB/s for one row and 23 for eight from 4 KB pages, 39 and 29 from huge
pages (best of 21 interleaved passes, a shared machine); an 8-row tile of 3 weight blocks by
8 activation rows reads the weights once for a whole verify. ``VLMSPEC_CPU_ISA=avx2`` holds
such a CPU to the AVX2 form (tests, A/B timings).

That tile is compute-bound from about 8 rows (~115 GFLOPS a core). On CPUs with AMX-BF16
(Intel Xeon from Sapphire Rapids on), the bfloat16 packed linears run on the tile unit instead,
from one row on (:func:`kernel_uses_amx`): the packed layout is AMX's weight-tile layout, one
tile multiply takes 16 rows of x against 16 outputs over 32 k, and 4 blocks of outputs share
each load of x. One thread on the 2-core AMX Xeon, weights read from memory: the LM head
[49152, 576] took 3.9 / 3.9 / 4.1 / 6.6 ms at 1 / 8 / 16 / 64 rows on the tiles, against 3.9 /
6.4 / 10.2 / 35 with ``vdpbf16ps`` and 6.7 / 7.7 / 7.9 / 10.4 for ATen's (oneDNN's AMX) GEMM, so
a verify and a batched decode step of up to 16 rows read their weights at a one-row step's cost
and the kernel keeps bfloat16 up to :data:`MAX_ROWS` (64). Every bfloat16 call takes the tiles,
so a row's result does not depend on how many rows share its call (the tiles' float32 sums are
ordered otherwise than ``vdpbf16ps``'s: a few outputs in 10,000 differ by one bfloat16 step).
Linux grants the tiles per process (``arch_prctl``, asked once); ``VLMSPEC_CPU_ISA=avx512_bf16``
holds such a CPU to ``vdpbf16ps``, and then bfloat16 past a few rows goes to ATen's GEMM
(:func:`kernel_max_rows`, :func:`linear_max_rows`).

:func:`decode_attention` attends a few new tokens per row over their row's KV buffer,
where SDPA's CPU kernel spends 150-200 us a layer on one token and a few hundred keys.
It reads bfloat16 K/V as stored (``vdpbf16ps`` scores on AVX512-BF16), allocates nothing
but its output and splits (token, head) tasks over the threads: the reference target's 30
layers over 256 cached keys take about 0.3 ms for one token and 1.3 ms for eight (before:
0.9 and 3.6 ms, best of a shared machine's runs).
:func:`paged_attention` is the same attention over a block-paged KV pool (each row's slots read
through its block table: the runner's pool, :mod:`vlmspec.targets.pool`); a contiguous buffer is
the pool with one block a row, which is what :func:`decode_attention` reads.
:func:`rope_write` rotates q and k and writes the new K/V in one call (at a block and an offset
in it, or a row and a slot of a contiguous buffer).
:func:`decoder_layers` runs every decoder layer of a step in one call: these kernels, called
from C++ in the order of the Python reference (``cpu_step.cpp``; see :mod:`vlmspec.targets.packed`),
over the layers' named weights (:func:`decoder_weights`, built once when a decoder packs). Its
linears are packed (AVX-512), and the whole step runs in one parallel region: the threads make
the same kernel calls as a team, each its share (a linear's blocks pulled from a shared counter),
with a barrier between calls instead of a fork and a join per call, into buffers allocated once
per step; bit for bit the reference's results.

The kernels (``cpu_linear.cpp`` and ``cpu_packed.cpp``: the linears; ``cpu_kernels.cpp``: norm,
RoPE + KV write and the registrations; ``cpu_attention.cpp``; ``cpu_step.cpp``: the native step;
``cpu_sampling.cpp`` and ``cpu_rejection.cpp``: the sampler; ``cpu_draft.cpp``, ``cpu_draft_attention.cpp`` and ``cpu_draft_head.cpp``: a DSpark
drafting round in one call, see :mod:`vlmspec.drafters.dspark.native`; the headers ``cpu_common.h``,
``cpu_layers.h`` and ``cpu_draft.h``) are
compiled on first use, once per machine and torch version, into ``$VLMSPEC_CACHE/kernels``
(about 20 s; needs a C++ compiler, which ``scripts/setup.sh`` installs, and ninja, which
``pip install vlmspec`` brings; the compiler is ``c++`` or ``$CXX``, torch's convention).
Where it cannot be built or run, :func:`skinny_linear` is unavailable and the fast forward
falls back to oneDNN or ATen (about 2x slower a step), with one warning that says why.
``VLMSPEC_CPU_KERNEL=0`` turns it off. Whether the kernel is available is decided once per process
(:func:`kernel_available`, cached; ``kernel_available.cache_clear()`` decides again, e.g.
after a test changed the environment), and a target or drafter picks its linears' backend
when it packs its weights, so objects built before such a change keep their backend.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
import warnings
from pathlib import Path

import torch

from vlmspec.paths import default_cache_dir

KERNEL_ENV = "VLMSPEC_CPU_KERNEL"
# "avx2" holds an AVX-512 CPU to the AVX2 kernels, "avx512_bf16" an AMX CPU to vdpbf16ps (no tiles); read by
# the kernel at each call: for tests and A/B timings.
ISA_ENV = "VLMSPEC_CPU_ISA"
SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "cpu_kernels.cpp",
        "cpu_attention.cpp",
        "cpu_linear.cpp",
        "cpu_packed.cpp",
        "cpu_step.cpp",
        "cpu_sampling.cpp",
        "cpu_rejection.cpp",
        "cpu_draft.cpp",
        "cpu_draft_attention.cpp",
        "cpu_draft_head.cpp",
    )
)
HEADERS = tuple(Path(__file__).with_name(name) for name in ("cpu_common.h", "cpu_layers.h", "cpu_draft.h"))
# Measured on the AVX2 EPYC, a pass over every linear of the reference target: the kernel
# beats ATen's GEMM at every row count up to 64 (float32 223 against 333 ms at 64 rows,
# bfloat16 252 against 1,051). Past that, products become compute bound and a GEMM library
# is the tool it was built for (large batches of requests, prefill). On a CPU with AMX-BF16 the
# kernel runs bfloat16 on the tile unit (cpu_packed.cpp, kernel_uses_amx) from one row on, and keeps
# this limit too: one thread, on a 2-core AMX Xeon shared with other work (indicative), each call
# reading its weight from memory (copies of it cycled, ~384 MB in all), ms at 1 / 8 / 16 / 32 / 64 rows:
#   [3072, 576]   tiles 0.256 / 0.262 / 0.257 / 0.315 / 0.410, vdpbf16ps 0.250 / 0.391 / 0.672 / 1.20 / 2.24,
#                 ATen 0.480 / 0.568 / 0.555 / 0.599 / 0.743
#   [576, 1536]   tiles 0.130 / 0.118 / 0.124 / 0.153 / 0.190, ATen 0.198 / 0.191 / 0.204 / 0.216 / 0.286
#   [1152, 576]   tiles 0.103 / 0.095 / 0.091 / 0.114 / 0.150, ATen 0.205 / 0.207 / 0.209 / 0.227 / 0.264
#   [49152, 576]  tiles 3.86 / 3.91 / 4.06 / 4.93 / 6.64, vdpbf16ps 3.87 / 6.42 / 10.2 / 18.9 / 34.7,
#                 ATen 6.66 / 7.75 / 7.86 / 8.52 / 10.4
# (the tiles still led at 96 and 128 rows: 0.55 / 0.61 against ATen's 0.77 / 0.80 ms for [3072, 576]; the
# limit stays 64, where prefill chunks and the Python reference's paths were measured).
MAX_ROWS = 64
# Where the CPU has AMX-BF16 but the kernel runs without its tiles (VLMSPEC_CPU_ISA=avx512_bf16, Linux
# refused the permission, a compiler without AMX), oneDNN still runs ATen's bfloat16 GEMM on the tile
# unit, and it overtakes the vdpbf16ps kernel early. Measured on such a 2-core Xeon, one thread, a
# [3072, 576] weight: the kernel 0.26 / 0.50 / 1.96 ms at 8 / 16 / 64 rows, ATen 0.26 / 0.26 / 0.42;
# the LM head [49152, 576]: 5.2 / 8.7 / 36 against 4.3 / 4.4 / 8.2 (at one row the kernel still
# wins: 2.1 against 3.9). A whole step also loses the native layer loop past the limit, so the
# crossover is later: a verify of the reference target (bfloat16, about 250 tokens of context, two
# threads, a loaded machine) took 22.7 / 34.5 / 58.5 ms with the kernel for 9 / 16 / 32 tokens, and
# 32.5 / 40.1 / 45.4 ms with ATen's GEMM in the Python loop. float32 has no tile path: the kernel
# stays ahead to 64 rows there too.
AMX_BF16_MAX_ROWS = 16
# A linear called on its own (the LM head after the layers, the Python reference's linears) has no
# native layer loop to keep, so without the kernel's tiles it goes to ATen's GEMM sooner: quiet machine,
# two threads, the LM head [49152, 576] took 2.42 / 3.71 / 6.31 ms on the kernel at 6 / 8 / 16 rows
# against ATen's 2.42 / 2.41 / 2.64 (at 1 row the kernel: 1.17 against 2.32); a [3072, 576] weight 0.155
# against 0.145 at 8 rows.
AMX_BF16_LINEAR_MAX_ROWS = 7
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# No contraction of a * b + c into one FMA outside the explicit intrinsics: rms_norm and
# rope_write must round as transformers' separate tensor ops do.
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off")


def kernel_max_rows(dtype: torch.dtype) -> int:
    """The most rows the native step takes in ``dtype`` here; past them the layers run ATen's GEMM."""
    return AMX_BF16_MAX_ROWS if _only_aten_has_tiles(dtype) else MAX_ROWS


def linear_max_rows(dtype: torch.dtype) -> int:
    """The most rows a linear called on its own runs on the kernel in ``dtype`` here; past them ATen's GEMM."""
    return AMX_BF16_LINEAR_MAX_ROWS if _only_aten_has_tiles(dtype) else MAX_ROWS


def _only_aten_has_tiles(dtype: torch.dtype) -> bool:
    """Whether ATen's GEMM runs ``dtype`` on AMX tiles here and the kernel does not (see AMX_BF16_MAX_ROWS)."""
    if dtype != torch.bfloat16 or not cpu_has_amx_bf16():
        return False
    return not (kernel_available() and kernel_uses_amx())


@functools.cache
def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX-BF16 tiles (read from Linux's /proc/cpuinfo; False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as info:
            return any(line.startswith("flags") and " amx_bf16" in line for line in info)
    except OSError:
        return False


def kernel_applies(weight: torch.Tensor) -> bool:
    """Whether :func:`skinny_linear` can multiply by this weight here (CPU, float32/bfloat16, kernel built)."""
    return weight.device.type == "cpu" and weight.dtype in SUPPORTED_DTYPES and kernel_available()


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` [M, K] with few rows, summed in float32, in ``x``'s dtype."""
    return torch.ops.vlmspec.skinny_linear(x, weight, bias)  # [M, N]


def kernel_isa() -> str:
    """The form the linears take here: ``"avx512_bf16"``, ``"avx512"`` or ``"avx2"`` (after ``VLMSPEC_CPU_ISA``).

    On top of ``"avx512_bf16"``, the bfloat16 packed linears may run on AMX tiles: :func:`kernel_uses_amx`.
    """
    return torch.ops.vlmspec.kernel_isa()


def kernel_uses_amx() -> bool:
    """Whether the bfloat16 packed linears run on AMX-BF16 tiles here (not under ``VLMSPEC_CPU_ISA=avx512_bf16``)."""
    return torch.ops.vlmspec.kernel_uses_amx()


def packing_applies(weight: torch.Tensor) -> bool:
    """Whether :func:`pack_weight` and :func:`packed_linear` serve this weight here (AVX-512; AVX512-BF16 for bf16)."""
    if not kernel_applies(weight):
        return False
    isa = kernel_isa()
    return isa == "avx512_bf16" if weight.dtype == torch.bfloat16 else isa.startswith("avx512")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:  # [N, K] -> [ceil(N / 16), ceil(K / p), 16, p]
    """A copy of ``weight`` in the packed layout of :func:`packed_linear` (16 outputs per vector, k-major)."""
    return torch.ops.vlmspec.pack_weight(weight.detach())


def packed_linear(
    x: torch.Tensor,  # [M, K] in the packed weight's dtype
    packed: torch.Tensor,  # from pack_weight
    out_features: int,  # N
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ W.T + bias`` over a packed ``W``: no horizontal sums, 8 rows of x per pass over the weights."""
    return torch.ops.vlmspec.packed_linear(x, packed, out_features, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., d] -> [..., d]
    """Qwen-VL's RMSNorm in one call, with transformers' roundings: ``weight * (x * rsqrt(mean(x^2) + eps))``.

    ``x`` and ``weight`` share a dtype (float32 or bfloat16); the sum of squares is float32.
    """
    return torch.ops.vlmspec.rms_norm(x, weight, eps)


def decode_attention(
    query: torch.Tensor,  # [B, H, hd] packed, rotated queries
    keys: torch.Tensor,  # [R_cap, Hkv, S_cap, hd] one layer's KV buffer, new keys written
    values: torch.Tensor,  # [R_cap, Hkv, S_cap, hd]
    rows: torch.Tensor,  # [B] int64 buffer row of each query
    visible: torch.Tensor,  # [B] int64 slots it attends: 0 .. visible - 1
    scaling: float,
) -> torch.Tensor:  # [B, H, hd] in query's dtype
    """Each query over its row's first ``visible`` slots (softmax in float32), for a few new tokens.

    Needs contiguous buffers and a head dim that is a multiple of 8 (see :func:`attention_applies`).
    """
    return torch.ops.vlmspec.decode_attention(query, keys, values, rows, visible, scaling)


def paged_attention(
    query: torch.Tensor,  # [B, H, hd] packed, rotated queries
    keys: torch.Tensor,  # [N, Hkv, bs, hd] one layer's block pool, new keys written
    values: torch.Tensor,  # [N, Hkv, bs, hd]
    tables: torch.Tensor,  # [R, M] int64 each row's blocks in order: slot j is in block tables[r, j // bs]
    rows: torch.Tensor,  # [B] int64 row of each query
    visible: torch.Tensor,  # [B] int64 slots it attends: 0 .. visible - 1 of its row
    scaling: float,
) -> torch.Tensor:  # [B, H, hd] in query's dtype
    """:func:`decode_attention` over a block-paged KV pool: each row's slots are read through its block table.

    Slot j of row r is at ``keys[tables[r, j // bs], :, j % bs]``. ``bs`` must be a power of
    two and a multiple of 16 (the kernel reads 16 slots at a time from one block), unless
    each row has one block (``M == 1``: a contiguous buffer, any ``bs``). The sums run over
    the slots in the same order as :func:`decode_attention`'s: the same result bit for bit.
    """
    return torch.ops.vlmspec.paged_attention(query, keys, values, tables, rows, visible, scaling)


def rope_write(
    qkv: torch.Tensor,  # [B, (H + 2 Hkv) * hd] one layer's fused q/k/v projections
    cos: torch.Tensor,  # [B, hd] in qkv's dtype
    signed_sin: torch.Tensor,  # [B, hd] the sin with its first half negated
    keys: torch.Tensor,  # [N, Hkv, bs, hd] written at [rows[b], :, slots[b]] (a pool: block, offset in it)
    values: torch.Tensor,  # [N, Hkv, bs, hd]
    rows: torch.Tensor,  # [B] int64 block (a contiguous buffer: row) of each token
    slots: torch.Tensor,  # [B] int64 offset in that block (a contiguous buffer: slot)
    heads: int,
) -> torch.Tensor:  # q [B, H, hd], rotated
    """RoPE on q and k (transformers' roundings) and the K/V write into the buffers, in one call."""
    return torch.ops.vlmspec.rope_write(qkv, cos, signed_sin, keys, values, rows, slots, heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [B, 2I] (gate, then up) -> [B, I]
    """``silu(gate) * up`` in one call, rounded as the two tensor ops round (SiLU in float32, then x's dtype)."""
    return torch.ops.vlmspec.silu_mul(gate_up)


#: The names of one decoder layer's tensors in :func:`decoder_weights` (``*_bias`` optional).
LAYER_TENSORS = (
    "input_norm",
    "qkv",
    "qkv_bias",
    "out",
    "out_bias",
    "post_norm",
    "gate_up",
    "gate_up_bias",
    "down",
    "down_bias",
)
#: The linears of a layer, whose output sizes :func:`decoder_weights` takes by these names.
LAYER_LINEARS = ("qkv", "out", "gate_up", "down")


def decoder_weights(
    layers: list[dict[str, torch.Tensor]],  # per layer: LAYER_TENSORS by name (None or absent: no bias)
    out_features: list[dict[str, int]],  # per layer: LAYER_LINEARS' output sizes by name
    heads: int,
    head_dim: int,
    eps: float,
    scaling: float,
) -> torch.ScriptObject:
    """The named weight layout of :func:`decoder_layers` (``cpu_layers.h``: DecoderWeights), built once.

    Linear weights are :func:`pack_weight`'s, at their natural input widths; the norms' weights
    are [d]; all in one dtype. Raises RuntimeError naming the tensor that does not fit.
    """
    weights = torch.classes.vlmspec.DecoderWeights(heads, head_dim, eps, scaling)
    for tensors, sizes in zip(layers, out_features, strict=True):
        weights.add_layer({name: t for name, t in tensors.items() if t is not None}, dict(sizes))
    return weights


def decoder_layers(
    weights: torch.ScriptObject,  # from decoder_weights
    hidden: torch.Tensor,  # [B, d] the packed tokens' embeddings
    cos: torch.Tensor,  # [B, hd] in hidden's dtype
    signed_sin: torch.Tensor,  # [B, hd] the sin with its first half negated
    keys: list[torch.Tensor],  # per layer [N, Hkv, bs, hd] block pool (see paged_attention)
    values: list[torch.Tensor],  # per layer [N, Hkv, bs, hd]
    tables: torch.Tensor,  # [R, M] int64 each row's blocks
    rows: torch.Tensor,  # [B] int64 row of each token
    slots: torch.Tensor,  # [B] int64 its slot in its row: written there, attends slots 0 .. slots[b]
    feature_layers: list[int],
    plane: torch.Tensor | None = None,  # [N, bs, m * d] where the feature layers' outputs go, beside the KV
) -> list[torch.Tensor]:  # [hidden after the last layer [B, d], then after each of feature_layers unless plane]
    """Every decoder layer of a packed step in one call: the Python reference's kernel calls, in its order, from C++.

    :class:`vlmspec.targets.packed.PackedDecoder` builds ``weights`` when it packs. With ``plane``
    each token's hooked hidden states are written at its K/V's block and offset (layer j of m in
    columns j * d to (j + 1) * d) and only the last layer's output comes back.
    """
    return torch.ops.vlmspec.decoder_layers(
        weights, hidden, cos, signed_sin, keys, values, tables, rows, slots, feature_layers, plane
    )


def attention_applies(keys: torch.Tensor, head_dim: int) -> bool:
    """Whether :func:`decode_attention` and :func:`paged_attention` can read this KV buffer (or pool) here."""
    return keys.is_contiguous() and head_dim % 8 == 0 and kernel_applies(keys)


@functools.cache
def kernel_available() -> bool:
    """Build (once) and load the kernel; False, with one warning naming the fix, where that fails."""
    if os.environ.get(KERNEL_ENV, "1") == "0":
        return False
    if not _cpu_has_avx2():
        return False
    try:
        _build_and_load()
    except Exception as error:  # a missing compiler or ninja, a read-only cache: fall back, loudly
        warnings.warn(
            f"vlmspec's CPU matrix-vector kernel could not be built ({type(error).__name__}: {error}); "
            "decode steps fall back to oneDNN/ATen and run slower. Install a C++ compiler and ninja "
            f"(apt install g++, as scripts/setup.sh does; pip install ninja), or set {KERNEL_ENV}=0 to silence this.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


def cpu_has_avx512() -> bool:
    """Whether the kernel takes its AVX-512 form here (AVX-512 CPU, not held to AVX2 by ``VLMSPEC_CPU_ISA``)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and os.environ.get(ISA_ENV, "native") != "avx2"


def _cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _build_and_load() -> None:
    from torch.utils.cpp_extension import load

    if _kernel_loaded():  # loading again after the environment changed would register every operator twice: abort
        return
    build_dir = _build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    name = "vlmspec_cpu_kernels"
    library = build_dir / f"{name}.so"
    # Built before (the directory is this source's own): load it without torch's build lock, which even an
    # up-to-date check takes, and which a process killed meanwhile leaves behind for every later one to wait on.
    if library.exists() and _loaded_from(library):
        return
    _wait_for_other_build(build_dir / "lock")
    if not library.exists():
        print("vlmspec: compiling the CPU matrix-vector kernel, once per machine (about 20 s)", file=sys.stderr)
    load(
        name=name,
        sources=[str(source) for source in SOURCES],
        extra_cflags=list(CFLAGS),
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )


# A build takes about 20 s on 2 cores (a few minutes on a loaded machine); a lock older than this was left
# by a build that died (killed, out of memory), and torch's loader would wait for it forever.
STALE_LOCK_S = 900


def _remove_stale_lock(lock: Path) -> bool:
    """Delete a build lock that no live build can hold any more (see STALE_LOCK_S), saying so; whether none is left."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return True
    if age > STALE_LOCK_S:
        warnings.warn(
            f"removing {lock}, left {age / 60:.0f} minutes ago by a kernel build that did not finish; building again",
            RuntimeWarning,
            stacklevel=3,
        )
        lock.unlink(missing_ok=True)
        return True
    return False


def _wait_for_other_build(lock: Path, poll_s: float = 0.5) -> None:
    """Wait while another process builds the kernel (its lock exists), until the lock goes or turns stale.

    torch's loader would wait on a lock forever, also on one that a killed build left; here the wait
    ends when the lock is older than STALE_LOCK_S, and says what it waits for.
    """
    waited = False
    while not _remove_stale_lock(lock):
        if not waited:
            print(
                f"vlmspec: waiting for another process's kernel build ({lock}); a lock older than "
                f"{STALE_LOCK_S // 60} minutes is taken as left by a build that died, and removed",
                file=sys.stderr,
            )
            waited = True
        time.sleep(poll_s)


def _loaded_from(library: Path) -> bool:
    """Load an already built kernel library; False when it cannot be (a build killed while linking)."""
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError):
        return False
    return True


def _kernel_loaded() -> bool:
    """Whether this process already has the kernel's operators (a library loads once per process)."""
    return hasattr(torch.ops.vlmspec, "skinny_linear")


def _build_directory() -> Path:
    """One directory per source and torch version, so that an edit or an upgrade rebuilds."""
    code = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(code + torch.__version__.encode() + " ".join(CFLAGS).encode())
    return default_cache_dir() / "kernels" / digest.hexdigest()[:16]
