"""Figures and widgets for the chapter notebooks (matplotlib; the widget needs ipywidgets).

* `plot_latency`: per-step latency curves (chapters 01-02).
* `plot_block_tables`, `block_table_widget`: the KV block pool, block tables and free list as
  requests come and go (chapters 03-04), from `minirt.course.workloads.StepSnapshot`s.
* `plot_timeline`: which request sits in which collection at every engine step - a Gantt chart
  (chapter 05). `plot_step_tokens`: decode and prefill tokens per step, and the step's duration (06).

Every function draws on the given axes (or a new figure) and returns the figure; nothing here
runs the engine.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch, Rectangle

#: Colors of the engine's collections in timelines.
STATE_COLORS = {"waiting": "#d9d9d9", "prefilling": "#f28e2b", "running": "#4e79a7"}


def request_colors(request_ids) -> dict[str, tuple]:
    """A stable color per request id, in order of first appearance (tab10, then tab20)."""
    ids = list(dict.fromkeys(request_ids))
    cmap = plt.get_cmap("tab10" if len(ids) <= 10 else "tab20")
    return {rid: cmap(i % cmap.N) for i, rid in enumerate(ids)}


def _axes(ax, figsize):
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
    return ax.figure, ax


# ----------------------------------------------------------------------------------- latency


def plot_latency(series: dict, ax=None, xlabel: str = "step (generated token index)",
                 title: str | None = None, logy: bool = False, figsize=(7, 3.5)):
    """Line plot of per-step latency. series: `{label: (x values, seconds per step)}`; drawn in ms."""
    fig, ax = _axes(ax, figsize)
    for label, (x, seconds) in series.items():
        ax.plot(list(x), [s * 1e3 for s in seconds], label=label, lw=1.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ms per step")
    if logy:
        ax.set_yscale("log")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


# ----------------------------------------------------------------------------------- block pool


ROW_HEIGHT = 1.3      # a row of blocks, in block widths (box, id label, gap)
POOL_FONT = 11        # points: block ids, free-list places, the text panel (readable at ~1000 px wide)
CHAR_W = 0.602        # advance of one DejaVu Sans Mono character, in em: lays out colored runs of text


def _pool_shape(num_blocks: int, cols: int | None) -> tuple[int, int]:
    cols = cols or min(num_blocks, 12)
    return cols, -(-num_blocks // cols)


def _ink(color) -> tuple:
    """A color dark enough for text on white: light colors (tab20's pale half) are mixed with black."""
    r, g, b = to_rgb(color)
    lum = 0.299 * r + 0.587 * g + 0.114 * b
    f = min(1.0, 0.5 / lum) if lum > 0.5 else 1.0
    return (r * f, g * f, b * f)


def _wrap(items: list[str], first: int, width: int) -> list[str]:
    """`[a, b, c]` as lines of at most `width` characters (the first one `first`), broken after commas."""
    if not items:
        return ["[]"]
    lines, cur, room = [], "[", first
    for k, item in enumerate(items):
        piece = item + (", " if k < len(items) - 1 else "]")
        if len(cur) + len(piece.rstrip()) > room and cur.strip("[ "):
            lines.append(cur.rstrip())
            cur, room = " ", width
        cur += piece
    return lines + [cur]


def _text_lines(s, colors: dict, width: int = 48) -> list[list[tuple[str, object, str]]]:
    """The text panel of a snapshot: lines of (text, color, weight) runs; request ids in their color."""
    def ids(rids):
        if not rids:
            return [("-", "k", "normal")]
        runs = []
        for k, rid in enumerate(rids):
            runs += [(" " if k else "", "k", "normal"), (rid, _ink(colors.get(rid, "k")), "bold")]
        return runs

    lines = [[(f"{name:<12s}", "k", "normal"), *ids(getattr(s, name))]
             for name in ("waiting", "prefilling", "running")]
    lines += [[]]
    if s.finished:
        lines += [[("finishing this step: ", "#b00000", "bold"), *ids(s.finished)],
                  [("  their blocks are freed after it", "#b00000", "normal")], []]
    lines += [[("block tables", "k", "bold"), ("  (logical 0, 1, ... -> physical)", "#555555", "normal")]]
    for rid, table in sorted(s.block_tables.items()):
        c, ink = colors.get(rid, "k"), _ink(colors.get(rid, "k"))
        head = f"\u25a0 {rid}: "
        parts = _wrap([str(b) for b in table], width - len(head), width - len(head))
        lines += [[("\u25a0 ", c, "normal"), (rid, ink, "bold"), (": " + parts[0], ink, "normal")]]
        lines += [[(" " * len(head) + part, ink, "normal")] for part in parts[1:]]
    lines += [[], [("dark slot: K/V written   light: allocated, empty", "#555555", "normal")],
              [("white fN: free, handed out N-th   //xN: shared", "#555555", "normal")]]
    if s.cached_blocks:
        lines += [[("grey: free, still cached (a hit revives it)", "#555555", "normal")]]
    return lines


def _draw_text(ax, lines, fontsize: float = POOL_FONT):
    """Monospace lines of colored runs, top-left aligned on `ax` (offsets in points)."""
    ax.axis("off")
    for i, runs in enumerate(lines):
        col = 0
        for text, color, weight in runs:
            if text:
                ax.annotate(text, (0, 1), xycoords="axes fraction", xytext=(col * CHAR_W * fontsize, -i * 1.45 * fontsize),
                            textcoords="offset points", va="top", ha="left", fontsize=fontsize,
                            family="DejaVu Sans Mono", color=color, fontweight=weight)
            col += len(text)


def draw_pool(ax, snapshot, colors: dict | None = None, cols: int | None = None, text_ax=None,
              fontsize: float = POOL_FONT):
    """Draw the block pool of one `StepSnapshot` on `ax`, and its block tables on `text_ax` (if given).

    Each block is a box of `block_size` slots, labelled with its block id. A slot is dark in its
    owner's color when it holds K/V (computed by the end of the step), light when allocated but still
    empty. Free blocks are white, labelled with their place in the free list (`f0` is handed out next);
    free blocks that still hold a prefix-cache hash are grey (a hit can revive them). Blocks shared by
    several block tables (reference count > 1) are hatched and show the count. The text panel names
    each request in its color (the legend), its block table, and the requests finishing in this step:
    the snapshot is taken during the step, so their blocks are still drawn and are freed after it.
    """
    s = snapshot
    B, N = s.block_size, s.num_blocks
    cols, rows = _pool_shape(N, cols)
    colors = colors or request_colors(s.block_tables)
    owner, filled = {}, {}
    for rid, table in s.block_tables.items():
        for i, b in enumerate(table):
            owner.setdefault(b, rid)
            filled[b] = max(filled.get(b, 0), min(B, max(0, s.num_computed.get(rid, 0) - i * B)))
    free_pos = {b: i for i, b in enumerate(s.free_blocks)}
    cached = set(s.cached_blocks)
    small = fontsize - 1
    for b in range(N):
        x, y = b % cols, (rows - 1 - b // cols) * ROW_HEIGHT
        if b in owner:
            for j in range(B):
                ax.add_patch(Rectangle((x + 0.05 + 0.9 * j / B, y), 0.9 / B, 0.8, lw=0,
                                       facecolor=colors.get(owner[b], "k"), alpha=1.0 if j < filled[b] else 0.25))
            shared = s.ref_counts[b] > 1
            ax.add_patch(Rectangle((x + 0.05, y), 0.9, 0.8, fill=False, lw=1.6 if shared else 0.8,
                                   hatch="//" if shared else None, edgecolor="k"))
            if shared:
                ax.text(x + 0.5, y + 0.4, f"x{s.ref_counts[b]}", ha="center", va="center", fontsize=small,
                        bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.85))
        else:
            ax.add_patch(Rectangle((x + 0.05, y), 0.9, 0.8, facecolor="#dddddd" if b in cached else "white",
                                   edgecolor="#999999", lw=0.8))
            if b in free_pos:
                ax.text(x + 0.5, y + 0.4, f"f{free_pos[b]}", ha="center", va="center", fontsize=small,
                        color="#666666")
        ax.text(x + 0.07, y + 0.83, str(b), fontsize=small, va="bottom")
    ax.set_xlim(0, cols)
    ax.set_ylim(-0.1, rows * ROW_HEIGHT)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(pool_title(s), loc="left", fontsize=fontsize + 2, fontweight="bold")
    if text_ax is not None:
        _draw_text(text_ax, _text_lines(s, colors), fontsize)


def _pool_figure(num_rows: int, num_blocks: int, cols: int | None, width: float, num_lines: int,
                 fontsize: float = POOL_FONT):
    cols, rows = _pool_shape(num_blocks, cols)
    grid_w = width * 0.58
    text_h = 1.45 * fontsize / 72 * (num_lines + 1)            # the text panel's lines, in inches
    row_h = max(grid_w * rows * ROW_HEIGHT / cols + 0.5, text_h)
    fig, axes = plt.subplots(num_rows, 2, figsize=(width, row_h * num_rows), squeeze=False,
                             gridspec_kw=dict(width_ratios=[0.58, 0.42], wspace=0.04))
    fig.subplots_adjust(left=0.01, right=0.99, top=1 - 0.3 / (row_h * num_rows), bottom=0.01,
                        hspace=0.5 / row_h)
    return fig, axes


def plot_block_tables(snapshots: list, steps: list[int], cols: int | None = None, width: float = 11.0):
    """A static figure of the pool at several steps (one row each): what `block_table_widget` shows."""
    colors = request_colors(rid for s in snapshots for rid in s.block_tables)
    most = max(len(_text_lines(snapshots[k], colors)) for k in steps)
    fig, axes = _pool_figure(len(steps), snapshots[0].num_blocks, cols, width, most)
    for (ax, text_ax), k in zip(axes, steps):
        draw_pool(ax, snapshots[k], colors, cols, text_ax)
    return fig


def pool_title(snapshot) -> str:
    """The title `draw_pool` gives a snapshot's picture: its step and the requests finishing in it."""
    title = f"step {snapshot.step}"
    if snapshot.finished:
        title += f"  (finishing: {', '.join(snapshot.finished)})"
    return title


def _pool_png(snapshots: list, k: int, colors: dict, cols: int | None, width: float, most: int) -> bytes:
    """The pool at `snapshots[k]` as PNG bytes (the figure is closed, never shown)."""
    import io

    fig, ((ax, text_ax),) = _pool_figure(1, snapshots[0].num_blocks, cols, width, most)
    draw_pool(ax, snapshots[k], colors, cols, text_ax)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=plt.rcParams["figure.dpi"])
    plt.close(fig)
    return buf.getvalue()


