"""Pictures of a partition: per-client class distribution as stacked horizontal bars (FedPrism Fig. 2).

Uses matplotlib's object API with the Agg canvas, so it never touches the global pyplot backend and
works headless.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["plot_class_distribution"]


def _colors(k: int) -> list:
    from matplotlib import colormaps

    if k <= 10:
        cmap = colormaps["tab10"]
        return [cmap(i) for i in range(k)]
    if k <= 20:
        cmap = colormaps["tab20"]
        return [cmap(i) for i in range(k)]
    cmap = colormaps["turbo"]
    return [cmap(x) for x in np.linspace(0.05, 0.95, k)]


def plot_class_distribution(hist: np.ndarray, path: str | Path, first: int = 20,
                            title: str = "Class distribution per client",
                            class_names: list[str] | None = None, normalize: bool = False) -> Path:
    """Stacked horizontal bars of the first ``first`` clients' label counts; saves to ``path``.

    ``hist`` is [clients, classes] counts (``Partition.hist``). One bar per client (client 0 on top),
    one coloured segment per class; ``normalize=True`` plots shares instead of counts. The file type
    follows the suffix of ``path`` (png, pdf, svg). Returns the path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    h = np.asarray(hist, dtype=np.float64)
    if h.ndim != 2 or h.shape[0] == 0 or h.shape[1] == 0:
        raise ValueError(f"hist must be a non-empty 2-D [clients, classes] array, got shape {h.shape}")
    if isinstance(first, bool) or not isinstance(first, (int, np.integer)) or first < 1:
        raise ValueError(f"first = {first!r} is not valid: an integer >= 1")
    n_cls = h.shape[1]
    if class_names is not None and len(class_names) != n_cls:
        raise ValueError(f"class_names has {len(class_names)} names but hist has {n_cls} classes")
    h = h[: int(first)]
    if normalize:
        tot = h.sum(axis=1, keepdims=True)
        h = np.divide(h, tot, out=np.zeros_like(h), where=tot > 0)
    names = class_names if class_names is not None else [str(c) for c in range(n_cls)]

    n = h.shape[0]
    fig = Figure(figsize=(8.0, max(2.5, 0.32 * n + 1.2)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    y = np.arange(n)
    left = np.zeros(n)
    for c, color in zip(range(n_cls), _colors(n_cls)):
        ax.barh(y, h[:, c], left=left, color=color, label=names[c], height=0.8, edgecolor="none")
        left += h[:, c]
    ax.set_yticks(y)
    ax.set_yticklabels([str(i) for i in range(n)])
    ax.invert_yaxis()
    ax.set_ylabel("client")
    ax.set_xlabel("share of samples" if normalize else "number of samples")
    ax.set_title(title)
    ax.legend(title="class", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small",
              ncol=1 if n_cls <= 20 else 2, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    return path
