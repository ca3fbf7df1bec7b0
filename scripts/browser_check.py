#!/usr/bin/env python
"""Open a chapter notebook in JupyterLab, in headless Chromium, and look at it as a student would.

What it checks
--------------
Flow ``run_all`` (always):
  1. JupyterLab starts (headless, on localhost, a free port, a random token, throwaway
     config/runtime/settings dirs, ``--ServerApp.root_dir`` = the repo root) and the notebook opens
     with a live kernel, no dialog in the way.
  2. After *Clear All Outputs* (so that everything checked below was produced in this run),
     *Run > Run All Cells* (the JupyterLab command ``notebook:run-all-cells``) runs every code
     cell: each one gets an execution count, none has an error output, and the kernel ends idle.
     Text a student would see on stderr (warnings, pink boxes) is listed as WARN lines.
Flow ``widget`` (when an output has an ipywidgets slider, e.g. chapter 03's
``views.block_table_widget``; ``--widget auto|require|skip``):
  0. before anything runs, each committed widget output shows a picture (the PNG that
     ``views.block_table_widget`` puts in its display next to the widget), not the widget's text repr;
  3. scrolled to the widget, the slider (``.jupyter-widgets`` / ``.widget-slider``) and its image
     (an ``<img>`` in an ``ipywidgets.HTML``, or inside an output widget) are rendered;
  4. pressing the right-arrow key on the focused slider handle (or, failing that, dragging the
     handle) moves the slider (its readout changes) and the image is redrawn (its PNG changes);
  5. once the readout has settled, the redrawn picture's title (the ``<img>``'s ``title`` attribute,
     set from the same ``views.pool_title`` string as the figure's title, in the same widget value as
     the PNG) names the step the slider reads: ``step N`` for readout ``N``. A picture that lags behind
     the slider fails here.

Screenshots (under ``--out``, one folder per notebook): ``01_opened.png`` (the notebook as opened,
with its committed outputs; ``01_widget_as_opened.png``: its first widget then), ``02_top.png`` (the top after Run All), ``pages/page_NN.png`` (the whole
notebook, one screen at a time), ``03_widget_page.png`` and ``04_widget_before.png`` /
``05_widget_after.png`` (the widget alone, before and after moving the slider).

It prints one PASS / FAIL / WARN line per check and a verdict; the exit status is 0 when every check
passed, 1 when one failed, 2 when JupyterLab or the browser could not be started. JupyterLab is shut
down on exit, on error and on Ctrl-C/SIGTERM. Nothing is saved: autosave is off in the throwaway
settings, checkpoints go to a temp dir, and the page's writes to ``/api/contents`` are blocked (reported as
WARN if JupyterLab tries). The notebook file is never written by this script.

How to run it (from the repo root, with the venv active)::

    python scripts/browser_check.py                       # chapters/ch03_paged_blocks.ipynb
    python scripts/browser_check.py --notebook chapters/ch00_setup.ipynb --out /tmp/minirt_browser
    python scripts/browser_check.py --help

What it needs (not part of CI: there is no browser there):
  * Debian's Chromium, used as ``/usr/bin/chromium``: ``apt-get install -y chromium``
    (do not run ``playwright install``; ``--chromium PATH`` picks another binary);
  * ``pip install playwright`` in the venv;
  * the ``notebooks`` extra (jupyterlab, ipywidgets, matplotlib).

Flow ``quiz`` (``--quiz``; in ``scripts/quiz_flow.py``): the chapter's self-check activities
(``minirt.course.activities``) clicked as a student would: radio labels wrapping beside their buttons, a wrong
and a right answer, a section link that scrolls to its heading, a wrong then a right number, the feedback and
the score; a treasure-hunt answer opened; the nbconvert HTML render of the same notebook shows
the questions with the answers folded. Screenshots ``06_quiz_before.png`` ... ``10_static_html_quiz.png``.

Flows are plain functions ``flow_xxx(ctx) -> None`` that record checks on ``ctx.report``; a new one
is written the same way and added in ``main``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


class SetupError(RuntimeError):
    """JupyterLab, the browser or the notebook could not be brought up: exit status 2."""


# ----------------------------------------------------------------------------------- the report


@dataclass
class Report:
    """PASS / FAIL / WARN lines, printed as they come."""

    lines: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, status: str, name: str, detail: str = "") -> None:
        self.lines.append((status, name, detail))
        print(f"{status:4} {name}" + (f": {detail}" if detail else ""), flush=True)

    def check(self, ok: bool, name: str, detail: str = "") -> bool:
        self.add("PASS" if ok else "FAIL", name, detail)
        return ok

    def warn(self, name: str, detail: str = "") -> None:
        self.add("WARN", name, detail)

    @property
    def failed(self) -> list[str]:
        return [name for status, name, _ in self.lines if status == "FAIL"]


def log(msg: str) -> None:
    print(f"  .. {msg}", flush=True)


# ----------------------------------------------------------------------------------- JupyterLab


@dataclass
class Lab:
    url: str        # http://127.0.0.1:PORT
    token: str
    log_path: Path

    def api(self, path: str, method: str = "GET", timeout: float = 5.0) -> int:
        req = urllib.request.Request(self.url + path, method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_lab_settings(settings_dir: Path) -> None:
    """Throwaway user settings: no autosave (the chapter file must stay as committed), no news toast."""
    settings = {
        "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
            {"fetchNews": "false", "checkForUpdates": False},
    }
    for rel, value in settings.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


@contextlib.contextmanager
def jupyterlab(workdir: Path, startup_timeout: float = 120.0):
    """Start JupyterLab headless on localhost; yield a `Lab`; always shut it down (and its kernels)."""
    port, token = free_port(), secrets.token_hex(16)
    for sub in ("config", "data", "runtime", "settings", "workspaces", "checkpoints"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    write_lab_settings(workdir / "settings")
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(workdir / "config"), JUPYTER_DATA_DIR=str(workdir / "data"),
               JUPYTER_RUNTIME_DIR=str(workdir / "runtime"), JUPYTER_PLATFORM_DIRS="1",
               PYDEVD_DISABLE_FILE_VALIDATION="1")
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={REPO}", "--expose-app-in-browser",
           f"--LabApp.user_settings_dir={workdir / 'settings'}",
           f"--LabApp.workspaces_dir={workdir / 'workspaces'}",
           # checkpoints in the temp dir, not chapters/.ipynb_checkpoints
           f"--FileCheckpoints.checkpoint_dir={workdir / 'checkpoints'}",
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.extension_manager=readonly", "--ServerApp.terminals_enabled=False"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")     # containers often run as root
    lab = Lab(f"http://127.0.0.1:{port}", token, workdir / "jupyterlab.log")
    logf = open(lab.log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise SetupError(f"JupyterLab exited with {proc.returncode}:\n{lab.log_tail()}")
            try:
                if lab.api("/api/status") == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise SetupError(f"JupyterLab not up after {startup_timeout:.0f}s:\n{lab.log_tail()}")
            time.sleep(0.5)
        log(f"JupyterLab up at {lab.url} (pid {proc.pid}, log {lab.log_path})")
        yield lab
    finally:
        stop_jupyterlab(proc, lab)
        logf.close()


def stop_jupyterlab(proc: subprocess.Popen, lab: Lab) -> None:
    """Ask the server to shut down (it stops its kernels); then SIGTERM; then SIGKILL its process group."""
    if proc.poll() is None:
        with contextlib.suppress(Exception):
            lab.api("/api/shutdown", method="POST")
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=15)
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log(f"JupyterLab stopped (exit {proc.returncode})")


# ----------------------------------------------------------------------------------- browser


@contextlib.contextmanager
def chromium_page(chromium: str, viewport: tuple[int, int], scale: float = 1.0):
    """A Playwright page in headless Debian Chromium; yields (page, browser_messages)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        raise SetupError("playwright is not installed: pip install playwright") from e
    if not Path(chromium).exists():
        raise SetupError(f"{chromium} not found: apt-get install -y chromium")
    with sync_playwright() as pw:
        try:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        except Exception as e:
            raise SetupError(f"could not launch {chromium}: {e}") from e
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]},
                                    device_scale_factor=scale)
            messages: list[str] = []
            page.on("console", lambda m: messages.append(f"console.{m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: messages.append(f"pageerror: {e}"))

            def read_only(route, request):     # the page may read files (and checkpoint to the temp dir), not write
                url = request.url.split("?")[0]
                if request.method in ("PUT", "PATCH", "POST", "DELETE") and not (
                        request.method == "POST" and url.endswith("/checkpoints")):
                    messages.append(f"blocked write: {request.method} {request.url.split('?')[0]}")
                    route.abort()
                else:
                    route.continue_()
            page.route("**/api/contents/**", read_only)
            yield page, messages
        finally:
            browser.close()


# ----------------------------------------------------------------------------------- JupyterLab in the page

# JavaScript run in the page. `window.jupyterapp` is there because of --expose-app-in-browser.
JS_PANEL = """(path) => {
  const app = window.jupyterapp;
  if (!app) return null;
  return Array.from(app.shell.widgets('main')).find(w => w.context && w.context.path === path) || null;
}"""

JS_STATE = """(path) => {
  const panel = (%s)(path);
  const dialog = document.querySelector('.jp-Dialog');
  if (!panel) return {panel: false, dialog: dialog ? dialog.innerText : null};
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const cells = [];
  panel.content.widgets.forEach((cell, i) => {
    const m = cell.model;
    if (m.type !== 'code') return;
    const outputs = [];
    for (let j = 0; j < m.outputs.length; j++) {
      const o = m.outputs.get(j).toJSON();
      outputs.push({type: o.output_type, name: o.name || null,
                    text: o.output_type === 'stream' ? String(o.text).slice(0, 400) :
                          o.output_type === 'error' ? (o.ename + ': ' + o.evalue) : null,
                    mimes: Object.keys(o.data || {})});
    }
    cells.push({index: i, count: m.executionCount, outputs: outputs,
                source: m.sharedModel.getSource().split('\\n').find(l => l && !l.startsWith('#')) || ''});
  });
  return {panel: true, ready: panel.sessionContext.isReady, kernel: kernel ? kernel.status : null,
          kernelName: kernel ? kernel.name : null, cells: cells,
          dialog: document.querySelector('.jp-Dialog') ? document.querySelector('.jp-Dialog').innerText : null,
          runAll: window.__browserCheckRunAll || null};
}""" % JS_PANEL


def nb_state(page, nb_path: str) -> dict:
    return page.evaluate(JS_STATE, nb_path)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5, progress=None):
    """Poll `predicate()` until it returns something truthy; raise TimeoutError with `what`."""
    deadline, last_report = time.monotonic() + timeout, time.monotonic()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        if progress and time.monotonic() - last_report > 15:
            progress()
            last_report = time.monotonic()
        time.sleep(interval)


def notebook_scroller(page):
    """The element that scrolls the notebook (JupyterLab 4: the windowed panel's outer node)."""
    return page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer").first


def scroll_notebook(page, top: float | None = None, by: float | None = None) -> dict | None:
    """Scroll the notebook to `top` or `by` pixels; return its geometry and whether the last cell's end shows."""
    return page.evaluate("""([top, by]) => {
      const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
      const el = panel && panel.querySelector('.jp-WindowedPanel-outer');
      if (!el) return null;
      if (top !== null) el.scrollTop = top;
      if (by !== null) el.scrollTop += by;
      const cells = panel.querySelectorAll('.jp-Notebook .jp-Cell');
      const last = cells.length ? cells[cells.length - 1].getBoundingClientRect().bottom : 0;
      return {top: el.scrollTop, height: el.clientHeight, total: el.scrollHeight,
              endVisible: last <= el.getBoundingClientRect().bottom + 1};
    }""", [top, by])


def scroll_to_cell(ctx, index: int, tag: str):
    """Scroll cell `index` of the notebook to the top of the view; return a locator for it."""
    ctx.page.evaluate("""async ([path, index, tag]) => {
      const panel = (%s)(path);
      const cell = panel.content.widgets[index];
      cell.node.setAttribute('data-browser-check', tag);
      panel.content.activeCellIndex = index;
      await panel.content.scrollToItem(index, 'start');
    }""" % JS_PANEL, [ctx.nb_path, index, tag])
    ctx.page.wait_for_timeout(500)
    return ctx.page.locator(f"[data-browser-check={tag}]")


def widget_cells(state: dict) -> list[int]:
    return [c["index"] for c in state["cells"] if any(WIDGET_MIME in o["mimes"] for o in c["outputs"])]


# ----------------------------------------------------------------------------------- flows


@dataclass
class Ctx:
    """What a flow gets: the page, the notebook (path relative to the repo root), the report, options."""

    page: object
    nb_path: str
    out: Path
    report: Report
    timeout: float
    messages: list[str]
    options: argparse.Namespace
    state: dict = field(default_factory=dict)    # shared between flows (e.g. the widget cell's index)

    def shot(self, name: str, locator=None) -> Path:
        path = self.out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (locator or self.page).screenshot(path=str(path))
        return path


def open_notebook(ctx: Ctx, lab: Lab) -> None:
    """Load JupyterLab on the notebook and wait until its kernel is idle."""
    page, report = ctx.page, ctx.report
    page.goto(f"{lab.url}/lab/tree/{ctx.nb_path}?token={lab.token}", wait_until="domcontentloaded")
    try:
        wait_for(lambda: page.evaluate("() => !!window.jupyterapp"), 90, "JupyterLab to load in the page")
        state = wait_for(lambda: (s := nb_state(page, ctx.nb_path))["dialog"] and s or s["panel"]
                         and s["kernel"] == "idle" and s, 120, "the notebook to open with an idle kernel")
    except TimeoutError as e:
        ctx.shot("00_open_failed.png")
        raise SetupError(f"{e}; screenshot in {ctx.out}") from e
    if state["dialog"]:
        ctx.shot("00_dialog.png")
        raise SetupError(f"a dialog is in the way: {state['dialog'][:300]!r}")
    report.check(True, "notebook opens with a kernel", f"{state['kernelName']}, {len(state['cells'])} code cells")
    page.wait_for_timeout(1500)   # let committed outputs (and saved widget state) render
    scroll_notebook(page, top=0)
    ctx.shot("01_opened.png")
    broken = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)").get_by_text("Error displaying widget").count()
    if broken:
        report.warn("as opened (before running)", f"{broken} widget output(s) show 'Error displaying widget'")
    if widget_cells(state):    # the committed widgets, as a student sees them before running anything
        as_text = page.evaluate("""([path, cells]) => {
          const panel = (%s)(path);
          return cells.map(i => panel.content.widgets[i].node)
                      .filter(n => !n.querySelector('.jp-OutputArea .jupyter-widgets'))
                      .map(n => (n.querySelector('.jp-OutputArea') || n).textContent.trim().slice(0, 80));
        }""" % JS_PANEL, [ctx.nb_path, widget_cells(state)])
        # widget outputs committed with a picture beside the widget (chapter 03's slider) must show one
        pictured_cells = [c["index"] for c in state["cells"] if any(
            WIDGET_MIME in o["mimes"] and "image/png" in o["mimes"] for o in c["outputs"])]
        sliders = [c["index"] for c in state["cells"] if "block_table_widget(" in c["source"]]
        shown = page.evaluate("""([path, cells]) => {
          const panel = (%s)(path);
          return cells.filter(i => panel.content.widgets[i].node.querySelector('.jp-OutputArea img, .jp-OutputArea .jupyter-widgets'));
        }""" % JS_PANEL, [ctx.nb_path, pictured_cells])
        if pictured_cells or sliders:
            report.check(set(sliders) <= set(pictured_cells) and shown == pictured_cells,
                         "as opened: committed widgets show a picture",
                         f"cells with a picture beside the widget {pictured_cells} (block_table_widget in {sliders}); "
                         f"shown as an image or a live widget: {shown}")
        elif as_text:
            report.warn("as opened (before running)", f"{len(as_text)} of {len(widget_cells(state))} committed "
                        f"widget output(s) show as text, e.g. {as_text[0]!r} (untrusted notebook: no widget)")
        cell = scroll_to_cell(ctx, widget_cells(state)[0], "widget-as-opened")
        page.wait_for_timeout(1000)
        ctx.shot("01_widget_as_opened.png", cell.locator(".jp-Cell-outputWrapper"))
        scroll_notebook(page, top=0)


