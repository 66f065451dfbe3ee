"""The two checksums of a chunk section: one for the host, one for the device.

Every section of a chunk carries both, so a reader verifies every byte wherever the bytes already are,
without holding the GIL for the section's length:

* `host_checksum`: xxh3-64 of the stored bytes. python-xxhash releases the GIL while it hashes (tens of
  GB/s per core here), so a load lane verifies on its own thread while the compute lane launches kernels.
  It covers compressed sections too, before they are decompressed.
* `device_checksum`: a weighted sum of the raw section read as little-endian int64 words,
  ``sum(word[i] * weight[i]) mod 2**64`` with odd, index-dependent weights (`weights`). It is two
  elementwise kernels on a GPU (about 1 TB/s on an H100), so a chunk uploaded to the device is verified
  there after the copy, and the host only moves bytes. Any change of one word changes the sum (the
  weights are odd); moved or swapped words change it unless their values and index differences conspire
  modulo 2**64. It detects damage, not tampering, like any non-cryptographic checksum.

Both sums depend only on the bytes, in C order, so the writer (any device) and the reader (any device)
agree; `tests/test_checksums.py` checks the torch computation against numpy's unsigned arithmetic.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from kvrestore.core.streams import upload

WORD = 8  # bytes per int64 word of the device checksum
_MUL = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: consecutive weights spread over all bits
_ADD = np.uint64(0x632BE59BD9B4E019)

_lock = threading.Lock()
_weights: dict[str, torch.Tensor] = {}  # per device: the longest asked for so far (shorter are its heads)


def host_checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of `data` (the GIL is released while it runs)."""
    return xxhash.xxh3_64_intdigest(data)


def host_checksum_parts(parts: Sequence[bytes | bytearray | memoryview]) -> int:
    """`host_checksum` of the concatenation of `parts` (bytes read straight into place, not contiguous)."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


def device_checkable(row_bytes: int) -> bool:
    """Whether sections whose rows (one token of one head: head_dim elements) are `row_bytes` long have a
    device checksum: each row must be a whole number of int64 words, so a token slice of a cache can be
    read as words in place."""
    return row_bytes % WORD == 0


def weights(n_words: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The first `n_words` weights as int64 on `device`: the head of one cached tensor per device, grown
    to the next power of two when a longer one is asked for (a few times per process). On CUDA a
    growth waits for the copy, so any stream may read the weights from then on."""
    device = torch.device(device)
    key = str(device)
    w = _weights.get(key)
    if w is None or w.numel() < n_words:
        size = 1 << max(n_words - 1, 1).bit_length()
        with np.errstate(over="ignore"):
            idx = np.arange(size, dtype=np.uint64)
            host = (idx * _MUL + _ADD) | np.uint64(1)  # unsigned: wraps modulo 2**64 by definition
        w = torch.from_numpy(host.view(np.int64)).to(device)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        with _lock:
            if key not in _weights or _weights[key].numel() < size:
                _weights[key] = w
    return w[:n_words]


def device_checksums(sections: torch.Tensor) -> torch.Tensor:
    """int64 [n] sums of `sections` [n, ...] (any dtype, C-order bytes per section, last dim contiguous).

    Runs where `sections` lives; it may be a strided view (a token slice of a KV cache), as long as its
    last dimension is contiguous and holds a whole number of words.
    """
    n = sections.shape[0]
    words = sections.view(torch.uint8).view(torch.int64) if sections.dtype != torch.int64 else sections
    per = words[0].numel() if n else 0
    w = weights(per, words.device).view(words.shape[1:])
    # int64 products and sums wrap modulo 2**64 (two's complement), the same bits as numpy's uint64
    return (words * w).reshape(n, -1).sum(dim=1)


@functools.lru_cache(maxsize=16)
def _segment_tables(device: str, stream: int, lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights and segment ends of `segment_checksums` for one layout on one CUDA stream (0 off
    CUDA), made once: they are written on that stream, so only work queued behind it may read them.
    The ends go up through pinned memory: from pageable memory the host would wait for the stream (a
    layer's check would stop the host behind its own uploads)."""
    w = torch.cat([weights(n, torch.device(device)) for n in lengths])
    ends = upload(torch.from_numpy(np.cumsum(lengths) - 1), torch.device(device))
    return w, ends


def segment_checksums(words: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """int64 [n] `device_checksums` of n sections laid back to back in `words` (int64 [sum(lengths)]),
    section i being `lengths[i]` words: one product, one running sum and one difference for all of
    them, so a layer of many chunks is checked with a handful of kernels (the sums wrap modulo 2**64,
    so differences of the running sum are exact)."""
    stream = torch.cuda.current_stream(words.device).stream_id if words.is_cuda else 0
    w, ends = _segment_tables(str(words.device), stream, tuple(lengths))
    running = (words * w).cumsum(0)
    at_end = running[ends]
    return at_end - torch.cat([at_end.new_zeros(1), at_end[:-1]])


def as_signed(value: int) -> int:
    """A 64-bit sum as the signed int the header stores (what `device_checksums` gives)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


__all__ = [
    "WORD",
    "as_signed",
    "device_checkable",
    "device_checksums",
    "host_checksum",
    "segment_checksums",
    "weights",
]
