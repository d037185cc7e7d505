"""What every report plot shares: matplotlib on the Agg backend, axis labels, grid and legend, saving.

The reports of `bench load`, `bench physics`, `demo` and `plan` all draw with these, so their PNGs
look alike. matplotlib is imported inside the functions: importing a report module stays cheap,
and no display is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, so plots render on a machine with no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label_axis(axis: Any, xlabel: str, ylabel: str, title: str, *, title_size: float | None = None,
               grid_which: str = "major", legend: bool = True, legend_size: float | None = 8,
               legend_loc: str | None = None) -> None:
    """Labels, a light grid and a legend, set one way so that every report's axes read alike."""
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    if title_size is None:
        axis.set_title(title)
    else:
        axis.set_title(title, fontsize=title_size)
    axis.grid(True, which=grid_which, alpha=0.3)
    if legend:
        options = {"fontsize": legend_size, "loc": legend_loc}
        axis.legend(**{key: value for key, value in options.items() if value is not None})


def save_figure(figure: Any, path: Path, dpi: int = 110) -> None:
    """Lay out, write and close `figure`: closing frees it, as a report draws many in one process."""
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    pyplot().close(figure)


def finish_figure(figure: Any, axis: Any, path: Path, xlabel: str, ylabel: str, title: str, *,
                  legend: bool = True, dpi: int = 110, **options: Any) -> None:
    """`label_axis` then `save_figure`, for the common one-axis plot; `options` go to `label_axis`."""
    label_axis(axis, xlabel, ylabel, title, legend=legend, **options)
    save_figure(figure, path, dpi)
