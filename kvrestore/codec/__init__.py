"""The wire format: chunks of KV (`chunk`, framed by `header`, its heads checked one by one: `heads`), boundary activations (`boundary`), their checksums."""

from kvrestore.codec.boundary import *  # noqa: F403
from kvrestore.codec.boundary import __all__ as _boundary_all
from kvrestore.codec.chunk import *  # noqa: F403
from kvrestore.codec.chunk import __all__ as _chunk_all
from kvrestore.codec.heads import *  # noqa: F403
from kvrestore.codec.heads import __all__ as _heads_all

__all__ = [*_chunk_all, *_heads_all, *_boundary_all]
