"""The chunk data path: moves chunks between stores and KV caches (see `load` for the shape of it).

It sits between the restorer and the stores: stores know bytes, the codec knows the wire format, and
this layer moves a chunk's bytes with one bulk, GIL-free operation per step into reusable staging
buffers, verifies every byte where it is cheapest (host xxh3 off the GIL, or a device checksum after
the upload) and places it in the cache. Each move to a cache is a `Transfer`, which holds the staging
buffers, stream and events it uses and gives them back in one place.
"""

from kvrestore.chunkio.load import ChunkLoader
from kvrestore.chunkio.pool import Staging, StagingPool
from kvrestore.chunkio.transfer import Transfer, TransferLane

__all__ = ["ChunkLoader", "Staging", "StagingPool", "Transfer", "TransferLane"]
