"""Typed reads of request fields: each wrong type or range becomes a 400 naming the field."""

from __future__ import annotations

import math
import re
from typing import Any

from .errors import APIError

_MISSING = object()
INT64 = (-(1 << 63), (1 << 63) - 1)
STOP_MAX_CHARS = 1000  # the text filter holds back up to this much of a stream; no stop is that long
# Sampling colder than this is greedy decoding (its limit), and the sampler's 1/temperature would overflow
# float32 (inf and NaN logits: any token, one outside a grammar too) below about 1e-38.
GREEDY_BELOW = 1e-6
# A top-p this small keeps the most likely token alone (its probability is at least 1/vocabulary), as any
# smaller one would, but it stays above float32's smallest numbers: a top-p that rounds to 0 there keeps
# no token at all (garbage out, or a token outside a grammar).
TOP_P_FLOOR = 1e-6
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _get(body: dict, name: str, default: Any) -> Any:
    value = body.get(name, _MISSING)
    return default if value is _MISSING or value is None else value


def integer(body: dict, name: str, default: Any = None, low: int | None = None, high: int | None = None) -> Any:
    value = _get(body, name, default)
    if value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise bad(name, f"'{name}' must be an integer, got {_show(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad(name, f"'{name}' must be {_range(low, high)}, got {_show(value)}")
    return value


def number(body: dict, name: str, default: Any = None, low: float | None = None, high: float | None = None,
           low_open: bool = False) -> Any:
    value = _get(body, name, default)
    if value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, f"'{name}' must be a number, got {_show(value)}")
    try:
        value = float(value)
    except OverflowError:  # an integer past the float range
        value = math.inf
    if not math.isfinite(value):
        raise bad(name, f"'{name}' must be a finite number, got {value}")
    if (low is not None and (value < low or (low_open and value == low))) or (high is not None and value > high):
        opening = "(" if low_open else "["
        raise bad(name, f"'{name}' must be in {opening}{low}, {high}], got {value}")
    return value


def temperature(body: dict, name: str, default: float, high: float) -> float:
    """A sampling temperature in [0, high]; one below `GREEDY_BELOW` is 0 (greedy)."""
    value = number(body, name, default, 0.0, high)
    return 0.0 if value < GREEDY_BELOW else value


def top_p(body: dict, name: str) -> float:
    """A nucleus-sampling top-p in (0, 1] (default 1: off); one below `TOP_P_FLOOR` is that floor."""
    return max(number(body, name, 1.0, 0.0, 1.0, low_open=True), TOP_P_FLOOR)


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = _get(body, name, default)
    if not isinstance(value, bool):
        raise bad(name, f"'{name}' must be true or false, got {_show(value)}")
    return value


def string(body: dict, name: str, default: Any = _MISSING) -> Any:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise APIError(400, f"'{name}' is required", param=name, code="missing_required_parameter")
        return default
    if not isinstance(value, str):
        raise bad(name, f"'{name}' must be a string, got {type(value).__name__}")
    return value


def array(body: dict, name: str, required: bool = False) -> list | None:
    value = body.get(name)
    if value is None:
        if required:
            raise APIError(400, f"'{name}' is required", param=name, code="missing_required_parameter")
        return None
    if not isinstance(value, list):
        raise bad(name, f"'{name}' must be an array, got {type(value).__name__}")
    return value


def stop_strings(body: dict, name: str, limit: int = 16) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad(name, f"'{name}' must be a string or an array of strings")
    if len(value) > limit:
        raise bad(name, f"'{name}' may list at most {limit} strings")
    if any(len(s) > STOP_MAX_CHARS for s in value):
        raise bad(name, f"each of '{name}' may have at most {STOP_MAX_CHARS} characters")
    return [s for s in value if s]


def seed(body: dict, name: str = "seed") -> int | None:
    """A sampling seed: any 64-bit signed integer; a negative one maps to its two's complement
    (MLX takes unsigned seeds), so each seed still names one sequence."""
    value = integer(body, name, None, *INT64)
    return None if value is None else value & ((1 << 64) - 1)


def top_k(body: dict, name: str, vocab_size: int) -> int:
    """Top-k as the sampler takes it: 0 is off, and so are -1 (the OpenAI-style servers' off)
    and any k that keeps the whole vocabulary."""
    value = integer(body, name, 0, low=-1)
    return 0 if value < 0 or value >= vocab_size else value


def unicode_text(body: dict, brackets: bool = True) -> None:
    """Refuse (400, naming the field) a body with a string that is not Unicode text: a lone surrogate,
    which JSON can spell (an unpaired escape such as \\ud800) but UTF-8 cannot. Checked before anything
    reads the body, so no tokenizer, template or reply that echoes the value meets it later.

    `brackets`: name list items as `field[0]` (OpenAI) rather than `field.0` (Anthropic).
    """
    pending: list[tuple[Any, str]] = [(body, "")]
    while pending:
        value, where = pending.pop()
        if isinstance(value, str):
            lone = _SURROGATE.search(value)
            if lone is not None:
                raise bad(where, f"'{where}' is not valid Unicode text: it holds a lone surrogate "
                          f"(an unpaired \\u{ord(lone.group()):x} escape)")
        elif isinstance(value, dict):
            for key, inner in reversed(list(value.items())):
                name = key.encode("utf-8", "backslashreplace").decode("utf-8")
                here = f"{where}.{name}" if where else name
                if name != key:
                    raise bad(here, f"the field name '{here}' is not valid Unicode text: it holds a lone surrogate")
                pending.append((inner, here))
        elif isinstance(value, list):
            pending.extend((inner, f"{where}[{i}]" if brackets else f"{where}.{i}")
                           for i, inner in reversed(list(enumerate(value))))


def _show(value: Any) -> str:
    """A value for an error message, cut short: a hostile body may put megabytes in any field."""
    try:
        text = repr(value)
    except ValueError:  # an integer past Python's digit limit for printing
        return "an integer too long to print"
    return text if len(text) <= 80 else text[:77] + "..."


def _range(low: int | None, high: int | None) -> str:
    if high is None:
        return f">= {low}"
    if low is None:
        return f"<= {high}"
    return f"between {low} and {high}"
