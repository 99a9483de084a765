"""Displays E2B's SDK reads beside the usual MIME types, made inside each kernel: a DataFrame's
columns as lists (`data`) and what a matplotlib figure draws (`chart`: its type, title, axes
and elements, in E2B's shape). `register()` adds both to IPython's display formatter; neither
pandas nor matplotlib is imported for them until a cell has.

Both are bounded: a frame of more than MAX_CELLS values, or a figure of more than MAX_POINTS
points, has its usual displays only. A figure whose axes draw something else (an image, a
histogram of patches that are not bars, a box plot) has no chart."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from typing import Any

DATA_MIME = "application/vnd.space.data+json"
CHART_MIME = "application/vnd.space.chart+json"
MAX_CELLS = 100_000
MAX_POINTS = 100_000


def register() -> None:
    """Both displays on this kernel's IPython (run inside the kernel)."""
    from IPython import get_ipython
    from IPython.core.formatters import JSONFormatter
    from traitlets import Unicode

    class Display(JSONFormatter):
        """`make` for instances of the class `kind` names. Not a printer registered by type:
        matplotlib's inline backend, as it is set up, removes figures from every formatter."""

        kind = ("", "")  # module, class
        make: Callable[[Any], dict[str, Any] | None]

        def __call__(self, obj: Any) -> dict[str, Any] | None:
            cls = getattr(sys.modules.get(self.kind[0]), self.kind[1], None)
            if not self.enabled or cls is None or not isinstance(obj, cls):
                return None
            try:
                return self.make(obj)
            except Exception:  # left out: IPython would print it into the user's output
                return None

    class Data(Display):
        format_type = Unicode(DATA_MIME)
        kind = ("pandas.core.frame", "DataFrame")
        make = staticmethod(frame_data)

    class Chart(Display):
        format_type = Unicode(CHART_MIME)
        kind = ("matplotlib.figure", "Figure")
        make = staticmethod(figure_chart)

    display = get_ipython().display_formatter
    display.formatters[DATA_MIME] = Data(parent=display)
    display.formatters[CHART_MIME] = Chart(parent=display)


def frame_data(frame: Any) -> dict[str, list[Any]] | None:
    """Each column's values, JSON's own (dates in ISO 8601, NaN as null)."""
    if frame.size > MAX_CELLS:
        return None
    return {
        str(column): json.loads(frame[column].to_json(orient="values", date_format="iso"))
        for column in frame.columns
    }


def figure_chart(figure: Any) -> dict[str, Any] | None:
    made = [axes_chart(ax) for ax in figure.get_axes()]
    charts = [c for c in made if c is not None]
    if not charts or len(charts) < len(made):
        return None
    if sum(_size(c) for c in charts) > MAX_POINTS:
        return None
    if len(charts) == 1:
        return charts[0]
    # Figure.get_suptitle() is matplotlib 3.8's; Debian 12 has 3.6.
    suptitle = getattr(figure, "_suptitle", None)
    title = suptitle.get_text() if suptitle is not None else ""
    return {"type": "superchart", "title": title, "elements": charts}


def _size(chart: dict[str, Any]) -> int:
    return sum(len(e.get("points", ())) or 1 for e in chart["elements"])


def axes_chart(ax: Any) -> dict[str, Any] | None:
    from matplotlib.collections import PathCollection
    from matplotlib.container import BarContainer
    from matplotlib.patches import Wedge

    title = ax.get_title()
    lines = ax.get_lines()
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    wedges = [p for p in ax.patches if isinstance(p, Wedge)]
    scatters = [c for c in ax.collections if isinstance(c, PathCollection)]
    if wedges and len(wedges) == len(ax.patches) and not (lines or scatters):
        return {"type": "pie", "title": title, "elements": [
            {"label": w.get_label(), "angle": abs(w.theta2 - w.theta1), "radius": w.r}
            for w in wedges
        ]}  # fmt: skip
    if bars and not (lines or scatters or wedges or ax.images):
        return {"type": "bar", "title": title, **_labels(ax), "elements": [
            {"label": _category(ax, r.get_x() + r.get_width() / 2), "group": _name(c, i),
             "value": _plain(r.get_height())}
            for i, c in enumerate(bars) for r in c
        ]}  # fmt: skip
    if (lines or scatters) and not (ax.patches or ax.images):
        kind = "line" if lines and not scatters else "scatter" if scatters and not lines else None
        if kind is None:
            return None
        series = lines if kind == "line" else scatters
        points = [_points(ax, s.get_xydata() if kind == "line" else s.get_offsets())
                  for s in series]  # fmt: skip
        return {"type": kind, "title": title, **_labels(ax), **_ticks(ax), "elements": [
            {"label": s.get_label() if not s.get_label().startswith("_") else "",
             "points": p}
            for s, p in zip(series, points, strict=True)
        ]}  # fmt: skip
    return None


def _labels(ax: Any) -> dict[str, Any]:
    return {"x_label": ax.get_xlabel() or None, "y_label": ax.get_ylabel() or None,
            "x_unit": None, "y_unit": None}  # fmt: skip


def _ticks(ax: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
        ticks = list(axis.get_ticklocs())
        out[f"{name}_scale"] = _scale(axis)
        out[f"{name}_ticks"] = [_value(axis, t) for t in ticks]
        out[f"{name}_tick_labels"] = axis.get_major_formatter().format_ticks(ticks)
    return out


def _scale(axis: Any) -> str:
    from matplotlib import dates

    if isinstance(axis.get_major_formatter(), dates.DateFormatter | dates.AutoDateFormatter
                  | dates.ConciseDateFormatter):  # fmt: skip
        return "datetime"
    if _categories(axis):
        return "categorical"
    return str(axis.get_scale())


def _categories(axis: Any) -> dict[int, str]:
    mapping = getattr(axis.get_units(), "_mapping", None)  # matplotlib.category.UnitData
    return {int(v): str(k) for k, v in mapping.items()} if isinstance(mapping, dict) else {}


def _value(axis: Any, v: float) -> Any:
    """A position on the axis as its user gave it: a date, a category, or a number."""
    from matplotlib import dates

    scale = _scale(axis)
    if scale == "datetime":
        return dates.num2date(v).isoformat()
    if scale == "categorical":
        return _categories(axis).get(round(v), _plain(v))
    return _plain(v)


def _points(ax: Any, xy: Any) -> list[list[Any]]:
    return [[_value(ax.xaxis, x), _value(ax.yaxis, y)] for x, y in xy]


def _category(ax: Any, x: float) -> str:
    value = _value(ax.xaxis, x)
    return value if isinstance(value, str) else str(value)


def _name(container: Any, index: int) -> str:
    label = container.get_label()
    return label if label and not label.startswith("_") else str(index)


def _plain(v: Any) -> float | int | None:
    """A number JSON carries: numpy's as Python's, NaN and infinities as null."""
    number = float(v)
    if not math.isfinite(number):
        return None
    return int(number) if number.is_integer() and abs(number) < 2**53 else number
