"""The KV memory budget: how many bytes the runner's KV pool may hold, and whether a request fits.

A budget is given in bytes (``2_000_000_000``, ``"256MB"``, ``"2GiB"``) or as a fraction of
the machine's RAM (``0.25``). Without one, the engine takes half of the memory available
when it starts (``/proc/meminfo``'s MemAvailable, or psutil's): the pool only grows as rows
need blocks, so an unused budget costs nothing, but a burst of long prompts can no longer
take the machine.

Admission by blocks, as vLLM does: a waiting request joins when the blocks of its prompt fit
beside what the decoding requests' next step may take (their anchor and most drafts each);
its prompt's blocks are taken at once, so its prefill chunks never run short. When decoding
requests outgrow the pool, the latest to join is preempted: its blocks go back (its full ones
stay in the prefix cache while room allows), it waits at the head of the queue, and when it
fits again it recomputes its prompt and answer and goes on from its last token, with the
output it gets alone. A request whose prompt plus ``max_new_tokens`` (capped by the context,
:func:`blocks_needed`) exceeds the whole budget could never finish; ``BatchEngine.add_request``
refuses it with a ValueError that names the budget (the server answers 400).
"""

from __future__ import annotations

import os
import re

# Without a budget: this share of the RAM available when the engine starts.
DEFAULT_MEMORY_FRACTION_OF_AVAILABLE = 0.5

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_kv_cache_memory(text: str) -> int | float:
    """A ``--kv-cache-memory`` value: bytes (``"268435456"``, ``"256MB"``, ``"2GiB"``) or a RAM fraction (``"0.25"``)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"--kv-cache-memory takes bytes (e.g. 268435456, 256MB, 2GiB) or a fraction of RAM (e.g. 0.25), "
            f"got {text!r}"
        )
    number = float(match.group(1))
    if unit == "" and number < 1:
        return number  # a fraction of RAM
    return int(number * _UNITS[unit])


def kv_budget_bytes(memory: int | float | None) -> int:
    """Bytes for the KV pool: ``memory`` bytes (int), a fraction of RAM (float in (0, 1]), or the default (None)."""
    if memory is None:
        return int(DEFAULT_MEMORY_FRACTION_OF_AVAILABLE * _available_ram())
    if isinstance(memory, bool) or not isinstance(memory, int | float):
        raise TypeError(f"kv_cache_memory must be bytes (int), a fraction of RAM (float) or None, got {memory!r}")
    if isinstance(memory, float):
        if not 0 < memory <= 1:
            raise ValueError(f"kv_cache_memory as a fraction of RAM must be in (0, 1], got {memory}")
        return int(memory * _total_ram())
    if memory <= 0:
        raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {memory}")
    return memory


def blocks_needed(prompt_tokens: int, max_new_tokens: int, max_context: int, block_size: int) -> int:
    """Blocks a request can ever hold: its prompt and every token it may generate, within the context.

    A verify writes the anchor and drafts up to the request's remaining ``max_new_tokens``
    (the plan cuts drafts there), so a row never holds more than prompt + max_new_tokens slots.
    """
    tokens = min(prompt_tokens + max_new_tokens, max_context)
    return -(-tokens // block_size)


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.virtual_memory().available)


def _total_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        import psutil

        return int(psutil.virtual_memory().total)
