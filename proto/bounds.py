"""Bounds for every numeric (and list) field a client sends, as small checkers a message can list in a table.

Every field gets a bound its consumer's types can hold: token ids and seeds go into int64 tensors,
counts into int32-sized loops, floats into float32 tensors. A value past its bound raises
ValidationError naming the field, so no client value can overflow a tensor or a loop in the core.
msgspec already guarantees the wire types (int is a msgpack integer, so within [-2^63, 2^64)); these
checks also run on structs built in Python, where nothing checked the types.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

INT32_MAX = 2**31 - 1
INT64_MIN = -2**63
INT64_MAX = 2**63 - 1


class ValidationError(ValueError):
    """A request field is out of range. `field` names it so a client can point at it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Int:
    """An integer in [lo, hi]; None allowed when optional."""
    lo: int = INT64_MIN
    hi: int = INT64_MAX
    optional: bool = False

    def check(self, field: str, v) -> None:
        if v is None and self.optional:
            return
        if not _is_int(v) or not self.lo <= v <= self.hi:
            none = " or null" if self.optional else ""
            raise ValidationError(field, f"must be an integer in [{self.lo}, {self.hi}]{none}, got {_show(v)}")


@dataclass(frozen=True)
class Float:
    """A finite number in [lo, hi] ((lo, hi] when lo_open). Ints are accepted, as on the wire."""
    lo: float
    hi: float
    lo_open: bool = False

    def check(self, field: str, v) -> None:
        ok = (_is_int(v) or isinstance(v, float)) and not isinstance(v, bool)
        if ok:
            try:
                x = float(v)
            except OverflowError:       # a Python int too large for a double
                ok = False
            else:
                ok = math.isfinite(x) and (self.lo < x if self.lo_open else self.lo <= x) and x <= self.hi
        if not ok:
            bracket = "(" if self.lo_open else "["
            raise ValidationError(field, f"must be a finite number in {bracket}{self.lo}, {self.hi}], got {_show(v)}")


@dataclass(frozen=True)
class IntList:
    """At most max_len integers, each in [lo, hi]. The error names the field as the struct does (what a
    client maps to its own parameter names) and the index in its message."""
    lo: int = 0
    hi: int = INT64_MAX
    max_len: int = INT32_MAX
    min_len: int = 0

    def check(self, field: str, v) -> None:
        if not isinstance(v, (list, tuple)) or not self.min_len <= len(v) <= self.max_len:
            raise ValidationError(field, f"must be a list of {self.min_len} to {self.max_len} integers")
        for i, t in enumerate(v):
            if not _is_int(t) or not self.lo <= t <= self.hi:
                raise ValidationError(field, f"[{i}] must be an integer in [{self.lo}, {self.hi}], got {_show(t)}")


@dataclass(frozen=True)
class StrList:
    """At most max_len strings of 1 to max_chars characters each."""
    max_len: int
    max_chars: int

    def check(self, field: str, v) -> None:
        if not isinstance(v, (list, tuple)) or len(v) > self.max_len:
            raise ValidationError(field, f"must be a list of at most {self.max_len} strings")
        for i, s in enumerate(v):
            if not isinstance(s, str) or not 1 <= len(s) <= self.max_chars:
                raise ValidationError(field, f"[{i}] must be a string of 1 to {self.max_chars} characters")


@dataclass(frozen=True)
class Str:
    """A string of min_chars to max_chars characters."""
    max_chars: int
    min_chars: int = 0

    def check(self, field: str, v) -> None:
        if not isinstance(v, str) or not self.min_chars <= len(v) <= self.max_chars:
            raise ValidationError(field, f"must be a string of {self.min_chars} to {self.max_chars} characters")


@dataclass(frozen=True)
class IntFloatMap:
    """At most max_len entries, each an integer key in [key_lo, key_hi] and a finite number in [lo, hi]
    (logit_bias: token id -> bias). The error names the field and, in its message, the key."""
    key_lo: int
    key_hi: int
    lo: float
    hi: float
    max_len: int

    def check(self, field: str, v) -> None:
        if not isinstance(v, dict) or len(v) > self.max_len:
            raise ValidationError(field, f"must be a map of at most {self.max_len} entries")
        value = Float(self.lo, self.hi)
        for k, x in v.items():
            if not _is_int(k) or not self.key_lo <= k <= self.key_hi:
                raise ValidationError(field, f"keys must be integers in [{self.key_lo}, {self.key_hi}], got {_show(k)}")
            try:
                value.check(field, x)
            except ValidationError as e:
                raise ValidationError(field, f"[{k}] {e.message}") from None


@dataclass(frozen=True)
class Nested:
    """A struct of type `cls` (or None when optional) whose own validate() checks its fields."""
    cls: type
    optional: bool = False

    def check(self, field: str, v) -> None:
        if v is None and self.optional:
            return
        if not isinstance(v, self.cls):
            raise ValidationError(field, f"must be a {self.cls.__name__}{' or null' if self.optional else ''}")
        v.validate()


@dataclass(frozen=True)
class Bool:
    def check(self, field: str, v) -> None:
        if not isinstance(v, bool):
            raise ValidationError(field, f"must be a boolean, got {_show(v)}")


def check_fields(obj, bounds: dict) -> None:
    """Check each field of `obj` against its entry in `bounds` (field name -> checker), in table order."""
    for name, bound in bounds.items():
        bound.check(name, getattr(obj, name))


def _show(v) -> str:
    """A value for an error message: short even when a client sends a huge one."""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."
