"""Records as the CLI prints them: JSON with typed values in a stable order."""

from __future__ import annotations

import base64
import json
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message import Message


def plain(msg: Message) -> dict[str, Any]:
    """A message as JSON values for people: fields in declaration order, defaults included (a
    no-op shows evicted: false, not {}), a message field only when set; integers as numbers
    (proto3 JSON writes 64-bit ones as strings), float32 at its precision, enums by name,
    method parameters that are whole numbers as integers (a Struct holds only doubles), map and
    Struct keys sorted."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        if f.has_presence and not f.is_repeated and not msg.HasField(f.name):
            continue
        out[f.name] = _field(getattr(msg, f.name), f)
    return out


def _field(value: Any, f: F) -> Any:
    entry = f.message_type
    if entry is not None and entry.GetOptions().map_entry:
        vf = entry.fields_by_name["value"]
        return {k: _one(value[k], vf) for k in sorted(value)}
    if f.is_repeated:
        return [_one(v, f) for v in value]
    return _one(value, f)


def _one(value: Any, f: F) -> Any:
    if f.type == F.TYPE_MESSAGE:
        if f.message_type.full_name == "google.protobuf.Struct":
            return _whole(json_format.MessageToDict(value))
        return plain(value)
    if f.type == F.TYPE_ENUM:
        known = f.enum_type.values_by_number.get(value)
        return known.name if known is not None else value
    if f.type == F.TYPE_FLOAT:
        return float(f"{value:.7g}")  # float32: 0.3, not 0.30000001192092896
    if f.type == F.TYPE_BYTES:
        return base64.b64encode(value).decode()
    return value


def _whole(x: Any) -> Any:
    if isinstance(x, float) and x.is_integer() and abs(x) < 2 ** 53:
        return int(x)
    if isinstance(x, dict):
        return {k: _whole(x[k]) for k in sorted(x)}
    if isinstance(x, list):
        return [_whole(v) for v in x]
    return x


def print_record(msg: Message) -> None:
    print(json.dumps(plain(msg), indent=2))
