"""Plain-data encoding (JSON) of what the ranks of a save exchange through the store.

Replaces pickle on everything read from the store: decoding builds only JSON values, tuples,
bytes, a few torch value types (``torch.Size``, dtypes, layouts, memory formats) and the DCP
plan dataclasses listed in ``_classes()``, by setting their declared fields. No constructor,
``__reduce__`` or import named by the data runs, so a crafted value can at worst be a wrong
plan (the MAC of ``checkpoint.sealing`` rejects those before they are decoded).
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import functools
import json
from typing import Any

import torch


@functools.cache
def _classes() -> dict[str, type]:
    """The dataclasses a save plan, its global form and its write results are made of
    (imported on first use: torch.distributed.checkpoint costs ~1 s of CPU, and a rank that
    never saves must not pay it; see tests/unit/test_import_cost.py)."""
    from torch.distributed.checkpoint import filesystem as _fs
    from torch.distributed.checkpoint import metadata as _md
    from torch.distributed.checkpoint import planner as _pl
    from torch.distributed.checkpoint import storage as _st

    return {
        c.__name__: c
        for c in (
            _pl.SavePlan,
            _pl.WriteItem,
            _pl.TensorWriteData,
            _pl.BytesIOWriteData,
            _md.MetadataIndex,
            _md.ChunkStorageMetadata,
            _md.TensorProperties,
            _md.BytesStorageMetadata,
            _md.TensorStorageMetadata,
            _md.StorageMeta,
            _st.WriteResult,
            _fs._StorageInfo,
            _fs._StoragePrefix,
        )
    }


@functools.cache
def _enums() -> dict[str, type[enum.Enum]]:
    from torch.distributed.checkpoint import planner as _pl

    return {e.__name__: e for e in (_pl.WriteItemType,)}


_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_LAYOUTS = {str(x): x for x in vars(torch).values() if isinstance(x, torch.layout)}
_FORMATS = {str(x): x for x in vars(torch).values() if isinstance(x, torch.memory_format)}
_TAG = "__p"  # a dict with this key is an encoded non-JSON value


class PlainDataError(ValueError):
    """A value is not plain data (encode), or a text is not one we wrote (decode)."""


def dumps(obj: Any) -> bytes:
    """``obj`` as JSON bytes; raises ``PlainDataError`` naming the first unsupported value."""
    return json.dumps(_enc(obj, "value"), separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    """The value ``dumps`` encoded; raises ``PlainDataError`` on anything else."""
    try:
        return _dec(json.loads(data))
    except PlainDataError:
        raise
    except Exception as exc:  # malformed JSON, wrong field types
        raise PlainDataError(f"not a plain-data value: {type(exc).__name__}: {exc}") from None


def _enc(obj: Any, where: str) -> Any:
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if type(obj) is list:
        return [_enc(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, torch.Size):
        return {_TAG: "size", "v": list(obj)}
    if type(obj) is tuple:
        return {_TAG: "tuple", "v": [_enc(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if type(obj) is dict:
        if all(type(k) is str and k != _TAG for k in obj):
            return {k: _enc(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return {
            _TAG: "dict",
            "v": [[_enc(k, where), _enc(v, f"{where}[{k!r}]")] for k, v in obj.items()],
        }
    if type(obj) in (bytes, bytearray):
        return {_TAG: "bytes", "v": base64.b64encode(obj).decode("ascii")}
    if isinstance(obj, torch.dtype):
        return {_TAG: "dtype", "v": str(obj)}
    if isinstance(obj, torch.layout):
        return {_TAG: "layout", "v": str(obj)}
    if isinstance(obj, torch.memory_format):
        return {_TAG: "format", "v": str(obj)}
    name = type(obj).__name__
    if isinstance(obj, enum.Enum) and _enums().get(name) is type(obj):
        return {_TAG: "enum", "c": name, "v": obj.name}
    if dataclasses.is_dataclass(obj) and _classes().get(name) is type(obj):
        fields = {
            f.name: _enc(getattr(obj, f.name), f"{where}.{f.name}") for f in dataclasses.fields(obj)
        }
        return {_TAG: "dc", "c": name, "v": fields}
    raise PlainDataError(
        f"{where} has type {type(obj).__module__}.{type(obj).__qualname__}, which is not plain "
        "data (JSON values, tuples, bytes, torch.Size/dtype and DCP plan classes)"
    )


def _dec(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_dec(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(_TAG)
    if tag is None:
        return {k: _dec(v) for k, v in obj.items()}
    v = obj["v"]
    if tag == "tuple":
        return tuple(_dec(x) for x in v)
    if tag == "size":
        return torch.Size([int(x) for x in v])
    if tag == "dict":
        return {_dec(k): _dec(x) for k, x in v}
    if tag == "bytes":
        return base64.b64decode(v, validate=True)
    if tag in ("dtype", "layout", "format"):
        tables: dict[str, dict[str, Any]] = {
            "dtype": _DTYPES,
            "layout": _LAYOUTS,
            "format": _FORMATS,
        }
        table = tables[tag]
        if v not in table:
            raise PlainDataError(f"unknown torch {tag} {v!r}")
        return table[v]
    if tag == "enum":
        enum_cls = _enums().get(obj["c"])
        if enum_cls is None or v not in enum_cls.__members__:
            raise PlainDataError(f"unknown enum value {obj['c']}.{v}")
        return enum_cls[v]
    if tag == "dc":
        cls: Any = _classes().get(obj["c"])
        if cls is None:
            raise PlainDataError(f"class {obj['c']!r} is not one of the plan classes")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(v) != names:
            raise PlainDataError(f"{obj['c']} has fields {sorted(names)}, not {sorted(v)}")
        # Fields are set directly: no __init__ / __post_init__ of the class runs on our data.
        out = object.__new__(cls)
        for k, x in v.items():
            object.__setattr__(out, k, _dec(x))
        return out
    raise PlainDataError(f"unknown plain-data tag {tag!r}")
