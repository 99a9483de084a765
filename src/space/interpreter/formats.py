"""Displays E2B's SDK reads beside the usual MIME types, made inside each kernel: a DataFrame's
columns as lists (`data`) and what a matplotlib figure draws (`chart`: its type, title, axes
and elements, in E2B's shape). `register()` adds both to IPython's display formatter; neither
pandas nor matplotlib is imported for them until a cell has.

Both are bounded: a frame of more than MAX_CELLS values (or MAX_DATA_BYTES of JSON), or a
figure of more than MAX_POINTS points, has its usual displays only. A figure whose axes draw
something else (an image, a box plot, lines and bars together) has no chart; a histogram's
bars are a bar chart."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from typing import Any

DATA_MIME = "application/vnd.space.data+json"
CHART_MIME = "application/vnd.space.chart+json"
MAX_CELLS = 100_000
MAX_DATA_BYTES = 8 << 20
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
    """Each column's values as JSON has them (dates in ISO 8601, NaN and NaT as null), column
    by column until MAX_DATA_BYTES of JSON."""
    if frame.size > MAX_CELLS or len({str(c) for c in frame.columns}) < len(frame.columns):
        return None
    data, size = {}, 0
    for column, values in frame.to_dict("list").items():
        data[str(column)] = cells = [_cell(v) for v in values]
        size += len(json.dumps(cells, ensure_ascii=False))
        if size > MAX_DATA_BYTES:
            return None
    return data


def _cell(v: Any) -> Any:
    import pandas

    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, list | tuple):
        return [_cell(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _cell(x) for k, x in v.items()}
    if pandas.api.types.is_scalar(v) and pandas.isna(v):
        return None
    if hasattr(v, "isoformat"):
        return v.isoformat()
    if hasattr(v, "tolist"):  # a numpy scalar or array
        return _cell(v.tolist())
    return str(v)


def figure_chart(figure: Any) -> dict[str, Any] | None:
    axes = figure.get_axes()
    if not axes or sum(_count(ax) for ax in axes) > MAX_POINTS:
        return None
    made = [axes_chart(ax) for ax in axes]
    charts = [c for c in made if c is not None]
    if len(charts) < len(made):
        return None
    if len(charts) == 1:
        return charts[0]
    # Figure.get_suptitle() is matplotlib 3.8's; Debian 12 has 3.6.
    suptitle = getattr(figure, "_suptitle", None)
    title = suptitle.get_text() if suptitle is not None else ""
    return {"type": "superchart", "title": title, "elements": charts}


def _count(ax: Any) -> int:
    """The points an axes' chart would hold, known before any is read."""
    return (sum(len(line.get_xydata()) for line in ax.get_lines()) + len(ax.patches)
            + sum(len(c.get_offsets()) for c in ax.collections))  # fmt: skip


def axes_chart(ax: Any) -> dict[str, Any] | None:
    from matplotlib.collections import PathCollection
    from matplotlib.container import BarContainer
    from matplotlib.patches import Wedge

    title = ax.get_title()
    lines = ax.get_lines()
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    wedges = [p for p in ax.patches if isinstance(p, Wedge)]
    scatters = [c for c in ax.collections if isinstance(c, PathCollection)]
    x, y = _Axis(ax.xaxis), _Axis(ax.yaxis)
    if wedges and len(wedges) == len(ax.patches) and not (lines or scatters):
        return {"type": "pie", "title": title, "elements": [
            {"label": w.get_label(), "angle": abs(w.theta2 - w.theta1), "radius": float(w.r)}
            for w in wedges
        ]}  # fmt: skip
    if bars and not (lines or scatters or wedges or ax.images):
        return {"type": "bar", "title": title, **_labels(ax), "elements": [
            _bar(r, x, y, c.orientation == "horizontal", _name(c, i))
            for i, c in enumerate(bars) for r in c
        ]}  # fmt: skip
    if (lines or scatters) and not (ax.patches or ax.images):
        kind = "line" if lines and not scatters else "scatter" if scatters and not lines else None
        if kind is None:
            return None
        series = lines if kind == "line" else scatters
        return {"type": kind, "title": title, **_labels(ax), **x.ticks("x"), **y.ticks("y"),
                "elements": [
            {"label": s.get_label() if not s.get_label().startswith("_") else "",
             "points": [[x.value(a), y.value(b)] for a, b in
                        (s.get_xydata() if kind == "line" else s.get_offsets())]}
            for s in series
        ]}  # fmt: skip
    return None


def _bar(r: Any, x: _Axis, y: _Axis, horizontal: bool, group: str) -> dict[str, Any]:
    if horizontal:
        label, value = y.label(r.get_y() + r.get_height() / 2), r.get_width()
    else:
        label, value = x.label(r.get_x() + r.get_width() / 2), r.get_height()
    return {"label": label, "group": group, "value": _plain(value)}


def _labels(ax: Any) -> dict[str, Any]:
    return {"x_label": ax.get_xlabel() or None, "y_label": ax.get_ylabel() or None,
            "x_unit": None, "y_unit": None}  # fmt: skip


class _Axis:
    """How positions on one axis read: as dates, as categories or as numbers."""

    def __init__(self, axis: Any) -> None:
        from matplotlib import dates

        self.axis = axis
        mapping = getattr(axis.get_units(), "_mapping", None)  # matplotlib.category.UnitData
        self.categories = (
            {int(v): str(k) for k, v in mapping.items()} if isinstance(mapping, dict) else {}
        )
        self.dates = isinstance(axis.get_major_formatter(), dates.DateFormatter
                                | dates.AutoDateFormatter | dates.ConciseDateFormatter)  # fmt: skip
        self.scale = ("datetime" if self.dates else "categorical" if self.categories
                      else str(axis.get_scale()))  # fmt: skip

    def value(self, v: float) -> Any:
        """A position as its user gave it: a date, a category, or a number (None for a
        missing one: NaN, or masked by matplotlib)."""
        from matplotlib import dates

        if _plain(v) is None:
            return None
        if self.dates:
            return dates.num2date(v).isoformat()
        if self.categories:
            return self.categories.get(round(v), _plain(v))
        return _plain(v)

    def label(self, v: float) -> str:
        value = self.value(v)
        return value if isinstance(value, str) else str(value)

    def ticks(self, name: str) -> dict[str, Any]:
        ticks = list(self.axis.get_ticklocs())
        labels = self.axis.get_major_formatter().format_ticks(ticks)
        return {f"{name}_scale": self.scale, f"{name}_ticks": [self.value(t) for t in ticks],
                f"{name}_tick_labels": labels}  # fmt: skip


def _name(container: Any, index: int) -> str:
    label = container.get_label()
    return label if label and not label.startswith("_") else str(index)


def _plain(v: Any) -> float | int | None:
    """A number JSON carries: numpy's as Python's; NaN, infinities and masked values as null."""
    if type(v).__name__ == "MaskedConstant":  # numpy.ma.masked, without importing numpy
        return None
    number = float(v)
    if not math.isfinite(number):
        return None
    return int(number) if number.is_integer() and abs(number) < 2**53 else number
