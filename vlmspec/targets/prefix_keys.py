"""Content keys of a row's full KV blocks, for the prefix cache (:class:`~vlmspec.targets.pool.PrefixIndex`).

A block's KV depends on every token up to its last one, where each token sits (its M-RoPE
position) and, for an image placeholder, the image it stands for. The key of block b is
therefore a digest of

* the previous block's key (so equal keys mean equal content from the first token on),
* the block's token ids ``[bs]`` and M-RoPE positions ``[3, bs]``,
* the content digest of the image behind each placeholder token in it: two different
  pictures of one size have the same placeholder ids and positions, and only this tells
  them apart (vLLM hashes each image's data into its block keys for the same reason).

The positions carry ``rope_delta`` for the tokens after the prompt (``index + rope_delta``),
so a row's generated tokens key their blocks too: the next turn of a chat, which repeats
them in its prompt, finds them cached. Only full blocks get keys: a block is never written
again once its row has committed all its slots (rollback only moves a row's length within
its last, partial block).
"""

from __future__ import annotations

import hashlib

import numpy as np

from vlmspec.targets.prompts import RowPrompt


class RowContent:
    """What one row's committed slots hold, and the keys of its full blocks, computed as they fill.

    >>> content = RowContent(prompt, block_size=16)   # the whole prompt, start 0
    >>> content.keys_within(prompt.length)             # keys of the prompt's full blocks
    >>> content.extend([17, 42])                       # tokens committed after the prompt
    """

    def __init__(self, prompt: RowPrompt, block_size: int) -> None:
        if prompt.start != 0:
            raise ValueError("RowContent takes a whole prompt (start 0), not a piece of one")
        self.block_size = block_size
        self.cached_blocks = 0  # full blocks the row's owner has handed to the prefix index so far
        self._ids = prompt.ids.cpu().numpy().astype(np.int64)  # [L]
        self._positions = prompt.positions_3d().numpy().astype(np.int64)  # [3, L]
        self._prompt_length = prompt.length
        self._rope_delta = prompt.rope_delta
        self._generated: list[int] = []
        self._image_keys: dict[int, bytes] = {}  # prompt index of a placeholder -> its image's digest
        if prompt.vision is not None:
            self._image_keys = dict(zip(prompt.vision.index.tolist(), prompt.vision.image_keys, strict=True))
            if len(self._image_keys) != prompt.vision.index.numel():
                raise ValueError("the prompt's vision embeddings carry no image keys: build it with row_prompt")
        self._keys: list[bytes] = []

    @property
    def length(self) -> int:
        """Tokens known: the prompt's and the generated ones committed so far."""
        return self._prompt_length + len(self._generated)

    def extend(self, tokens: list[int]) -> None:
        """Tokens committed after the prompt (in order)."""
        self._generated.extend(tokens)

    def keys_within(self, length: int) -> list[bytes]:
        """The keys of every full block among the first ``length`` tokens (``length`` <= :attr:`length`)."""
        if length > self.length:
            raise ValueError(f"only {self.length} tokens of this row are known, not {length}")
        for block in range(len(self._keys), length // self.block_size):
            parent = self._keys[-1] if self._keys else b""
            self._keys.append(self._block_key(parent, block * self.block_size))
        return self._keys[: length // self.block_size]

    def _block_key(self, parent: bytes, start: int) -> bytes:
        end = start + self.block_size
        ids, positions = self._slice(start, end)
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(ids.tobytes())
        digest.update(positions.tobytes())
        for index in range(start, min(end, self._prompt_length)):
            image = self._image_keys.get(index)
            if image is not None:
                digest.update(index.to_bytes(8, "little"))
                digest.update(image)
        return digest.digest()

    def _slice(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:  # [n] ids, [3, n] positions
        prompt_end = min(end, self._prompt_length)
        ids, positions = [self._ids[start:prompt_end]], [self._positions[:, start:prompt_end]]
        if end > self._prompt_length:  # generated tokens: position index + rope_delta in all three components
            first = max(start, self._prompt_length)
            ids.append(np.asarray(self._generated[first - self._prompt_length : end - self._prompt_length], np.int64))
            after = np.arange(first, end, dtype=np.int64) + self._rope_delta
            positions.append(np.broadcast_to(after, (3, end - first)))
        return np.concatenate(ids), np.ascontiguousarray(np.concatenate(positions, axis=1))