def block_table_widget(snapshots: list, cols: int | None = None, width: float = 11.0):
    """An ipywidgets slider over the steps of a recording, above the pool at the slider's step (`draw_pool`).

    The picture is one `ipywidgets.HTML` value, an `<img>` whose PNG and title (the figure's title,
    `pool_title`) are replaced together each time the slider moves, so the picture always shows the step
    the slider reads; a figure printed through an `Output` widget can lag behind quick key presses. The
    widget's rich display carries a PNG of the first step as well, which a notebook viewer shows where the
    widget cannot render (a notebook that has not been run or trusted yet).
    """
    import base64
    import html

    import ipywidgets as widgets

    colors = request_colors(rid for s in snapshots for rid in s.block_tables)
    most = max(len(_text_lines(s, colors)) for s in snapshots)
    slider = widgets.IntSlider(value=0, min=0, max=len(snapshots) - 1, description="step",
                               continuous_update=False, layout=widgets.Layout(width="60%"))
    picture = widgets.HTML()

    def redraw(change=None):
        k = slider.value
        png = base64.b64encode(_pool_png(snapshots, k, colors, cols, width, most)).decode()
        title = html.escape(pool_title(snapshots[k]))
        picture.value = (f'<img class="minirt-pool" src="data:image/png;base64,{png}" alt="{title}" '
                         f'title="{title}" style="max-width: 100%">')

    class BlockTableSlider(widgets.VBox):
        def __repr__(self):
            return f"block_table_widget: a slider over {len(snapshots)} steps (run the cell to move it)"

        def _repr_mimebundle_(self, **kwargs):
            data = super()._repr_mimebundle_(**kwargs)
            data["image/png"] = base64.b64encode(_pool_png(snapshots, 0, colors, cols, width, most)).decode()
            return data

    slider.observe(redraw, names="value")
    redraw()
    return BlockTableSlider([slider, picture])


