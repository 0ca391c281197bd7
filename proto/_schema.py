"""Declarative field schemas for wire messages, strict validation, and a bounded unpacker.

A message class is a frozen dataclass whose fields are declared with `spec(...)`; the
schema is read from the dataclass metadata, so no class writes validation by hand.
Validation runs on construction (so nothing invalid can be encoded) and on decode.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgpack

from proto.errors import (
    InvalidMessage,
    MalformedFrame,
    MessageTooLarge,
    UnknownMessageType,
    UnsupportedVersion,
)
from proto.ids import SCHEMA_VERSION, SUPPORTED_VERSIONS

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1
MAX_NESTING = 32
_MAX_CONTAINER_ITEMS = 1 << 20
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


class FieldSpec:
    """Checks (and normalizes) one field value; raises InvalidMessage naming the field."""

    def check(self, name: str, value: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


def _fail(name: str, what: str) -> InvalidMessage:
    return InvalidMessage(f"field {name!r}: {what}", field=name)


def _type_name(value: Any) -> str:
    return type(value).__name__


@dataclass(frozen=True)
class Text(FieldSpec):
    """A str of min_len..max_len characters; optional regex pattern or fixed choices."""

    max_len: int
    min_len: int = 0
    pattern: str | None = None
    choices: tuple[str, ...] | None = None
    allow_control: bool = False

    def check(self, name: str, value: Any) -> Any:
        if not isinstance(value, str):
            raise _fail(name, f"expected a string, got {_type_name(value)}")
        if self.choices is not None:
            if value not in self.choices:
                raise _fail(name, f"{value[:64]!r} is not one of {list(self.choices)}")
            return value
        if not self.min_len <= len(value) <= self.max_len:
            raise _fail(
                name, f"length {len(value)} is outside {self.min_len}..{self.max_len} characters"
            )
        if not self.allow_control and _CONTROL_CHARS.search(value):
            raise _fail(name, "control characters are not allowed")
        if self.pattern is not None and value and re.fullmatch(self.pattern, value) is None:
            raise _fail(name, f"{value[:64]!r} does not match {self.pattern}")
        return value


@dataclass(frozen=True)
class Bin(FieldSpec):
    """A bytes value of min_len..max_len bytes, or one of `exact` lengths."""

    max_len: int
    min_len: int = 0
    exact: tuple[int, ...] | None = None

    def check(self, name: str, value: Any) -> Any:
        if isinstance(value, bytearray | memoryview):
            value = bytes(value)
        if not isinstance(value, bytes):
            raise _fail(name, f"expected bytes, got {_type_name(value)}")
        if self.exact is not None:
            if len(value) not in self.exact:
                raise _fail(name, f"length {len(value)} bytes, allowed: {list(self.exact)}")
        elif not self.min_len <= len(value) <= self.max_len:
            raise _fail(
                name, f"length {len(value)} bytes is outside {self.min_len}..{self.max_len}"
            )
        return value


@dataclass(frozen=True)
class Int(FieldSpec):
    """An integer (never a bool) in lo..hi inclusive."""

    lo: int = 0
    hi: int = U64_MAX

    def check(self, name: str, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(name, f"expected an integer, got {_type_name(value)}")
        if not self.lo <= value <= self.hi:
            raise _fail(name, f"{value} is outside {self.lo}..{self.hi}")
        return value


@dataclass(frozen=True)
class Float(FieldSpec):
    """A finite number in lo..hi (ints are accepted and converted to float)."""

    lo: float = -math.inf
    hi: float = math.inf

    def check(self, name: str, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(name, f"expected a number, got {_type_name(value)}")
        try:
            value = float(value)
        except OverflowError:
            raise _fail(name, "number is too large for a float") from None
        if not math.isfinite(value):
            raise _fail(name, "must be finite (no NaN or infinity)")
        if not self.lo <= value <= self.hi:
            raise _fail(name, f"{value} is outside {self.lo}..{self.hi}")
        return value


@dataclass(frozen=True)
class Bool(FieldSpec):
    """True or False (not 0/1)."""

    def check(self, name: str, value: Any) -> Any:
        if not isinstance(value, bool):
            raise _fail(name, f"expected true/false, got {_type_name(value)}")
        return value


@dataclass(frozen=True)
class ListOf(FieldSpec):
    """A list/tuple of at most max_items items, each checked by `item`; stored as a tuple."""

    item: FieldSpec
    max_items: int
    min_items: int = 0

    def check(self, name: str, value: Any) -> Any:
        if type(value) not in (list, tuple):
            raise _fail(name, f"expected a list, got {_type_name(value)}")
        if not self.min_items <= len(value) <= self.max_items:
            raise _fail(
                name, f"{len(value)} items is outside {self.min_items}..{self.max_items}"
            )
        return tuple(self.item.check(f"{name}[{i}]", v) for i, v in enumerate(value))


@dataclass(frozen=True)
class Data(FieldSpec):
    """A map with str keys of plain data (None, bool, int, float, str, bytes, lists, maps).

    Nesting is limited to MAX_NESTING; ints must fit in 64 bits; tuples become lists.
    """

    def check(self, name: str, value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise _fail(name, f"expected a map, got {_type_name(value)}")
        return _plain(name, value, 0)


def _plain(path: str, value: Any, depth: int) -> Any:
    if depth > MAX_NESTING:
        raise _fail(path, f"nesting deeper than {MAX_NESTING} levels")
    if value is None or isinstance(value, bool | str | bytes):
        return value
    if isinstance(value, int):
        if not I64_MIN <= value <= U64_MAX:
            raise _fail(path, "integer does not fit in 64 bits")
        return value
    if isinstance(value, float):
        return value
    if type(value) in (list, tuple):  # exact: msgpack.ExtType is a tuple subclass
        return [_plain(f"{path}[{i}]", v, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise _fail(path, f"map keys must be strings, got {_type_name(k)}")
            out[k] = _plain(f"{path}.{k}", v, depth + 1)
        return out
    raise _fail(path, f"{_type_name(value)} is not plain data (allowed: nil, bool, int, "
                      "float, str, bytes, list, map)")


def spec(field_spec: FieldSpec, *, default: Any = dataclasses.MISSING) -> Any:
    """Declare a message field checked by `field_spec` (use as `name: T = spec(...)`)."""
    if isinstance(default, dict | list):
        frozen_default = default
        return dataclasses.field(
            default_factory=lambda: type(frozen_default)(frozen_default),
            metadata={"spec": field_spec},
        )
    return dataclasses.field(default=default, metadata={"spec": field_spec})


M = TypeVar("M", bound="Schema")


class Schema:
    """Base of every wire message: validated on construction; `to_map`/`from_map`.

    Subclasses are frozen dataclasses with `TYPE: ClassVar[str]` and fields declared
    with `spec(...)`. A subclass joins the registry of the family given by the nearest
    base that sets `REGISTRY`.
    """

    TYPE: ClassVar[str]
    REGISTRY: ClassVar[dict[str, type[Schema]]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "TYPE" in cls.__dict__:
            registry = cls.REGISTRY
            if cls.TYPE in registry:
                raise RuntimeError(f"message type {cls.TYPE!r} registered twice")
            registry[cls.TYPE] = cls

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            checked = f.metadata["spec"].check(f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, checked)

    @classmethod
    def field_specs(cls) -> dict[str, FieldSpec]:
        return {f.name: f.metadata["spec"] for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    def to_map(self) -> dict[str, Any]:
        """The wire map: `v`, `type`, then every field."""
        out: dict[str, Any] = {"v": SCHEMA_VERSION, "type": self.TYPE}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


def from_map(
    registry: Mapping[str, type[Schema]], obj: Any, *, extra: frozenset[str] = frozenset()
) -> Schema:
    """Build the message a decoded map describes, rejecting anything not exactly right.

    `extra` names framing keys the caller handles itself (e.g. `payload_length`).
    """
    if not isinstance(obj, dict):
        raise MalformedFrame(f"expected a msgpack map at top level, got {_type_name(obj)}")
    version = obj.get("v")
    if isinstance(version, bool) or not isinstance(version, int):
        raise UnsupportedVersion(
            f"missing or non-integer schema version 'v' (supported: {sorted(SUPPORTED_VERSIONS)})"
        )
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(
            f"schema version {version} is not supported (supported: {sorted(SUPPORTED_VERSIONS)})"
        )
    mtype = obj.get("type")
    if not isinstance(mtype, str):
        raise UnknownMessageType(f"missing or non-string 'type' (known: {sorted(registry)})")
    cls = registry.get(mtype)
    if cls is None:
        raise UnknownMessageType(f"unknown message type {mtype[:64]!r} (known: {sorted(registry)})")
    specs = cls.field_specs()
    allowed = set(specs) | {"v", "type"} | extra
    unexpected = sorted(str(k) for k in obj if k not in allowed)
    if unexpected:
        raise InvalidMessage(
            f"{mtype}: unexpected field(s) {unexpected[:8]} (allowed: {sorted(specs)})",
            field=unexpected[0],
        )
    missing = sorted(k for k in specs if k not in obj)
    if missing:
        raise InvalidMessage(f"{mtype}: missing field(s) {missing}", field=missing[0])
    try:
        return cls(**{k: obj[k] for k in specs})
    except InvalidMessage as exc:
        raise InvalidMessage(f"{mtype}: {exc}", field=exc.field) from None


def unpack_limited(data: bytes | bytearray | memoryview, max_size: int) -> Any:
    """Unpack exactly one msgpack object from `data` of at most `max_size` bytes.

    The size is checked before unpacking and the unpacker's per-object limits are bound
    by the input length, so a small frame cannot request a large allocation. Never
    returns anything but plain data; raises MessageTooLarge or MalformedFrame.
    """
    size = len(data)
    if size > max_size:
        raise MessageTooLarge(f"message of {size} bytes exceeds the limit of {max_size} bytes")
    if size == 0:
        raise MalformedFrame("empty message")
    items = min(size, _MAX_CONTAINER_ITEMS)
    unpacker = msgpack.Unpacker(
        raw=False,
        strict_map_key=True,
        use_list=True,
        max_buffer_size=size,
        max_str_len=size,
        max_bin_len=size,
        max_array_len=items,
        max_map_len=items,
        max_ext_len=size,
    )
    try:
        unpacker.feed(data)
        obj = unpacker.unpack()
    except msgpack.OutOfData:
        raise MalformedFrame(f"truncated msgpack data ({size} bytes)") from None
    except Exception as exc:  # msgpack raises ValueError, TypeError, StackError, ...
        raise MalformedFrame(f"not valid msgpack: {type(exc).__name__}: {exc}") from None
    if unpacker.tell() != size:
        raise MalformedFrame(f"{size - unpacker.tell()} trailing bytes after the message")
    return obj


def pack(obj: Any) -> bytes:
    """Deterministic msgpack encoding (bin type for bytes)."""
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]
