"""The measured cost model of one machine, model and store: what the planner predicts restores with.

A `Profile` holds a prefill cost (`compute.ChunkCost`), a layer cost (`compute.LayerCost`) and, when a
store was measured, its link (`links.LinkCost`); `kvrestore.costs.measure.profile(backend, store)` makes
one. It is saved as msgspec JSON under the cache directory, keyed by machine, model fingerprint, dtype
and device, so a `Restorer` on the same machine and model finds it. A profile's link is a starting point
only: `links.LinkEstimate` moves it toward what the restores' own loads show.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path

import msgspec
import torch

from kvrestore.core.errors import InvalidInputError
from kvrestore.core.paths import cache_root
from kvrestore.core.spec import ModelSpec, dtype_name
from kvrestore.costs.bounds import (
    TOKENS,
    UNIT_SECONDS,
    cost_problem,
    first_problem,
    link_problem,
    samples_problem,
)
from kvrestore.costs.compute import ChunkCost, LayerCost
from kvrestore.costs.links import LinkCost

PROFILE_VERSION = 1

log = logging.getLogger("kvrestore.costs.profile")


class Profile(msgspec.Struct, frozen=True):
    """What restores cost on one machine, for one model and dtype (and, optionally, one store)."""

    machine: str
    model: str
    fingerprint: str
    dtype: str
    device: str
    chunk: ChunkCost
    layer: LayerCost
    link: LinkCost | None = None
    store: str | None = None  # what `link` was measured on
    created: str = ""
    version: int = PROFILE_VERSION
    #: raw measurements: "chunk": [n, past, s], "layer": [n, s per layer], "link": [bytes, s]
    samples: dict[str, list[list[float]]] = {}

    @property
    def key(self) -> str:
        return profile_key(self.machine, self.fingerprint, self.dtype, self.device)

    def matches(self, spec: ModelSpec, device: torch.device | str) -> bool:
        """Whether this profile describes `spec` (model and dtype) on `device`."""
        return (
            self.fingerprint == spec.fingerprint
            and self.dtype == dtype_name(spec.dtype)
            and self.device == torch.device(device).type
        )

    def with_link(self, link: LinkCost | None, store: str | None = None) -> Profile:
        return msgspec.structs.replace(self, link=link, store=store if link is not None else None)

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the profile (msgspec JSON) to `path`, by default its place in the cache directory."""
        target = Path(path) if path is not None else profile_dir() / f"{self.key}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.format(msgspec.json.encode(self), indent=1))
        tmp.replace(target)
        return target

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise InvalidInputError(f"cannot read profile {path}: {exc}") from None
        try:
            profile = msgspec.json.decode(data, type=cls)
        except msgspec.ValidationError as exc:
            raise InvalidInputError(f"{path} is not a kvrestore profile: {exc}") from None
        except msgspec.DecodeError as exc:
            raise InvalidInputError(f"{path} is not valid JSON: {exc}") from None
        if profile.version != PROFILE_VERSION:
            raise InvalidInputError(
                f"{path} is a version {profile.version} profile; this kvrestore reads version "
                f"{PROFILE_VERSION}: run `kvrestore profile` again"
            )
        problem = profile_problem(profile)
        if problem is not None:
            raise InvalidInputError(
                f"{path} holds a value no machine has ({problem}): run `kvrestore profile` again"
            )
        return profile

    @classmethod
    def find(
        cls, spec: ModelSpec, device: torch.device | str, directory: str | os.PathLike | None = None
    ) -> Profile | None:
        """The saved profile of this machine for `spec` on `device`, if `kvrestore profile` made one.

        The file is a hint: one that cannot be read, or holds a value out of bounds
        (`costs.bounds`), is logged and ignored (None), so it never stops a `Restorer` from being built.
        """
        key = profile_key(machine_id(), spec.fingerprint, dtype_name(spec.dtype), torch.device(device).type)
        path = Path(directory) if directory is not None else profile_dir()
        path = path / f"{key}.json"
        if not path.exists():
            return None
        try:
            return cls.load(path)
        except InvalidInputError as exc:
            log.warning("ignoring the saved profile: %s", exc)
            return None

    def summary(self) -> str:
        c, layer = self.chunk, self.layer
        lines = [
            f"profile of {self.model} ({self.dtype}, {self.device}) on machine {self.machine}",
            f"  prefill n tokens after p: {c.fixed_s * 1e3:.2f} ms + {c.per_token_s * 1e6:.1f} us x n"
            f" + {c.per_token_past_s * 1e9:.2f} ns x n p + {c.per_token2_s * 1e9:.2f} ns x n^2",
            f"  one layer over N tokens:  {layer.fixed_s * 1e3:.3f} ms + {layer.per_token_s * 1e6:.2f} us x N"
            f" + {layer.per_token2_s * 1e9:.4f} ns x N^2",
        ]
        if self.link is not None:
            lines.append(
                f"  store {self.store or ''}: {self.link.bytes_per_s / 1e6:.1f} MB/s, "
                f"{self.link.latency_s * 1e3:.2f} ms per request"
            )
        return "\n".join(lines)


def profile_problem(profile: Profile) -> str | None:
    """What is out of bounds in a profile read from a file (`costs.bounds`), or None."""
    samples = profile.samples
    return first_problem(
        cost_problem("chunk", profile.chunk),
        cost_problem("layer", profile.layer),
        link_problem(profile.link),
        samples_problem("chunk", samples.get("chunk", []), (TOKENS, TOKENS, UNIT_SECONDS)),
        samples_problem("layer", samples.get("layer", []), (TOKENS, UNIT_SECONDS)),
        samples_problem("link", samples.get("link", []), ((0.0, 1e12), UNIT_SECONDS)),
    )


# -- where profiles live ---------------------------------------------------------------------------


def machine_id(threads: bool = True) -> str:
    """A stable name for this machine's compute: host, CPU model and count, GPU, and (`threads`) this
    process's torch threads. Without them, the same in every process of the machine (vLLM's scheduler
    and its worker run different numbers of threads and share the worker's learned costs)."""
    parts = [platform.node(), platform.machine(), cpu_model(), str(os.cpu_count())]
    if threads:
        parts.append(str(torch.get_num_threads()))
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name(0))
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()


def profile_key(machine: str, fingerprint: str, dtype: str, device: str) -> str:
    return f"{machine}-{fingerprint[:16]}-{dtype}-{device}"


def profile_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return cache_root(cache_dir) / "profiles"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
