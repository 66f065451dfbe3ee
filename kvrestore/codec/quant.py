"""KV encodings of a stored chunk: how one layer's K and V ([2, H, T, D]) become a section's bytes.

A restore that loads waits on the store's bandwidth, so fewer bytes per chunk move the balance point
between computing and loading. Each encoding lays a layer's section out as a few typed parts, each at
a multiple of 8 bytes into the section, and pads the section to a whole number of int64 words, so

* the scales travel in the section beside the values they scale: one range read of a layer has all
  its decoder needs, and both checksums (`checksums`) cover the bytes as stored, scales included;
* a section uploaded to a GPU is checked there with the device checksum and decoded there, on the
  load stream (`Encoding.decode` runs wherever its input lives): the host moves only the small bytes.

The encodings (`ENCODINGS`):

* ``native``: the model's own dtype, as it is (the format's sections before encodings existed);
* ``int8``: symmetric, one scale per token, head and K/V (absmax / 127);
* ``fp8``: float8 e4m3 values, one scale per token, head and K/V (absmax / 448);
* ``int4``: KIVI-style asymmetric 4-bit: keys per channel over groups of g tokens, values per token
  over groups of g channels, each group with a scale and a minimum; two values a byte. g is `GROUP`,
  or the largest divisor of the head dimension below it (a value group never straddles two heads).

Scales are bfloat16 (int4's scales and minima float16: its zero point needs the finer mantissa), and
each is rounded to that dtype *before* the values are quantized with it, so a decode multiplies by
exactly the scale the encoder used. The chunk header names the encoding, the scales' dtype and the
group size (`Encoding.tag`); the decoder follows the header, and a reader refuses a chunk whose tag
is not its own (`codec.check_header`), so a chunk is never decoded as another encoding.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from kvrestore.core.errors import ForeignChunkError, InvalidInputError, UnknownLayoutError
from kvrestore.core.keys import key_space  # chunks of each encoding have keys of their own

# decoders only read through zero-copy views of stored bytes; torch's warning about read-only buffers
# does not apply
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)

#: the chunk encodings a restorer can write and read (`Restorer(kv_encoding=...)`)
ENCODINGS = ("native", "int8", "fp8", "int4")
#: int4's largest group: tokens per key scale, channels per value scale
GROUP = 32
_ALIGN = 8  # parts start, and sections end, on int64 words (the device checksum reads words)

Part = tuple[str, torch.dtype, tuple[int, ...]]


def _round_up(n: int, to: int = _ALIGN) -> int:
    return -(-n // to) * to


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return dtype.itemsize * math.prod(shape)


@dataclass(frozen=True)
class Encoding:
    """How sections of one model's chunks are encoded (the base class is `native`: the KV as it is)."""

    name: str
    dtype: torch.dtype  # the model's KV dtype: what `decode` writes, what `encode` reads
    num_kv_heads: int
    head_dim: int
    scales: str = ""  # the dtype name of the scales ("" where there are none)
    group: int = 0  # int4's group size (0: no groups)

    @property
    def tag(self) -> tuple[str, str, int]:
        """What the chunk header records: (name, scales' dtype, group size)."""
        return (self.name, self.scales, self.group)

    @property
    def native(self) -> bool:
        return self.name == "native"

    def parts(self, n_tokens: int) -> list[Part]:
        """The typed parts of one section, in order: (name, dtype, shape)."""
        return [("kv", self.dtype, (2, self.num_kv_heads, n_tokens, self.head_dim))]

    def section_bytes(self, n_tokens: int) -> int:
        """Bytes of one layer's section for `n_tokens` tokens (scales and padding included)."""
        if self.native:  # no padding: a section is the tensor's bytes, as a cache's rows hold them
            return _nbytes(self.dtype, self.parts(n_tokens)[0][2])
        return _round_up(sum(_round_up(_nbytes(dt, shape)) for _, dt, shape in self.parts(n_tokens)))

    def bytes_per_token(self, n_tokens: int, num_layers: int) -> float:
        """Stored bytes per token of a chunk of `n_tokens` over `num_layers` layers."""
        return self.section_bytes(n_tokens) * num_layers / n_tokens

    def views(self, sections: torch.Tensor, n_tokens: int) -> dict[str, torch.Tensor]:
        """Typed views of the parts of `sections` (uint8 [n, section_bytes], any device): [n, *shape]."""
        n, at, out = sections.shape[0], 0, {}
        for name, dtype, shape in self.parts(n_tokens):
            size = _nbytes(dtype, shape)
            out[name] = sections[:, at : at + size].view(dtype).view(n, *shape)
            at += size if self.native else _round_up(size)
        return out

    def encode(self, kv: torch.Tensor) -> torch.Tensor:
        """The sections of `kv` ([n, 2, H, T, D] in `dtype`) as uint8 [n, section_bytes], on kv's device."""
        n, t = kv.shape[0], kv.shape[3]
        out = torch.zeros((n, self.section_bytes(t)), dtype=torch.uint8, device=kv.device)
        for name, value in self._encode(kv).items():
            self.views(out, t)[name].copy_(value)
        return out

    def decode(self, sections: torch.Tensor, out: torch.Tensor) -> None:
        """Write the KV of `sections` (uint8 [n, section_bytes]) into `out` ([n, 2, H, T, D] in `dtype`,
        on the same device; may be a strided view of a cache), where the sections lie."""
        self._decode(self.views(sections, out.shape[3]), out)

    def _encode(self, kv: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"kv": kv}

    def _decode(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        out.copy_(parts["kv"])


class _PerToken(Encoding):
    """Symmetric quantization with one scale per token, head and K/V: int8 and fp8."""

    stored: torch.dtype = torch.int8  # the values' dtype
    limit: float = 127.0  # the largest value magnitude it holds

    def parts(self, n_tokens: int) -> list[Part]:
        h, d = self.num_kv_heads, self.head_dim
        return [("q", self.stored, (2, h, n_tokens, d)), ("scale", torch.bfloat16, (2, h, n_tokens))]

    def _encode(self, kv: torch.Tensor) -> dict[str, torch.Tensor]:
        x = kv.float()
        scale = (x.abs().amax(-1) / self.limit).to(torch.bfloat16)  # rounded first: decode uses it exactly
        s = scale.float()
        y = (x / torch.where(s > 0, s, 1.0).unsqueeze(-1)).clamp_(-self.limit, self.limit)
        return {"q": self._round(y), "scale": scale}

    def _round(self, y: torch.Tensor) -> torch.Tensor:
        return y.round_().to(torch.int8)

    def _decode(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        # bfloat16 out: one rounding of the product (computed in float); else the product in float32,
        # exact for int8 and fp8 values times a bfloat16 scale
        work = torch.bfloat16 if out.dtype == torch.bfloat16 else torch.float32
        q = parts["q"] if parts["q"].dtype == torch.int8 else parts["q"].to(work)
        torch.mul(q, parts["scale"].to(work).unsqueeze(-1), out=out)


class _Fp8(_PerToken):
    stored = torch.float8_e4m3fn
    limit = 448.0

    def _round(self, y: torch.Tensor) -> torch.Tensor:
        return y.to(torch.float8_e4m3fn)


class _Int4(Encoding):
    """KIVI's 4-bit: keys per channel (a group of `group` tokens shares a scale and a minimum), values
    per token (a group of `group` channels does), packed two to a byte along the channels."""

    def parts(self, n_tokens: int) -> list[Part]:
        h, d, g = self.num_kv_heads, self.head_dim, self.group
        groups = -(-n_tokens // g)
        return [
            ("k", torch.uint8, (h, n_tokens, d // 2)),
            ("v", torch.uint8, (h, n_tokens, d // 2)),
            ("k_params", torch.float16, (2, h, groups, d)),  # scale, minimum
            ("v_params", torch.float16, (2, h, n_tokens, d // g)),
        ]

    @staticmethod
    def _quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """4-bit codes of `x` over groups along `dim`, and the (scale, minimum) of each group."""
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
        zero = lo.to(torch.float16)
        scale = ((hi - zero.float()) / 15).to(torch.float16)
        s = scale.float()
        q = ((x - zero.float()) / torch.where(s > 0, s, 1.0)).round_().clamp_(0, 15).to(torch.uint8)
        return q, torch.stack([scale.squeeze(dim), zero.squeeze(dim)])

    @staticmethod
    def _pack(q: torch.Tensor) -> torch.Tensor:
        return q[..., 0::2] | (q[..., 1::2] << 4)

    @staticmethod
    def _unpack(p: torch.Tensor) -> torch.Tensor:
        return torch.stack([p & 15, p >> 4], dim=-1).flatten(-2).float()

    def _encode(self, kv: torch.Tensor) -> dict[str, torch.Tensor]:
        n, _, h, t, d = kv.shape
        g, groups = self.group, -(-kv.shape[3] // self.group)
        k, v = kv[:, 0].float(), kv[:, 1].float()
        # keys: pad the last group with copies of its last token (they change no minimum or maximum)
        padded = torch.cat([k, k[:, :, -1:].expand(n, h, groups * g - t, d)], dim=2)
        kq, kp = self._quantize(padded.view(n, h, groups, g, d), dim=3)
        vq, vp = self._quantize(v.view(n, h, t, d // g, g), dim=4)
        return {
            "k": self._pack(kq.view(n, h, groups * g, d)[:, :, :t]),
            "v": self._pack(vq.view(n, h, t, d)),
            "k_params": kp.transpose(0, 1),
            "v_params": vp.transpose(0, 1),
        }

    def _decode(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        n, _, h, t, d = out.shape
        g = self.group
        kp = parts["k_params"].float().repeat_interleave(g, dim=3)[:, :, :, :t]  # [n, 2, h, t, d]
        out[:, 0].copy_(torch.addcmul(kp[:, 1], self._unpack(parts["k"]), kp[:, 0]))
        vp = parts["v_params"].float().unsqueeze(-1)  # [n, 2, h, t, d/g, 1]
        codes = self._unpack(parts["v"]).view(n, h, t, d // g, g)
        out[:, 1].copy_(torch.addcmul(vp[:, 1], codes, vp[:, 0]).view(n, h, t, d))


_KINDS: dict[str, tuple[type[Encoding], str, int]] = {
    "native": (Encoding, "", 0),
    "int8": (_PerToken, "bfloat16", 0),
    "fp8": (_Fp8, "bfloat16", 0),
    "int4": (_Int4, "float16", GROUP),
}


def encoding(name: object, dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> Encoding:
    """The encoding `name` for a model's KV shape; InvalidInputError for an unknown name, or for int4
    with an odd head dimension (it packs two channels a byte)."""
    if not isinstance(name, str) or name not in _KINDS:
        raise InvalidInputError(f"unknown kv_encoding {name!r}; use one of {ENCODINGS}")
    kind, scales, group = _KINDS[name]
    if group:
        group = math.gcd(group, head_dim)
        if group < 2:
            raise InvalidInputError(f"kv_encoding {name!r} needs an even head_dim, got {head_dim}")
    return kind(name, dtype, num_kv_heads, head_dim, scales, group)


def from_tag(tag: tuple[str, str, int], dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> Encoding:
    """The encoding a chunk header names (`Encoding.tag`); UnknownLayoutError where this reader does not
    know it exactly (another name, scales' dtype or group size: a newer release's), ForeignChunkError
    where no writer of this model could have written it."""
    name = tag[0]
    if name not in _KINDS:
        raise UnknownLayoutError(f"chunk encoding {name!r} is unknown to this reader")
    try:
        enc = encoding(name, dtype, num_kv_heads, head_dim)
    except InvalidInputError as e:
        raise ForeignChunkError(str(e)) from None
    if enc.tag != tuple(tag):
        raise UnknownLayoutError(
            f"chunk encoding {tuple(tag)!r}, this reader decodes {name!r} as {enc.tag!r}"
        )
    return enc


__all__ = ["ENCODINGS", "GROUP", "Encoding", "encoding", "from_tag", "key_space"]
