"""One encoding of a Hugging Face ``rope_scaling`` dict for every route.

:class:`Scaling` is the dict frozen: hashable (a key of the repeat-call cache and a static argument
of JAX's transformations), and turned back into the same dict by :meth:`Scaling.as_dict`. A torch
custom op cannot take a dict, so :func:`scaling_op_args` writes one as a text and a list of
numbers, which :func:`scaling_from_op_args` reads back. The text is made of length-prefixed tokens,
so no key or string value can be mistaken for the structure around it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


def _freeze(value):
    if isinstance(value, Mapping):
        return Scaling.from_dict(value)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, np.ndarray):
        return tuple(_freeze(v) for v in value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    return value


def _thaw(value):
    if isinstance(value, Scaling):
        return value.as_dict()
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def check_scaling_dict(scaling, op_name: str = "apply_rope") -> None:
    if not isinstance(scaling, Mapping):
        raise TypeError(
            f"{op_name}: scaling must be None or a Hugging Face rope_scaling dict, "
            f"got {type(scaling).__name__}"
        )
    for key in scaling:
        if not isinstance(key, str):
            raise TypeError(f"{op_name}: scaling keys must be plain strings, got {key!r}")


@dataclass(frozen=True)
class Scaling:
    """A rope_scaling dict as a hashable value: its items in order, lists as tuples."""

    items: tuple

    @classmethod
    def from_dict(cls, scaling, op_name: str = "apply_rope") -> "Scaling | None":
        if scaling is None or isinstance(scaling, Scaling):
            return scaling
        check_scaling_dict(scaling, op_name)
        return cls(tuple((key, _freeze(value)) for key, value in scaling.items()))

    def as_dict(self) -> dict:
        return {key: _thaw(value) for key, value in self.items}


def exact_key(value):
    """A hashable form of an option that tells apart values which compare equal across types
    (``1``, ``1.0``, ``True``): a repeat call must not reuse what an earlier call of another type
    was accepted with. Raises TypeError for an unhashable value."""
    if isinstance(value, Mapping):
        return (dict,) + tuple((key, exact_key(v)) for key, v in value.items())
    if isinstance(value, (list, tuple)):
        return (type(value),) + tuple(exact_key(v) for v in value)
    hash(value)
    return type(value), value


def as_dict(scaling) -> dict | None:
    """The dict behind ``scaling`` (a dict, a :class:`Scaling` or None)."""
    return scaling.as_dict() if isinstance(scaling, Scaling) else scaling


# ----------------------------------------------------------------------------------------------
# As torch custom-op arguments. Written with the few Python operations torch.compile traces
# without a graph break (string concatenation, len, str of an int, isinstance): under
# dynamic=True the dict's numbers may be symbolic, so they go into the float list, never into text.


def _token(text: str) -> str:
    return str(len(text)) + ":" + text


def _encode_value(value, numbers: list, op_name: str) -> str:
    if value is None:
        return _token("none")
    if isinstance(value, str):
        return _token("str") + _token(value)
    if isinstance(value, (bool, np.bool_)):
        return _token("true" if value else "false")
    if isinstance(value, Mapping):
        return _token("dict") + _encode_items(value, numbers, op_name)
    if isinstance(value, (list, tuple)):
        text = _token("list") + _token(str(len(value)))
        for element in value:
            text = text + _encode_value(element, numbers, op_name)
        return text
    if isinstance(value, (int, np.integer)):
        numbers.append(float(value))
        return _token("int")
    if isinstance(value, (float, np.floating)) or type(value).__name__ == "SymFloat":
        numbers.append(value)
        return _token("float")
    raise TypeError(f"{op_name}: scaling holds a value that is not a number, string, bool, None, "
                    f"list or dict: {value!r}")


def _encode_items(scaling, numbers: list, op_name: str) -> str:
    text = _token(str(len(scaling)))
    for key, value in scaling.items():
        if not isinstance(key, str):
            raise TypeError(f"{op_name}: scaling keys must be plain strings, got {key!r}")
        text = text + _token(key) + _encode_value(value, numbers, op_name)
    return text


def scaling_op_args(scaling, op_name: str = "apply_rope"):
    """``(text, numbers)`` for a rope_scaling dict, ``(None, None)`` for None."""
    if scaling is None:
        return None, None
    scaling = as_dict(scaling)
    check_scaling_dict(scaling, op_name)
    numbers: list = []
    return _encode_items(scaling, numbers, op_name), numbers


class _Reader:
    def __init__(self, text: str, numbers):
        self.text, self.at, self.numbers = text, 0, iter(numbers or ())

    def token(self) -> str:
        colon = self.text.index(":", self.at)
        length = int(self.text[self.at:colon])
        start = colon + 1
        self.at = start + length
        return self.text[start:self.at]

    def value(self):
        kind = self.token()
        if kind == "none":
            return None
        if kind == "str":
            return self.token()
        if kind in ("true", "false"):
            return kind == "true"
        if kind == "dict":
            return self.items()
        if kind == "list":
            return [self.value() for _ in range(int(self.token()))]
        if kind == "int":
            return int(round(next(self.numbers)))
        return next(self.numbers)

    def items(self) -> dict:
        return {self.token(): self.value() for _ in range(int(self.token()))}


def scaling_from_op_args(text, numbers) -> dict | None:
    """The rope_scaling dict that :func:`scaling_op_args` wrote."""
    if text is None:
        return None
    return _Reader(text, numbers).items()
