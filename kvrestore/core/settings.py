"""Checks of the settings a caller gives: constructor arguments, the vLLM connector's config, the
environment variables kvrestore reads.

Each check refuses a value of the wrong type or outside its range where it is given, with an
`InvalidInputError` (a `KVRestoreError`) that names the setting, and returns the value as it is used.
The rules: a boolean is a bool (not ``"false"``, not 0); a number is an int or a float, never a bool; a
count is an integer; a string is a str that UTF-8 can encode (no lone surrogate, which every later call
would fail on); a path is a str or `os.PathLike` the file system can encode, not empty and with no
surrounding whitespace; a choice is one of its values.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
from collections.abc import Collection
from typing import Any, TypeVar

import torch

from kvrestore.core.errors import InvalidInputError

T = TypeVar("T")


def check_bool(name: str, value: object) -> bool:
    """`value` if it is True or False, else InvalidInputError naming `name`."""
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name} must be True or False, got {value!r}")
    return value


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """`value` as an int if it is an integer (not a bool) >= `minimum`, else InvalidInputError naming `name`."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        n = None
    if n is None or n < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise InvalidInputError(f"{name} must be {what}, got {value!r}")
    return n


def check_number(
    name: str,
    value: object,
    lo: float | None = None,
    hi: float | None = None,
    *,
    positive: bool = False,
    finite: bool = False,
) -> float:
    """`value` as a float if it is a real number (an int or a float, not a bool, not NaN) within
    [`lo`, `hi`] (and > 0 with `positive`, not infinite with `finite`), else InvalidInputError naming
    `name`."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        v = float(value)  # type: ignore[arg-type]
        ok = (lo is None or v >= lo) and (hi is None or v <= hi) and (not positive or v > 0)
        ok = ok and (not finite or math.isfinite(v))
    if not ok:
        a = "a finite" if finite else "a"
        if lo is not None and hi is not None:
            want = f"{a} number from {lo:g} to {hi:g}"
        elif positive:
            want = f"a positive{' finite' if finite else ''} number"
        elif lo is not None:
            want = f"{a} number >= {lo:g}"
        else:
            want = f"{a} number" if hi is None else f"{a} number <= {hi:g}"
        raise InvalidInputError(f"{name} must be {want}, got {value!r}")
    return v


def check_seconds(name: str, value: object) -> float | None:
    """`value` as seconds if it is a positive number, None for None (no limit), else InvalidInputError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:  # NaN fails too
        raise InvalidInputError(
            f"{name} must be a positive number of seconds, or None for no limit, got {value!r}"
        )
    return float(value)


def check_text(name: str, value: object, *, empty: bool = False, secret: bool = False) -> str:
    """`value` if it is a str UTF-8 can encode (and not empty unless `empty`), else InvalidInputError
    naming `name` (and, unless `secret`, showing the value)."""
    shown = "<secret>" if secret else repr(value)
    if not isinstance(value, str) or not (value or empty):
        got = type(value).__name__ if secret else shown
        raise InvalidInputError(f"{name} must be a {'' if empty else 'non-empty '}string, got {got}")
    try:
        value.encode()
    except UnicodeEncodeError as e:
        raise InvalidInputError(
            f"{name} is not encodable as UTF-8 ({e.reason} at position {e.start}): {shown}"
        ) from None
    return value


def check_path(name: str, value: object) -> str | os.PathLike[str]:
    """`value` if it is a str or `os.PathLike` of str naming a path the file system can encode, not
    empty and without surrounding whitespace, else InvalidInputError naming `name`."""
    text = value.__fspath__() if isinstance(value, os.PathLike) else value
    if not isinstance(text, str) or not text:
        raise InvalidInputError(f"{name} must be a path (a non-empty str or os.PathLike), got {value!r}")
    if text != text.strip():
        raise InvalidInputError(f"{name} has whitespace around it: {text!r}")
    try:
        os.fsencode(text)
    except UnicodeEncodeError as e:
        raise InvalidInputError(
            f"{name} is not a path the file system can encode ({e.reason}): {text!r}"
        ) from None
    return value  # type: ignore[return-value]


#: strings that read as a boolean: refused where a setting takes a bool or a path (pass the bool)
_BOOLEAN_WORDS = {"true", "false", "yes", "no", "on", "off", "0", "1"}


def check_bool_or_path(name: str, value: object) -> bool | str | os.PathLike[str]:
    """`value` if it is True, False or a path (`check_path`) that does not read as a boolean (``"false"``
    is refused: pass False, or ``"./false"`` for a directory of that name), else InvalidInputError."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidInputError(f"{name} must be True, False or a path, got {value!r}")
    if isinstance(value, str) and value.strip().lower() in _BOOLEAN_WORDS:
        raise InvalidInputError(
            f"{name} must be True, False or a path; {value!r} is a string: pass True or False "
            f"(or './{value.strip()}' for a directory of that name)"
        )
    return check_path(name, value)


def check_device(name: str, value: object) -> torch.device | None:
    """`value` as a `torch.device` if it is None, a `torch.device` or a str torch parses as one ("cpu",
    "cuda:1"), else InvalidInputError naming `name`."""
    if value is None or isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except (RuntimeError, ValueError, UnicodeError) as e:
            raise InvalidInputError(f"{name} {value!r} is not a device: {e}") from None
    raise InvalidInputError(f"{name} must be a str or torch.device (e.g. 'cuda:0') or None, got {value!r}")


def check_dtype(name: str, value: object) -> torch.dtype:
    """`value` if it is a floating point `torch.dtype`, else InvalidInputError naming `name`."""
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise InvalidInputError(
            f"{name} must be a floating point torch.dtype (e.g. torch.bfloat16), got {value!r}"
        )
    return value


def check_choice(name: str, value: T, choices: Collection[Any]) -> T:
    """`value` if it is one of `choices` (of the same type: True is not 1), else InvalidInputError."""
    if not any(_same(value, c) for c in choices):
        raise InvalidInputError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def _same(value: object, choice: object) -> bool:
    """Whether `value` is `choice`, or equal to it and of its type (True is not 1, "1" is not 1)."""
    if value is choice:
        return True
    return (
        isinstance(value, bool) is isinstance(choice, bool)
        and isinstance(value, type(choice))
        and value == choice
    )


def check_instance(name: str, value: object, kind: type[T] | tuple[type, ...], what: str) -> T:
    """`value` if it is an instance of `kind`, else InvalidInputError saying `name` must be `what`."""
    if not isinstance(value, kind):
        raise InvalidInputError(f"{name} must be {what}, got {value!r}")
    return value  # type: ignore[return-value]


__all__ = [
    "check_bool",
    "check_bool_or_path",
    "check_choice",
    "check_device",
    "check_dtype",
    "check_instance",
    "check_int",
    "check_number",
    "check_path",
    "check_seconds",
    "check_text",
]