def flow_run_all(ctx: Ctx) -> None:
    """Clear all outputs, Run All Cells, wait for the end; check counts, errors, kernel idle; screenshots."""
    page, report = ctx.page, ctx.report
    page.evaluate("""async () => {
      await window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs');
      window.__browserCheckRunAll = {done: false, result: null, error: null};
      window.jupyterapp.commands.execute('notebook:run-all-cells').then(
        r => { window.__browserCheckRunAll = {done: true, result: r, error: null}; },
        e => { window.__browserCheckRunAll = {done: true, result: null, error: String(e)}; });
    }""")
    t0 = time.monotonic()

    def progress():
        s = nb_state(page, ctx.nb_path)
        done = sum(c["count"] is not None for c in s["cells"])
        log(f"{time.monotonic() - t0:.0f}s: {done}/{len(s['cells'])} code cells run, kernel {s['kernel']}")

    try:
        state = wait_for(lambda: (s := nb_state(page, ctx.nb_path))["runAll"]["done"] and s["kernel"] == "idle" and s,
                         ctx.timeout, "Run All Cells to finish", interval=1.0, progress=progress)
    except TimeoutError as e:
        ctx.shot("02_timeout.png")
        report.check(False, "run all cells", str(e))
        return
    elapsed = time.monotonic() - t0
    cells = state["cells"]
    errors = [(c, o) for c in cells for o in c["outputs"] if o["type"] == "error"]
    unrun = [c for c in cells if c["count"] is None]
    report.check(state["runAll"]["error"] is None and state["runAll"]["result"] is not False and not unrun,
                 "run all cells", f"{len(cells) - len(unrun)}/{len(cells)} code cells run in {elapsed:.0f}s"
                 + (f"; first not run: cell {unrun[0]['index']} {unrun[0]['source'][:60]!r}" if unrun else ""))
    report.check(not errors, "no error outputs",
                 "; ".join(f"cell {c['index']}: {o['text']}" for c, o in errors[:3]))
    report.check(state["kernel"] == "idle", "kernel idle at the end", str(state["kernel"]))
    for c in cells:
        for o in c["outputs"]:
            if o["type"] == "stream" and o["name"] == "stderr":
                report.warn(f"stderr in cell {c['index']} ({c['source'][:40]!r})", " ".join(o["text"].split())[:200])
    images = sum("image/png" in o["mimes"] for c in cells for o in c["outputs"])
    widgets = widget_cells(state)
    ctx.state["widget_cells"] = widgets
    rendered = page.evaluate("""() => {
      const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
      const imgs = Array.from(panel.querySelectorAll('.jp-OutputArea-output img'));
      return {images: imgs.length, broken: imgs.filter(i => !(i.complete && i.naturalWidth > 0)).length,
              widgetErrors: (panel.innerText.match(/Error displaying widget|Error rendering output/g) || []).length};
    }""")
    report.check(rendered["broken"] == 0 and rendered["widgetErrors"] == 0, "outputs render",
                 f"{images} PNG figure(s) in the outputs, {rendered['images']} <img> in the page "
                 f"({rendered['broken']} broken), {rendered['widgetErrors']} widget render error(s); "
                 f"widget outputs in cells {widgets or 'none'}")
    # screenshots: the top, then the whole notebook one screen at a time
    page.wait_for_timeout(1000)
    scroll_notebook(page, top=0)
    page.wait_for_timeout(500)
    ctx.shot("02_top.png")
    if ctx.options.pages:
        geometry, n = scroll_notebook(page, top=0), 1
        while geometry and n <= ctx.options.max_pages:
            page.wait_for_timeout(400)
            ctx.shot(f"pages/page_{n:02d}.png")
            if geometry["endVisible"] or geometry["top"] + geometry["height"] >= geometry["total"] - 2:
                break
            geometry, n = scroll_notebook(page, by=geometry["height"] * 0.9), n + 1
        log(f"{n} page screenshot(s) in {ctx.out / 'pages'}")


