"""Typed messages across process boundaries without pickle.

A message is a dataclass registered with `@message`, sent as a ZMQ multipart: an orjson header
naming the class and holding its fields, then one raw frame per numpy array or CPU tensor in
them. Fields may be None, bool, int, float, str, lists/tuples/dicts of them, enums, arrays and
registered dataclasses; anything else is refused (`MessageError`, naming the field).
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import orjson

T = TypeVar("T")

_MESSAGES: dict[str, type] = {}
_ENUMS: dict[str, type[enum.Enum]] = {}


class MessageError(ValueError):
    """A message that cannot be encoded or decoded; the text says which field and why."""


def message(cls: type[T]) -> type[T]:
    """Register a dataclass as a message type (its class name is its wire name)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass to be a message")
    if cls.__name__ in _MESSAGES and _MESSAGES[cls.__name__] is not cls:
        raise TypeError(f"two message classes are named {cls.__name__}")
    _MESSAGES[cls.__name__] = cls
    return cls


def register_enum(cls: type[enum.Enum]) -> type[enum.Enum]:
    _ENUMS[cls.__name__] = cls
    return cls


def encode(msg: Any) -> list[bytes | memoryview]:
    """Frames for `msg`: the header first, then one frame per array."""
    frames: list[bytes | memoryview] = []
    body = _encode_value(msg, frames, "message")
    return [orjson.dumps(body), *frames]


def decode(frames: Sequence[bytes | memoryview | Any]) -> Any:
    """Rebuild a message from its frames (zmq.Frame objects and numpy arrays are read without
    copying; tensors are copied); an unknown class or a malformed header is a MessageError."""
    if not frames:
        raise MessageError("empty message")
    buffers = [f.buffer if hasattr(f, "buffer") else f for f in frames]
    try:
        body = orjson.loads(bytes(buffers[0]))
    except orjson.JSONDecodeError as err:
        raise MessageError(f"message header is not JSON: {err}") from err
    return _decode_value(body, buffers[1:])


def _encode_value(value: Any, frames: list, path: str) -> Any:
    if isinstance(value, enum.Enum):  # before int: an IntEnum is an int too
        name = type(value).__name__
        if name not in _ENUMS:
            raise MessageError(f"{path}: enum {name} is not registered for messages")
        return {"__enum__": name, "value": value.value}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    torch = sys.modules.get("torch")  # not imported: no value is a tensor
    if torch is not None and isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise MessageError(f"{path}: tensors must be on the CPU to be sent")
        value = value.detach().contiguous()
        if value.dtype == torch.bfloat16:
            frames.append(memoryview(value.view(torch.int16).numpy()).cast("B"))
            return {"__tensor__": len(frames) - 1, "dtype": "bfloat16", "shape": list(value.shape)}
        return _encode_array(value.numpy(), frames, "__tensor__")
    if isinstance(value, np.ndarray):
        return _encode_array(value, frames, "__array__")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        if _MESSAGES.get(name) is not type(value):
            raise MessageError(f"{path}: {name} is not a registered message type")
        fields = {
            f.name: _encode_value(getattr(value, f.name), frames, f"{path}.{f.name}")
            for f in dataclasses.fields(value)
        }
        return {"__message__": name, "fields": fields}
    if isinstance(value, (list, tuple)):
        return [_encode_value(v, frames, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or k.startswith("__"):
                raise MessageError(f"{path}: dict keys must be strings not starting with '__'")
            out[k] = _encode_value(v, frames, f"{path}.{k}")
        return out
    raise MessageError(f"{path}: cannot send a {type(value).__name__}")


def _encode_array(array: np.ndarray, frames: list, tag: str) -> dict[str, Any]:
    array = np.ascontiguousarray(array)
    if array.dtype == object:
        raise MessageError("object arrays cannot be sent")
    frames.append(memoryview(array).cast("B") if array.size else b"")
    return {tag: len(frames) - 1, "dtype": array.dtype.str, "shape": list(array.shape)}


def _decode_value(value: Any, frames: list) -> Any:
    if isinstance(value, list):
        return [_decode_value(v, frames) for v in value]
    if not isinstance(value, dict):
        return value
    if "__message__" in value:
        name = value["__message__"]
        cls = _MESSAGES.get(name)
        if cls is None:
            raise MessageError(f"unknown message type {name!r}")
        fields = {k: _decode_value(v, frames) for k, v in value["fields"].items()}
        try:
            return cls(**fields)
        except TypeError as err:
            raise MessageError(f"{name}: {err}") from err
    if "__enum__" in value:
        cls = _ENUMS.get(value["__enum__"])
        if cls is None:
            raise MessageError(f"unknown enum {value['__enum__']!r}")
        return cls(value["value"])
    if "__array__" in value or "__tensor__" in value:
        index = value.get("__array__", value.get("__tensor__"))
        if not isinstance(index, int) or not 0 <= index < len(frames):
            raise MessageError(f"message refers to a missing frame {index!r}")
        shape = tuple(value["shape"])
        if value["dtype"] == "bfloat16":
            raw = np.frombuffer(frames[index], dtype=np.int16).reshape(shape)
            import torch

            return torch.from_numpy(raw.copy()).view(torch.bfloat16)
        array = np.frombuffer(frames[index], dtype=np.dtype(value["dtype"])).reshape(shape)
        if "__tensor__" not in value:
            return array
        import torch

        return torch.from_numpy(array.copy())
    return {k: _decode_value(v, frames) for k, v in value.items()}


def send_message(sock: Any, msg: Any, flags: int = 0) -> None:
    """Send `msg` on a ZMQ socket as one multipart message (arrays are not copied)."""
    sock.send_multipart(encode(msg), flags=flags, copy=False)


def recv_message(sock: Any, flags: int = 0) -> Any:
    return decode(sock.recv_multipart(flags=flags, copy=False))


async def asend_message(sock: Any, msg: Any) -> None:
    """`send_message` for a zmq.asyncio socket."""
    await sock.send_multipart(encode(msg), copy=False)


async def arecv_message(sock: Any) -> Any:
    return decode(await sock.recv_multipart(copy=False))