# ----------------------------------------------------------------------------------- engine timeline


def plot_timeline(snapshots: list, ax=None, time_axis: bool = False, figsize=(9, 3.5), title: str | None = None):
    """Gantt chart: one row per request, one cell per engine step, colored by the collection holding it.

    Grey: waiting_queue; orange: prefilling_requests (admitted, prompt being computed); blue:
    running_requests (decoding). x is the step index, or seconds with `time_axis=True`.
    """
    fig, ax = _axes(ax, figsize)
    # rows in order of arrival: within a step, admitted requests came before the waiting ones
    order = list(dict.fromkeys(rid for s in snapshots for rid in s.running + s.prefilling + s.waiting))
    row = {rid: i for i, rid in enumerate(order)}
    for s in snapshots:
        x, w = (s.start_s, s.duration_s) if time_axis else (s.step, 1)
        for state in ("waiting", "prefilling", "running"):
            for rid in getattr(s, state):
                ax.add_patch(Rectangle((x, row[rid] - 0.4), w, 0.8, facecolor=STATE_COLORS[state], lw=0))
    last = snapshots[-1]
    ax.set_xlim(0, last.end_s if time_axis else last.step + 1)
    ax.set_ylim(len(order) - 0.5, -0.5)
    ax.set_yticks(range(len(order)), order)
    ax.set_xlabel("seconds" if time_axis else "engine step")
    ax.set_ylabel("request")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in STATE_COLORS.items()],
              loc="upper right", fontsize=8, ncol=3)
    if title:
        ax.set_title(title)
    return fig


def plot_step_tokens(snapshots: list, ax=None, figsize=(9, 3.5), title: str | None = None):
    """Tokens per engine step, decode (blue) and prefill (orange) stacked, with the step's duration (ms)."""
    fig, ax = _axes(ax, figsize)
    steps = [s.step for s in snapshots]
    dec = [s.num_decode_tokens for s in snapshots]
    pre = [s.num_prefill_tokens for s in snapshots]
    ax.bar(steps, dec, width=1.0, color=STATE_COLORS["running"], label="decode tokens")
    ax.bar(steps, pre, width=1.0, bottom=dec, color=STATE_COLORS["prefilling"], label="prefill tokens")
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens in the step")
    ax2 = ax.twinx()
    ax2.plot(steps, [s.duration_s * 1e3 for s in snapshots], color="k", lw=0.8, label="step time")
    ax2.set_ylabel("ms")
    ax2.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    if title:
        ax.set_title(title)
    return fig