def flow_widget(ctx: Ctx) -> None:
    """Scroll to the first widget output; check slider and image render; move the slider; image changes."""
    page, report, mode = ctx.page, ctx.report, ctx.options.widget
    sliders = page.evaluate("""([path, cells]) => {
      const panel = (%s)(path);
      return cells.filter(i => panel.content.widgets[i].node.querySelector('.widget-slider'));
    }""" % JS_PANEL, [ctx.nb_path, ctx.state.get("widget_cells", [])])
    if not sliders:
        if mode == "require":
            report.check(False, "slider widget present", "no cell output has an ipywidgets slider")
        else:
            log("no ipywidgets slider in this notebook: widget flow skipped")
        return
    index = sliders[0]
    cell = scroll_to_cell(ctx, index, "widget-cell")
    output = cell.locator(".jp-Cell-outputWrapper")
    slider = cell.locator(".jupyter-widgets.widget-slider").first
    image = cell.locator(".widget-html img, .widget-output img, .jupyter-widgets-output-area img").first
    try:
        slider.wait_for(state="visible", timeout=30_000)
        image.wait_for(state="visible", timeout=30_000)
    except Exception:
        ctx.shot("03_widget_page.png")
        error = ""
        with contextlib.suppress(Exception):       # a widget view that failed: read its JavaScript error
            cell.get_by_text("Click to show javascript error").first.click(timeout=3000)
            page.wait_for_timeout(500)
            error = "; " + " ".join(output.inner_text(timeout=3000).split())[:400]
        report.check(False, "widget renders", f"cell {index}: slider visible {slider.is_visible()}, "
                     f"image visible {image.is_visible()}; see 03_widget_page.png{error}")
        return
    page.wait_for_timeout(500)
    box = image.bounding_box()
    report.check(box is not None and box["width"] > 100 and box["height"] > 50, "widget renders",
                 f"cell {index}: slider and a {box['width']:.0f}x{box['height']:.0f} px image" if box else "no box")
    ctx.shot("03_widget_page.png")
    ctx.shot("04_widget_before.png", output)

    readout = slider.locator(".widget-readout")
    before_value, before_src = readout.inner_text().strip(), image.get_attribute("src")
    presses = ctx.options.slider_steps
    handle = slider.locator(".noUi-handle").first
    handle.focus()
    for _ in range(presses):
        page.keyboard.press("ArrowRight")
    how = f"{presses}x ArrowRight"
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: readout.inner_text().strip() != before_value, 5, "the readout to change")
    if readout.inner_text().strip() == before_value:      # keyboard did nothing: drag the handle
        hb, sb = handle.bounding_box(), slider.locator(".noUi-target, .slider").first.bounding_box()
        page.mouse.move(hb["x"] + hb["width"] / 2, hb["y"] + hb["height"] / 2)
        page.mouse.down()
        page.mouse.move(hb["x"] + sb["width"] / 4, hb["y"] + hb["height"] / 2, steps=10)
        page.mouse.up()
        how = "drag"
    after_value = readout.inner_text().strip()
    report.check(after_value != before_value, "slider moves", f"{how}: step {before_value} -> {after_value}")

    def new_image():
        with contextlib.suppress(Exception):
            src = image.get_attribute("src", timeout=1000)
            return src if src and src != before_src else None
        return None

    try:
        after_src = wait_for(new_image, 60, "the figure to be redrawn")
    except TimeoutError as e:
        after_src = None
        detail = str(e)
    else:
        detail = (f"PNG {hashlib.sha1(before_src.encode()).hexdigest()[:8]} -> "
                  f"{hashlib.sha1(after_src.encode()).hexdigest()[:8]}")
    report.check(after_src is not None, "image changes with the slider", detail)

    # The redraw must catch up with the slider: once the readout has stopped moving, the picture's title
    # (set with its PNG in one message) names the same step.
    def settled_readout():
        first = readout.inner_text().strip()
        page.wait_for_timeout(700)
        return first if readout.inner_text().strip() == first else None

    final_value = wait_for(settled_readout, 30, "the slider readout to settle")

    def title_matches():
        with contextlib.suppress(Exception):
            title = image.get_attribute("title", timeout=1000) or ""
            return title if title.split("  ")[0] == f"step {final_value}" else None
        return None

    try:
        title = wait_for(title_matches, 60, f"the picture's title to read 'step {final_value}'")
    except TimeoutError as e:
        title = image.get_attribute("title")
        report.check(False, "redrawn title matches the slider", f"slider {final_value}, title {title!r}: {e}")
    else:
        report.check(True, "redrawn title matches the slider", f"slider {final_value}, title {title!r}")
    page.wait_for_timeout(500)
    ctx.shot("05_widget_after.png", output)


