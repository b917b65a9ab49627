"""A prompt's prefix as a chain of block hashes: the key hot-prefix tracking and the shared fleet
view agree on.

The text is cut into blocks of `block_chars` characters (1024 by default, about 256 tokens);
block *k*'s hash covers the whole text up to the end of block *k* (a chained checksum), so two
prompts share hash *k* exactly when they share their first *k* blocks, as a radix cache shares a
prefix. Only whole blocks count: the tail after the last boundary is mostly the request's own.
The hash is XXH3-64 of the UTF-8 bytes, fed block by block into one running state (stable
across processes, unlike Python's salted `hash`; ~5 µs for a 16 KiB prompt here, where zlib's
CRC-32 took 14 µs).

`BlockHasher` remembers the last text it hashed (by identity), so the policy, the hot-prefix
tracker and the fleet view hash one request once between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

DEFAULT_BLOCK_CHARS = 1024
DEFAULT_MAX_BLOCKS = 64


@dataclass(frozen=True, slots=True)
class PrefixBlocks:
    """The block hashes of one text, shallowest first; block k ends at `(k + 1) * block_chars`."""

    text: str
    hashes: tuple[int, ...]
    block_chars: int

    def chars(self, depth: int) -> int:
        """Characters covered by the first `depth` blocks."""
        return depth * self.block_chars


class BlockHasher:
    def __init__(
        self, block_chars: int = DEFAULT_BLOCK_CHARS, max_blocks: int = DEFAULT_MAX_BLOCKS
    ) -> None:
        if block_chars < 16:
            raise ValueError("block_chars must be >= 16")
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self._last: PrefixBlocks | None = None

    def blocks(self, text: str) -> PrefixBlocks:
        last = self._last
        if last is not None and last.text is text:
            return last
        size = self.block_chars
        n = min(len(text) // size, self.max_blocks)
        hashes: list[int] = []
        state = xxhash.xxh3_64()
        update, digest = state.update, state.intdigest
        if text.isascii():  # one encode; byte offsets are character offsets
            data = text.encode()
            for k in range(n):
                update(data[k * size : (k + 1) * size])
                hashes.append(digest())
        else:
            for k in range(n):
                update(text[k * size : (k + 1) * size].encode("utf-8", "surrogatepass"))
                hashes.append(digest())
        self._last = out = PrefixBlocks(text, tuple(hashes), size)
        return out


__all__ = ["DEFAULT_BLOCK_CHARS", "DEFAULT_MAX_BLOCKS", "BlockHasher", "PrefixBlocks"]
