"""The header form of a local-tier shard's non-tensor leaves that are not JSON (bytes, RNG
states, small objects), and the restricted loader that reads them back (also the persistent
tier's and the Lightning loader's: nothing named by the data is imported or called)."""

from __future__ import annotations

import base64
import copy
import io
from typing import Any

import torch

from restartable.checkpoint.errors import CheckpointError

# Header form of a leaf that is neither a tensor nor JSON (bytes, RNG states, small objects):
# torch.save's bytes, base64-encoded, read back with torch.load(weights_only=True) (the restricted
# loader DCP and torch use: tensors, containers, primitives and the NumPy types RNG states hold;
# nothing named by the data is imported or called). A shard comes from a node-local directory or
# a peer, which others may be able to write: a header never runs code. An object that the
# restricted loader would refuse is refused at save time, with its key.
_SAVED = "__restartable_saved__"
# Header form of a ``bytes`` leaf (the re-run machine's RNG and data snapshots): base64 of the
# bytes themselves. bytes cannot hold code, so no torch.save / restricted load round trip is
# needed; that round trip cost ~0.5 ms per leaf on every save (two of the example's leaves, most
# of the tier's own work on the training thread: benchmarks/step_overhead.py).
_BYTES = "__restartable_bytes__"


def encode_object(key: str, obj: Any) -> dict[str, str]:
    """The header form of a leaf that is neither a tensor, JSON nor bytes; CheckpointError
    naming ``key`` when the restricted loader would refuse it."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        payload = buf.getvalue()
        safe_load(payload)
    except Exception as exc:
        raise CheckpointError(
            f"state entry {key!r} has type {type(obj).__name__}, which the local tier cannot "
            f"keep as plain data ({short_reason(exc)}): use tensors, dicts, lists, "
            "scalars, bytes, NumPy arrays or Stateful objects whose state_dict() holds those"
        ) from exc
    return {_SAVED: base64.b64encode(payload).decode("ascii")}


def decode_object(src: Any) -> Any:
    """A header value back into the state's form: restricted-loaded, or a copy of the JSON."""
    if isinstance(src, dict) and len(src) == 1 and _BYTES in src:
        try:
            return base64.b64decode(src[_BYTES], validate=True)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"a local-tier shard holds bytes that do not decode ({exc}): refused; the copy "
                "is corrupt or was not written by this job"
            ) from exc
    if isinstance(src, dict) and set(src) == {_SAVED}:
        try:
            return safe_load(base64.b64decode(src[_SAVED]))
        except Exception as exc:
            raise CheckpointError(
                f"a local-tier shard holds an object that is not plain data ({short_reason(exc)})"
                ": refused unread; the file was not written by this job"
            ) from exc
    return copy.deepcopy(src)


def encode_bytes(obj: bytes) -> dict[str, str]:
    """The header form of a ``bytes`` leaf."""
    return {_BYTES: base64.b64encode(obj).decode("ascii")}


def safe_load(payload: bytes) -> Any:
    """``torch.load(weights_only=True)`` of ``payload``, also allowing the NumPy types of an RNG
    state (``numpy.random.get_state()``)."""
    with torch.serialization.safe_globals(numpy_globals()):
        return torch.load(io.BytesIO(payload), weights_only=True)


def short_reason(exc: BaseException) -> str:
    """The line of torch's weights-only refusal that names the global, not its long advice."""
    text = str(exc)
    for line in text.splitlines():
        if "WeightsUnpickler error" in line:
            return line.strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def numpy_globals() -> list[Any]:
    """What the restricted loader accepts beyond torch's defaults: the plain built-in types an
    object's pickle names (bytes, sets) and the NumPy callables and types a NumPy array or
    scalar unpickles through (an RNG state)."""
    import numpy as np

    multiarray = getattr(np, "_core", np.core).multiarray  # numpy 2 / 1
    dtypes = {type(np.dtype(c)) for c in "?bhilqBHILQefdgFDG"}
    plain = [bytes, bytearray, set, frozenset]
    return [*plain, multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype, *dtypes]
