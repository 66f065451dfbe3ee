"""What a store URL may look like: checked before any store is made, so a typo is an error, never a store.

A store URL is `scheme://rest` with a scheme some store is registered for (`register_store`), or a plain
path (a local directory). Everything else is refused with a typed error that names the known schemes:

* an unknown scheme (`memroy://`, `s4://bucket`): `UnsupportedURLError`, with the closest known one;
* a scheme followed by one slash or none (`memory:/`, `file:/x`, `s3:bucket`): refused, not taken as a
  relative directory named `memory:`; a directory whose name has a colon in it is `./name:`;
* whitespace around the URL (`" /var/cache/kv"`, a pasted line's `"\\n"`);
* `file://` followed by anything but an absolute path (`file://relative/dir`): a `file` URL holds an
  absolute path (`file:///abs/path`, RFC 8089), where fsspec would read the rest as relative to the
  working directory; a relative directory is a plain path.

A `pathlib.Path` (any `os.PathLike`) is a plain path, made absolute.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Collection
from typing import Any

from kvrestore.core.errors import InvalidInputError, UnsupportedURLError

#: RFC 3986's scheme: a letter, then letters, digits, "+", "-" or "."
SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")
#: local filesystem protocols whose URL holds an absolute path
LOCAL_PROTOCOLS = ("file", "local")


def _known(known: Collection[str]) -> str:
    return ", ".join(f"{s}://" for s in sorted(known))


def _closest(scheme: str, known: Collection[str]) -> str:
    near = difflib.get_close_matches(scheme, sorted(known), n=1, cutoff=0.5)
    return f"did you mean {near[0]}://? " if near else ""


def split_store_url(url: Any, known: Collection[str]) -> tuple[str, str]:
    """`(scheme, url)` for `open_store`: the scheme in lower case ("file" for a plain path) and the URL as
    a string (its scheme in lower case too). Refuses, with a typed error naming the `known` schemes, anything that is neither a URL of
    a known scheme nor a plain path (see the module docstring)."""
    if isinstance(url, os.PathLike):
        path = os.fspath(url)
        if isinstance(path, str) and path.strip():
            return "file", os.path.abspath(os.path.expanduser(path))
    if not isinstance(url, str) or not url.strip():
        raise InvalidInputError(
            f"store URL must be a non-empty string or path, got {url!r}; known schemes: {_known(known)} "
            "(or a plain path for a local directory)"
        )
    if url != url.strip():
        raise InvalidInputError(
            f"store URL {url!r} has whitespace around it; write {url.strip()!r} (a URL or path with "
            "spaces at its ends is refused, not guessed at)"
        )
    head, sep, rest = url.partition("://")
    if sep:
        if SCHEME.fullmatch(head) is None:
            raise InvalidInputError(
                f"store URL {url!r} has no scheme before '://'; known schemes: {_known(known)} "
                "(or a plain path for a local directory)"
            )
        scheme = head.lower()
        if scheme not in known:
            raise UnsupportedURLError(
                f"no store for scheme {scheme!r} in {url!r}; {_closest(scheme, known)}"
                f"known schemes: {_known(known)} (or a plain path for a local directory; "
                "`register_store` adds a scheme)"
            )
        if scheme in LOCAL_PROTOCOLS:
            check_local_url(url, scheme, rest)
        return scheme, f"{scheme}://{rest}"
    m = SCHEME.match(url)
    if m is not None and url[m.end() : m.end() + 1] == ":":  # "memory:/", "file:/x", "s3:bucket"
        scheme, tail = m.group().lower(), url[m.end() + 1 :]
        if scheme in LOCAL_PROTOCOLS:
            hint = f"did you mean {scheme}:///{tail.lstrip('/')}? "
        elif scheme in known:
            hint = f"did you mean {scheme}://{tail.lstrip('/')}? "
        else:
            hint = _closest(scheme, known)
        error = InvalidInputError if scheme in known else UnsupportedURLError
        raise error(
            f"store URL {url!r} is not a URL (a scheme takes '://') and is not taken as a directory "
            f"named {url.split('/', 1)[0]!r}; {hint}known schemes: {_known(known)}; a local directory "
            f"whose name has a ':' in it: './{url}'"
        )
    return "file", url


def check_local_url(url: str, protocol: str | None, path: str) -> None:
    """Refuse a `file://` URL that does not hold an absolute path: fsspec would take `file://relative/dir`
    as relative to whatever the working directory is when the store opens."""
    if not path.strip():
        raise InvalidInputError(f"store URL {url!r} names no directory or bucket")
    if protocol in LOCAL_PROTOCOLS and not path.startswith("/"):
        raise InvalidInputError(
            f"{protocol}:// takes an absolute path: write {protocol}:///abs/path (three slashes), got "
            f"{url!r}; a directory relative to the working directory is a plain path ('{path}')"
        )


__all__ = ["LOCAL_PROTOCOLS", "SCHEME", "check_local_url", "split_store_url"]