# ----------------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--notebook", default="chapters/ch03_paged_blocks.ipynb",
                   help="notebook to open, relative to the repo root (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("/tmp/minirt_browser"),
                   help="screenshot folder; a subfolder per notebook (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds allowed for Run All Cells (default: %(default)s)")
    p.add_argument("--widget", choices=["auto", "require", "skip"], default="auto",
                   help="widget flow: if an output has a slider widget (auto), demand one (require), "
                        "or skip it (default: %(default)s)")
    p.add_argument("--slider-steps", type=int, default=5, help="right-arrow presses on the slider (default: 5)")
    p.add_argument("--no-pages", dest="pages", action="store_false",
                   help="no screen-by-screen screenshots of the whole notebook")
    p.add_argument("--max-pages", type=int, default=80, help="at most this many page screenshots (default: 80)")
    p.add_argument("--viewport", default="1366x768", help="browser window WIDTHxHEIGHT (default: %(default)s)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="device pixel ratio, e.g. 2 for a HiDPI laptop screen (default: %(default)s)")
    p.add_argument("--chromium", default="/usr/bin/chromium", help="Chromium binary (default: %(default)s)")
    p.add_argument("--quiz", action="store_true",
                   help="after Run All, click through the chapter's self-check quiz (scripts/quiz_flow.py)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    nb = (REPO / args.notebook).resolve()
    if not nb.is_file() or REPO not in nb.parents:
        print(f"FAIL notebook: {args.notebook} is not a file under {REPO}")
        return 2
    nb_path = nb.relative_to(REPO).as_posix()
    out = args.out / nb.stem
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.png"), *out.glob("pages/*.png")]:
        old.unlink()
    viewport = tuple(int(v) for v in args.viewport.lower().split("x"))
    original = nb.read_bytes()
    report = Report()
    # SIGTERM -> SystemExit, so the `finally`s below shut JupyterLab and the browser down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    flows = [flow_run_all]
    if args.widget != "skip":
        flows.append(flow_widget)
    if args.quiz:
        from quiz_flow import flow_quiz    # scripts/quiz_flow.py: the self-check activities, as a student
        flows.append(flow_quiz)

    print(f"browser check of {nb_path} (screenshots in {out})", flush=True)
    status = 0
    try:
        with tempfile.TemporaryDirectory(prefix="minirt_browser_") as tmp, \
                jupyterlab(Path(tmp)) as lab, chromium_page(args.chromium, viewport, args.scale) as (page, messages):
            ctx = Ctx(page, nb_path, out, report, args.timeout, messages, args)
            open_notebook(ctx, lab)
            for flow in flows:
                try:
                    flow(ctx)
                except Exception as e:     # a flow that crashes is a FAIL, the others still run
                    with contextlib.suppress(Exception):
                        ctx.shot(f"crash_{flow.__name__}.png")
                    report.check(False, flow.__name__, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            for m in dict.fromkeys(messages):
                if "Error" in m or m.startswith(("pageerror", "blocked write")):
                    report.warn("browser console", m[:300])
    except SetupError as e:
        print(f"FAIL setup: {e}", flush=True)
        status = 2
    finally:
        if nb.read_bytes() != original:    # not by us: the page cannot write; left as it is
            report.warn("notebook file", f"{nb_path} changed on disk during the check (another process?); "
                        "the screenshots show the version read at the start")
    if status == 0:
        status = 1 if report.failed else 0
    print(("VERDICT: PASS" if status == 0 else f"VERDICT: FAIL ({', '.join(report.failed) or 'setup'})")
          + f" - {nb_path}; screenshots in {out}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
