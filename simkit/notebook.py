"""Notebook helpers: interactive controls that degrade to static output when run headless.

``interact(fn, **controls)`` shows ipywidgets controls for ``fn``'s arguments in a live Jupyter
front end and redraws on change. When the notebook runs headless — executed by the tests or CI
(``SIMKIT_STATIC=1``, or ``SIMKIT_FAST=1``), or when ipywidgets is not installed — it calls
``fn`` once at the default values instead, so its output (and any exception) lands in the cell
output like ordinary code. That matters: under ipywidgets an exception raised inside ``fn`` is
shown in the widget and does not fail the cell, so a broken notebook would pass CI.

Controls:

- ``Slider(min, max, step, value)`` — a float slider (an int slider when all four are ints);
- ``LogSlider(min, max, value)`` — a float slider on a log scale (bounds are values, not
  exponents);
- ``Choice(options, value=None)`` — a dropdown (default: the first option);
- a tuple ``(min, max, step, value)`` is shorthand for ``Slider``; a list is shorthand for
  ``Choice``; any other value is passed through fixed.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Choice", "LogSlider", "Slider", "default_value", "interact", "is_static"]


@dataclasses.dataclass(frozen=True)
class Slider:
    """A linear slider from ``min`` to ``max`` by ``step``, starting at ``value``."""

    min: float
    max: float
    step: float
    value: float

    def __post_init__(self):
        for name in ("min", "max", "step", "value"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"Slider {name} must be a finite number, got {v!r}")
        if not self.min < self.max:
            raise ValueError(f"Slider needs min < max, got min={self.min}, max={self.max}")
        if not self.step > 0:
            raise ValueError(f"Slider step must be > 0, got {self.step}")
        if not self.min <= self.value <= self.max:
            raise ValueError(
                f"Slider value {self.value} is outside [min, max] = [{self.min}, {self.max}]"
            )

    @property
    def integer(self) -> bool:
        return all(isinstance(getattr(self, n), int) for n in ("min", "max", "step", "value"))


@dataclasses.dataclass(frozen=True)
class LogSlider:
    """A slider on a log10 scale between the positive values ``min`` and ``max``."""

    min: float
    max: float
    value: float

    def __post_init__(self):
        for name in ("min", "max", "value"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not 0 < v < math.inf:
                raise ValueError(f"LogSlider {name} must be a positive finite number, got {v!r}")
        if not self.min < self.max:
            raise ValueError(f"LogSlider needs min < max, got min={self.min}, max={self.max}")
        if not self.min <= self.value <= self.max:
            raise ValueError(
                f"LogSlider value {self.value} is outside [min, max] = [{self.min}, {self.max}]"
            )


@dataclasses.dataclass(frozen=True)
class Choice:
    """A dropdown over ``options``; ``value`` defaults to the first option."""

    options: Sequence[Any]
    value: Any = None

    def __post_init__(self):
        options = tuple(self.options)
        if not options:
            raise ValueError("Choice needs at least one option")
        object.__setattr__(self, "options", options)
        if self.value is None:
            object.__setattr__(self, "value", options[0])
        elif self.value not in options:
            raise ValueError(f"Choice value {self.value!r} is not one of the options {options}")


def _as_control(name: str, spec):
    if isinstance(spec, Slider | LogSlider | Choice):
        return spec
    if isinstance(spec, tuple):
        if len(spec) != 4:
            raise ValueError(
                f"control {name!r}: a tuple must be (min, max, step, value), got {spec!r}"
            )
        return Slider(*spec)
    if isinstance(spec, list):
        return Choice(spec)
    return spec


def default_value(control) -> Any:
    """The value a control starts at (a fixed value is its own default)."""
    if isinstance(control, Slider | LogSlider | Choice):
        return control.value
    return control


def is_static() -> bool:
    """True when notebooks must not use widgets: ``SIMKIT_STATIC=1`` or ``SIMKIT_FAST=1``
    (headless execution by the tests and CI), or ipywidgets is not installed."""
    for var in ("SIMKIT_STATIC", "SIMKIT_FAST"):
        if os.environ.get(var, "0") == "1":
            return True
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return True
    return False


def _widget(name: str, control):
    import ipywidgets as widgets

    if isinstance(control, Slider):
        cls = widgets.IntSlider if control.integer else widgets.FloatSlider
        return cls(
            min=control.min,
            max=control.max,
            step=control.step,
            value=control.value,
            description=name,
            continuous_update=False,
        )
    if isinstance(control, LogSlider):
        return widgets.FloatLogSlider(
            base=10,
            min=math.log10(control.min),
            max=math.log10(control.max),
            step=(math.log10(control.max) - math.log10(control.min)) / 100,
            value=control.value,
            description=name,
            continuous_update=False,
        )
    if isinstance(control, Choice):
        return widgets.Dropdown(
            options=list(control.options), value=control.value, description=name
        )
    return widgets.fixed(control)


def interact(fn: Callable[..., Any], **controls) -> Any:
    """Show ``fn`` with interactive controls, or call it once at the defaults when static.

    Returns ``fn``'s result in static mode, the ipywidgets interactive object otherwise.
    """
    if not callable(fn):
        raise TypeError(f"interact needs a callable, got {type(fn).__name__}")
    parsed = {name: _as_control(name, spec) for name, spec in controls.items()}
    if is_static():
        return fn(**{name: default_value(c) for name, c in parsed.items()})
    import ipywidgets as widgets

    return widgets.interact(fn, **{name: _widget(name, c) for name, c in parsed.items()})
