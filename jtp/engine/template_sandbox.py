"""Chat templates come with the checkpoint, so they are untrusted code: render them in jinja2's
sandbox, with a time limit, an output cap and a cap on what one expression may build.

A Python thread cannot be killed, but it can be interrupted between bytecodes: when a render runs
past its time limit, a timer raises an exception inside the rendering thread (CPython's
PyThreadState_SetAsyncExc), which unwinds the template's compiled loops. Single operations that
would allocate huge values at once (`'x' * 10**9`, `2 ** 10**9`, `'x'.ljust(10**10)`) are refused
before they run, since no exception can interrupt them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import numbers
import threading
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

MAX_VALUE_SIZE = 1 << 24  # characters / items one expression may build
_MAX_POWER_BITS = 1 << 16  # bits of an integer power's result


class TemplateLimitError(ValueError):
    """A chat template ran past its time limit or built more than its caps allow."""


@dataclasses.dataclass(frozen=True)
class TemplateLimits:
    time_limit: float = 5.0  # seconds one render may take
    max_chars: int = MAX_VALUE_SIZE  # characters one render may produce


class TemplateOutputError(TemplateLimitError):
    """The rendered prompt passed `max_chars`."""


class _Expired(BaseException):
    """Raised inside the rendering thread when its time is up (a BaseException: templates and
    jinja's own code never catch it)."""


def _refuse(what: str) -> None:
    raise TemplateLimitError(f"the chat template {what}; at most {MAX_VALUE_SIZE} characters or items "
                             f"are allowed per value")


def _check_size(value: Any, what: str) -> None:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(value) > MAX_VALUE_SIZE:
        _refuse(f"{what} {value}")


def _sized(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


class BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox with sizes checked where one operation could allocate without bound."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                size = _sized(seq)
                if size is not None and isinstance(times, int) and size * times > MAX_VALUE_SIZE:
                    _refuse(f"repeats a value of length {size} {times} times")
        elif operator == "+":
            a, b = _sized(left), _sized(right)
            if a is not None and b is not None and a + b > MAX_VALUE_SIZE:
                _refuse(f"joins values of {a} and {b} characters or items")
        elif (operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1
              and right * abs(left).bit_length() > _MAX_POWER_BITS):
            raise TemplateLimitError(f"the chat template computes {left} ** {right}, a number too large")
        return super().call_binop(context, operator, left, right)

    def call(self, context, obj, /, *args, **kwargs):
        for value in (*args, *kwargs.values()):
            _check_size(value, "passes a call the size")
        return super().call(context, obj, *args, **kwargs)


def _bounded_filter(f):
    @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
    def checked(*args, **kwargs):
        for value in (*args, *kwargs.values()):
            _check_size(value, f"passes the {f.__name__} filter the size")
        return f(*args, **kwargs)

    return checked


def make_environment() -> BoundedEnvironment:
    # The settings match transformers' (trim_blocks, lstrip_blocks, loop controls).
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
    return env


class _Deadline:
    """Raises `_Expired` in the thread that entered it once `seconds` have passed."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._lock = threading.Lock()
        self._done = self._fired = False
        self._thread = threading.get_ident()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def _expire(self) -> None:
        with self._lock:
            if not self._done:
                self._fired = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread), ctypes.py_object(_Expired))

    def __exit__(self, *exc) -> None:
        self._timer.cancel()
        with self._lock:
            self._done = True
            if self._fired:  # an exception not yet delivered must not escape into the caller's code
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread), None)


def render_bounded(template: jinja2.Template, variables: dict[str, Any], limits: TemplateLimits) -> str:
    """The template's output; TemplateLimitError if it runs too long or produces too much."""
    try:
        with _Deadline(limits.time_limit):
            pieces, size = [], 0
            for piece in template.generate(**variables):
                size += len(piece)
                if size > limits.max_chars:
                    raise TemplateOutputError(f"the chat template's output passed {limits.max_chars} characters")
                pieces.append(piece)
            return "".join(pieces)
    except _Expired:
        raise TemplateLimitError(f"the chat template ran past its time limit of {limits.time_limit:g} s") from None
