"""Self-check activities at the end of every chapter, and live references into the package source.

Each chapter ends with four activities, all driven by one data file per chapter,
`minirt/course/quizzes/chNN.json` (inside the package, so the activities ship with it):

* `quiz(chapter)` - a closed-book quiz answered in place (ipywidgets): multiple choice or a number.
  Every answer shows right/wrong and a one-paragraph explanation that points back to a section of the
  chapter. A static copy of the questions (answers folded in `<details>`) is displayed next to the widget
  for readers of a rendered page; JupyterLab hides it once the widget is live.
* `treasure_hunt(chapter)` - questions that send the student into the reference source; each folded
  answer shows the exact lines of `minirt` it refers to, read from the function object when the
  notebook runs (never pasted).
* `recap(chapter)` - the 30-second explanation a student should be able to give, folded, with a
  pass / good / excellent self-assessment.
* `score(chapter)` - the chapter's self-check score, updated live. Nothing is sent anywhere.

`source_ref("minirt.scheduler.Scheduler.schedule", marker=...)` is the citation helper chapters use:
the file and line range are computed from the code, so a reference never goes stale (and
`tests/test_activities.py` fails when a chapter names a symbol that no longer exists).
`tools/add_activities.py CHAPTER.ipynb` appends (or replaces) the standard activity cells of a chapter.
"""

from __future__ import annotations

import ast
import html
import importlib
import inspect
import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from urllib.parse import quote

QUIZ_DIR = Path(__file__).resolve().parent / "quizzes"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]          # .../minirt
LEVELS = ("pass", "good", "excellent")

#: Hides the static copy of an activity inside a live JupyterLab / Notebook 7 page, where the widget
#: shows the same thing; a rendered page (nbconvert HTML, GitHub) has neither class and shows it.
_STATIC_CSS = ("<style>.jp-LabShell .minirt-static, .jp-NotebookShell .minirt-static "
               "{display: none;}</style>")
#: ipywidgets gives radio labels a fixed one-line height (a long choice overprints the next one) and lets
#: their text wrap under the button; as a flex row the text wraps in its own column beside the button.
#: Links in the feedback look like links (JupyterLab styles them only inside rendered outputs).
_QUIZ_CSS = ("<style>.minirt-quiz .widget-radio-box label {display: flex !important; align-items: flex-start; "
             "gap: 0.45em; height: auto !important; white-space: normal; line-height: 1.35; margin-bottom: 6px;} "
             ".minirt-quiz .widget-radio-box label input[type=radio] {order: -1; flex: none; margin: 0.2em 0 0 0;} "
             ".minirt-quiz a {color: var(--jp-content-link-color, #0b61c4); text-decoration: underline; "
             "cursor: pointer;}</style>")
#: A section link's click in JupyterLab: the notebook that holds the link scrolls to the heading with its own
#: fragment navigation (`Notebook.setFragment`, which finds headings even in cells the windowed notebook has
#: not rendered); elsewhere the element with that id scrolls into view; the href is the fallback.
_SCROLL_JS = ("var a=this,id=decodeURIComponent(a.getAttribute('href').slice(1)),app=window.jupyterapp;"
              "var p=app&&Array.from(app.shell.widgets('main')).find(function(w){return w.node.contains(a);});"
              "if(p&&p.content&&p.content.setFragment){p.content.setFragment('#'+id);return false;}"
              "var e=document.getElementById(id);if(e){e.scrollIntoView();return false;}return true;")


# ===================================================================================== data


def chapter_id(chapter) -> str:
    """"ch05" from 5, "05", "ch05", "ch05_asyncio_engine" or a path to that notebook."""
    if isinstance(chapter, int):
        return f"ch{chapter:02d}"
    m = re.search(r"(?:^|ch)(\d{2})(?:_|$|\.)", Path(str(chapter)).name)
    if not m:
        raise ValueError(f"chapter: cannot read a chapter number from {chapter!r} (expected e.g. 'ch05')")
    return f"ch{m.group(1)}"


def quiz_path(chapter) -> Path:
    return QUIZ_DIR / f"{chapter_id(chapter)}.json"


@lru_cache(maxsize=None)
def _load(path: str, mtime: float) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load(chapter) -> dict:
    """The activity data of one chapter (see `validate` for the format). Raises FileNotFoundError."""
    path = quiz_path(chapter)
    if not path.exists():
        raise FileNotFoundError(f"no activity data for {chapter_id(chapter)}: {path} is missing")
    return _load(str(path), path.stat().st_mtime)


def validate(data: dict) -> list[str]:
    """Problems with one chapter's activity data (empty list = well formed).

    Format: `{"chapter", "title", "quiz": [...], "hunt": [...], "recap": {...}}`.
    A quiz question has `id`, `section` (a heading of the chapter), `question`, `explanation`, and either
    `"kind": "choice"` with `choices: [{"text", "correct"}]` (exactly one correct) or `"kind": "number"`
    with `answer` (a number), optional `tolerance` (absolute, default 0), `unit` and `hint` (shown after a
    first wrong answer, with whether it was too high or too low; the answer comes only after a second).
    A hunt item has `question`, `symbol` (a dotted name in minirt), optional `marker` (text of the first
    line to show, inside that symbol's source) and `end_marker`, `answer`, optional `hint`.
    The recap has `prompt`, `answer`, and `levels` with non-empty `pass`, `good` and `excellent` lists.
    """
    problems = []
    for key in ("chapter", "title", "quiz", "hunt", "recap"):
        if key not in data:
            problems.append(f"missing key {key!r}")
    quiz_items = data.get("quiz", [])
    if not 3 <= len(quiz_items) <= 8:
        problems.append(f"quiz: {len(quiz_items)} questions (expected about five)")
    ids = [q.get("id") for q in quiz_items]
    if len(set(ids)) != len(ids):
        problems.append(f"quiz: duplicate ids {ids}")
    for i, q in enumerate(quiz_items):
        where = f"quiz[{i}] ({q.get('id')})"
        for key in ("id", "section", "question", "explanation"):
            if not isinstance(q.get(key), str) or not q.get(key).strip():
                problems.append(f"{where}: missing or empty {key!r}")
        if len(q.get("explanation", "")) < 60:
            problems.append(f"{where}: explanation too short to explain anything")
        kind = q.get("kind")
        if kind == "choice":
            choices = q.get("choices", [])
            if len(choices) < 2:
                problems.append(f"{where}: fewer than two choices")
            correct = [c for c in choices if c.get("correct") is True]
            if len(correct) != 1:
                problems.append(f"{where}: {len(correct)} correct choices (exactly one required)")
            texts = [c.get("text") for c in choices]
            if any(not isinstance(t, str) or not t.strip() for t in texts) or len(set(texts)) != len(texts):
                problems.append(f"{where}: choice texts must be non-empty and distinct")
            if any(set(c) - {"text", "correct"} for c in choices):
                problems.append(f"{where}: a choice has keys other than text/correct")
        elif kind == "number":
            if isinstance(q.get("answer"), bool) or not isinstance(q.get("answer"), (int, float)):
                problems.append(f"{where}: a number question needs one numeric 'answer'")
            tol = q.get("tolerance", 0)
            if isinstance(tol, bool) or not isinstance(tol, (int, float)) or tol < 0:
                problems.append(f"{where}: tolerance must be a number >= 0")
            if "choices" in q:
                problems.append(f"{where}: a number question has no choices")
            if "hint" in q and (not isinstance(q["hint"], str) or not q["hint"].strip()):
                problems.append(f"{where}: hint must be a non-empty string")
        else:
            problems.append(f"{where}: kind must be 'choice' or 'number', got {kind!r}")
        if kind == "choice" and "hint" in q:
            problems.append(f"{where}: only a number question has a hint (a choice question shows its answer)")
    hunt = data.get("hunt", [])
    if not 3 <= len(hunt) <= 4:
        problems.append(f"hunt: {len(hunt)} questions (expected three or four)")
    for i, h in enumerate(hunt):
        for key in ("question", "symbol", "answer"):
            if not isinstance(h.get(key), str) or not h.get(key).strip():
                problems.append(f"hunt[{i}]: missing or empty {key!r}")
    recap = data.get("recap", {})
    for key in ("prompt", "answer"):
        if not isinstance(recap.get(key), str) or not recap.get(key).strip():
            problems.append(f"recap: missing or empty {key!r}")
    levels = recap.get("levels", {})
    if set(levels) != set(LEVELS) or any(not levels[k] or not all(isinstance(s, str) for s in levels[k])
                                         for k in LEVELS if k in levels):
        problems.append(f"recap: levels must be non-empty lists for exactly {LEVELS}, got {sorted(levels)}")
    return problems


# ===================================================================================== source refs


def resolve(name: str):
    """The object a dotted name in the package refers to: `minirt.scheduler.Scheduler.schedule`.

    Imports the longest importable module prefix, then follows attributes. A trailing name that is
    not a class attribute but a dataclass field or an attribute assigned in the class's source
    (`self.waiting_queue = ...`) resolves to the class. Raises LookupError naming the missing part.
    """
    if not name.startswith("minirt"):
        raise LookupError(f"{name!r}: not a name in the minirt package")
    parts = name.split(".")
    obj, i = None, len(parts)
    while i > 0:
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ModuleNotFoundError as e:
            if e.name is None or not ".".join(parts[:i]).startswith(e.name):
                raise
            i -= 1
    if obj is None:
        raise LookupError(f"{name!r}: no module {parts[0]!r}")
    for j in range(i, len(parts)):
        attr = parts[j]
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
            continue
        if j == len(parts) - 1 and inspect.isclass(obj) and _instance_attribute(obj, attr):
            return obj
        raise LookupError(f"{name!r}: {'.'.join(parts[:j])} has no attribute {attr!r}")
    return obj


def _instance_attribute(cls, attr: str) -> bool:
    fields = getattr(cls, "__dataclass_fields__", {})
    if attr in fields:
        return True
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return re.search(rf"\bself\.{re.escape(attr)}\s*(:[^=\n]+)?=(?!=)", source) is not None


@dataclass(frozen=True, repr=False)
class SourceRef:
    """A live reference into the package: `name` lives in `path`, lines `start`..`end` (1-based, inclusive).

    `path` is relative to the directory holding the package (`minirt/scheduler.py`); `file` is absolute.
    Displays as a link with its line range; `str()` gives "minirt/scheduler.py lines 131-157".
    """

    name: str
    file: str
    start: int
    end: int
    marker: str | None = None

    @property
    def path(self) -> str:
        return Path(self.file).relative_to(PACKAGE_ROOT.parent).as_posix()

    @property
    def qualname(self) -> str:
        return self.name.removeprefix("minirt.")

    @property
    def lines(self) -> list[str]:
        with open(self.file, encoding="utf-8") as f:
            return f.read().splitlines()[self.start - 1:self.end]

    @property
    def source(self) -> str:
        return "\n".join(self.lines) + "\n"

    @property
    def href(self) -> str:
        """Link to the file relative to the working directory (the notebook's folder under Jupyter)."""
        return quote(os.path.relpath(self.file, os.getcwd()).replace(os.sep, "/"))

    @property
    def span(self) -> str:
        return f"line {self.start}" if self.start == self.end else f"lines {self.start}\u2013{self.end}"

    def __str__(self) -> str:
        return f"{self.path} {self.span}"

    def __repr__(self) -> str:          # no absolute path: notebook outputs must not depend on the checkout
        return f"<SourceRef {self.qualname}: {self}>"

    def _repr_markdown_(self) -> str:
        return f"[`{self.path}` {self.span}]({self.href}) (`{self.qualname}`)"

    def _repr_html_(self) -> str:
        return (f'<a href="{self.href}"><code>{html.escape(self.path)}</code> {self.span}</a> '
                f"(<code>{html.escape(self.qualname)}</code>)")

    def listing_html(self) -> str:
        """The lines as a `<pre>` block with their line numbers."""
        width = len(str(self.end))
        body = "\n".join(f'<span style="color:#999">{n:>{width}}</span>  {html.escape(line)}'
                         for n, line in enumerate(self.lines, self.start))
        return f'<pre style="font-size:85%;line-height:1.35;overflow-x:auto">{body}</pre>'

    def block_html(self) -> str:
        """The link, then the listing: what `show_source` and `reveal_source` display."""
        return f"<div>{self._repr_html_()}</div>{self.listing_html()}"


def source_ref(name: str, marker: str | None = None, end_marker: str | None = None) -> SourceRef:
    """Where `name` (a dotted name in minirt) is defined, computed now from the code.

    marker: text of a line inside that definition; the reference is then that line and the block it
    opens (the following lines indented deeper), or up to the line holding `end_marker`.
    Raises LookupError if the name does not resolve or the marker is not in its source.
    """
    obj = resolve(name)
    target = inspect.unwrap(obj.fget if isinstance(obj, property) else obj)
    try:
        lines, start = inspect.getsourcelines(target)
        file = inspect.getsourcefile(target)
    except (TypeError, OSError) as e:
        raise LookupError(f"{name!r}: no source to point at ({e})") from None
    start = max(start, 1)                       # a module's source starts at line 0
    end = start + len(lines) - 1
    if marker is None:
        return SourceRef(name, str(Path(file).resolve()), start, end)
    hit = next((k for k, line in enumerate(lines) if marker in line), None)
    if hit is None:
        raise LookupError(f"{name!r}: marker {marker!r} is not in its source")
    if end_marker is not None:
        stop = next((k for k in range(hit, len(lines)) if end_marker in lines[k]), None)
        if stop is None:
            raise LookupError(f"{name!r}: end_marker {end_marker!r} is not after {marker!r}")
    else:
        indent = len(lines[hit]) - len(lines[hit].lstrip())
        stop = hit
        for k in range(hit + 1, len(lines)):
            text = lines[k]
            if text.strip() and len(text) - len(text.lstrip()) <= indent:
                # a closing bracket of the marker line still belongs to it
                if text.strip()[0] in ")]}":
                    stop = k
                break
            if text.strip():
                stop = k
    return SourceRef(name, str(Path(file).resolve()), start + hit, start + stop, marker)


def definition_source(path, *names: str) -> str:
    """The exact source lines of the named top-level definitions of a .py file, read as text (never imported).

    path: a file, or a path relative to the directory holding the package ("minirt/kernels/gemv_triton.py").
    names: top-level functions and classes (with their decorators, as `inspect.getsource` gives them) or
    names assigned at the top level (`RULES: tuple[Rule, ...] = (...)`); the result is their lines in the
    order asked, separated by one blank line. Cutting at definitions keeps an excerpt unchanged when anything
    else in the file changes, and a kernel file needs no Triton to be read. Raises LookupError naming the
    file and the missing name, or ValueError when no name is given.
    """
    if not names:
        raise ValueError("names: give at least one top-level name")
    file = Path(path)
    if not file.is_absolute() and not file.exists():
        file = PACKAGE_ROOT.parent / file
    text = file.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    spans = {}
    for node in ast.parse(text, filename=str(file)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found = [node.name]
        elif isinstance(node, ast.Assign):
            found = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found = [node.target.id]
        else:
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        for name in found:
            spans[name] = (start, node.end_lineno)
    parts = []
    for name in names:
        if name not in spans:
            raise LookupError(f"{file.name}: no top-level definition named {name!r}")
        start, end = spans[name]
        parts.append("".join(lines[start - 1:end]))
    return "\n".join(part if part.endswith("\n") else part + "\n" for part in parts)


def show_source(name: str, marker: str | None = None, end_marker: str | None = None):
    """Display the referenced lines with their file, line numbers and link (an HTML output)."""
    from IPython.display import HTML

    return HTML(source_ref(name, marker, end_marker).block_html())


def reveal_source(name: str, exercise: str, marker: str | None = None, end_marker: str | None = None):
    """Like `show_source`, folded: minirt's version of what exercise `exercise` asks for ("ex03").

    A chapter shows the source of a function an exercise asks for only this way, and only after the
    cell that introduces the exercise (`tests/test_exercise_first.py` holds every chapter to it). The
    listing sits in a closed `<details>` whose summary says to open it after passing; the
    `data-minirt-reveal` attribute names the exercise, for the test.
    """
    from IPython.display import HTML

    if not re.fullmatch(r"ex\d\d", exercise):
        raise ValueError(f"exercise: expected a name like 'ex03', got {exercise!r}")
    ref = source_ref(name, marker, end_marker)
    summary = (f"minirt's <code>{html.escape(ref.qualname)}</code>: the answer to exercise "
               f"{exercise[2:]}, open it after you pass")
    return HTML(f'<details data-minirt-reveal="{exercise}"><summary>{summary}</summary>{ref.block_html()}</details>')


# ===================================================================================== text helpers


def html_text(markup: str) -> str:
    """HTML as the text it shows: tags dropped, entities unescaped."""
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


def inline_html(text: str) -> str:
    """Escape, then the inline markdown the data files use: `code`, **bold**, *italic*."""
    parts = re.split(r"(`[^`]+`)", html.escape(text, quote=False))
    out = []
    for k, part in enumerate(parts):
        if k % 2:                                    # a code span: no emphasis inside
            out.append(f"<code>{part[1:-1]}</code>")
            continue
        part = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", part)
        out.append(re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])", r"<i>\1</i>", part))
    return "".join(out)


def heading_anchor(section: str) -> str:
    """The id JupyterLab and nbconvert give a markdown heading: spaces -> '-', URL-quoted."""
    text = re.sub(r"[`*]", "", section).strip()
    return "#" + quote(text.replace(" ", "-"))


def section_link(section: str, live: bool = False) -> str:
    """A link to a heading of the chapter. `live`: for a widget in JupyterLab, where a plain `#anchor` only
    changes the URL; the link then scrolls the notebook itself (`_SCROLL_JS`). Static copies keep the plain
    href, which rendered pages (nbconvert HTML, GitHub) follow."""
    click = f' onclick="{html.escape(_SCROLL_JS)}"' if live else ""
    return f'<a href="{heading_anchor(section)}"{click}>{inline_html(section)}</a>'


def _plain(text: str) -> str:
    return re.sub(r"[`*]", "", text)


def _correct_text(q: dict) -> str:
    if q["kind"] == "choice":
        return next(c["text"] for c in q["choices"] if c["correct"])
    unit = f" {q['unit']}" if q.get("unit") else ""
    return f"{q['answer']:g}{unit}"


def _widget_bundle(widget, text: str) -> dict:
    """A display bundle for `widget` whose text/plain is stable (nbval compares it; it skips the view)."""
    return {"application/vnd.jupyter.widget-view+json": {"version_major": 2, "version_minor": 0,
                                                         "model_id": widget.model_id},
            "text/plain": text}


# ===================================================================================== quiz


#: The latest quiz, recap rating and score widget of each chapter in this kernel (for the score).
_QUIZZES: dict[str, "Quiz"] = {}
_RATINGS: dict[str, "RecapRating"] = {}
_SCOREBOARDS: dict[str, list] = {}


def parse_number(text: str) -> float | None:
    """The first number in a typed answer: '3', '3.0 KiB', '1,536', '1.5e3' -> float; None if none."""
    m = re.search(r"[-+]?(?:\d[\d,_]*)?\.?\d+(?:[eE][-+]?\d+)?", text or "")
    if not m:
        return None
    try:
        return float(m.group(0).replace(",", "").replace("_", ""))
    except ValueError:
        return None


class Quiz:
    """The closed-book quiz of one chapter as widgets.

    `answer(i, value)` answers question i as a student would (a choice's text, or a number / typed string);
    `feedback(i)` is the text shown under it; `score()` is (right at the first try, answered, total).
    """

    def __init__(self, chapter):
        import ipywidgets as widgets

        self.chapter = chapter_id(chapter)
        self.data = load(self.chapter)
        self.questions = self.data["quiz"]
        self.first_try: dict[int, bool] = {}       # question index -> right at the first answer
        self.current: dict[int, bool] = {}         # question index -> the current answer is right
        self.wrong_tries: dict[int, int] = {}      # question index -> different wrong numbers tried so far
        self._last_wrong: dict[int, str] = {}
        self.inputs, self.feedbacks, rows = [], [], []
        for i, q in enumerate(self.questions):
            head = widgets.HTML(f"<b>{i + 1}.</b> {inline_html(q['question'])}")
            if q["kind"] == "choice":
                # labels are plain text (no markup in radio labels); values are the choice texts
                box = widgets.RadioButtons(options=[(_plain(c["text"]), c["text"]) for c in q["choices"]], value=None,
                                           layout=widgets.Layout(width="auto"))
                row_input = box
            else:
                box = widgets.Text(placeholder="a number" + (f" ({q['unit']})" if q.get("unit") else ""),
                                   continuous_update=False, layout=widgets.Layout(width="14em"))
                check = widgets.Button(description="check", layout=widgets.Layout(width="6em"))
                check.on_click(lambda _b, i=i: self._check(i))
                row_input = widgets.HBox([box, check])
            box.observe(lambda change, i=i: self._check(i), names="value")
            fb = widgets.HTML("")
            self.inputs.append(box)
            self.feedbacks.append(fb)
            rows.append(widgets.VBox([head, row_input, fb], layout=widgets.Layout(margin="0 0 10px 0")))
        self.score_label = widgets.HTML(self._score_html())
        title = widgets.HTML(_QUIZ_CSS + f"<h4 style='margin:0 0 6px 0'>Quiz \u2014 {html.escape(self.data['title'])}</h4>"
                             "<i>Closed book: answer first, then read the explanation. "
                             "The score counts first answers; nothing is sent anywhere.</i>")
        self.widget = widgets.VBox([title, *rows, self.score_label],
                                   layout=widgets.Layout(border="1px solid #ccc", padding="8px"))
        self.widget.add_class("minirt-quiz")
        _QUIZZES[self.chapter] = self

    # ------------------------------------------------------------------ answering
    def is_right(self, i: int, value) -> bool | None:
        q = self.questions[i]
        if value is None or value == "":
            return None
        if q["kind"] == "choice":
            return any(c["text"] == value and c["correct"] for c in q["choices"])
        x = value if isinstance(value, (int, float)) and not isinstance(value, bool) else parse_number(str(value))
        if x is None:
            return None
        return abs(x - q["answer"]) <= q.get("tolerance", 0) + 1e-9 * abs(q["answer"])

    def _check(self, i: int) -> None:
        q = self.questions[i]
        right = self.is_right(i, self.inputs[i].value)
        if right is None:
            self.feedbacks[i].value = ("<span style='color:#b26b00'>Type a number.</span>"
                                       if q["kind"] == "number" and self.inputs[i].value else "")
            self.current.pop(i, None)
        else:
            self.first_try.setdefault(i, right)
            self.current[i] = right
            if not right and q["kind"] == "number" and self._last_wrong.get(i) != self.inputs[i].value:
                self._last_wrong[i] = self.inputs[i].value      # the same answer checked again is no new try
                self.wrong_tries[i] = self.wrong_tries.get(i, 0) + 1
            box = ("<div style='margin:4px 0 0 1.4em;padding:4px 8px;border-left:3px solid {color}'>{body}</div>")
            if not right and q["kind"] == "number" and self.wrong_tries[i] == 1:
                # a first wrong number: a hint and a second try, not the answer yet
                x = parse_number(str(self.inputs[i].value))
                direction = "too high" if x is not None and x > q["answer"] else "too low"
                hint = f" Hint: {inline_html(q['hint'])}" if q.get("hint") else ""
                self.feedbacks[i].value = box.format(color="#b26b00", body=(
                    f"<b style='color:#b26b00'>\u2718 Not yet: {direction}.</b>{hint} Try once more "
                    "(the answer and its explanation come after a second try)."))
            else:
                verdict = ("<b style='color:#1a7f37'>\u2714 Right.</b>" if right else
                           "<b style='color:#c62828'>\u2718 Not quite.</b>"
                           + (f" The answer is <b>{inline_html(_correct_text(q))}</b>." if q["kind"] == "number"
                              else ""))
                self.feedbacks[i].value = box.format(color="#1a7f37" if right else "#c62828", body=(
                    f"{verdict} {inline_html(q['explanation'])} <i>See the section {section_link(q['section'], live=True)}.</i>"))
        self.score_label.value = self._score_html()
        _refresh_scores(self.chapter)

    def answer(self, i: int, value) -> str:
        """Answer question i (as if clicked or typed); returns the feedback text."""
        box = self.inputs[i]
        box.value = value if self.questions[i]["kind"] == "choice" else str(value)
        if self.questions[i]["kind"] == "number":
            self._check(i)                 # the "check" button (setting the same value fires no event)
        return self.feedback(i)

    def feedback(self, i: int) -> str:
        """The feedback under question i as plain text."""
        return html_text(self.feedbacks[i].value).strip()

    def score(self) -> tuple[int, int, int]:
        return sum(self.first_try.values()), len(self.first_try), len(self.questions)

    def _score_html(self) -> str:
        right, answered, total = self.score()
        return f"<b>Score: {right} / {total}</b> right at the first try ({answered} of {total} answered)."

    # ------------------------------------------------------------------ display
    def _repr_mimebundle_(self, include=None, exclude=None):
        return _widget_bundle(self.widget, f"[interactive quiz, {self.chapter}: {len(self.questions)} questions "
                                           "- run the notebook in JupyterLab to answer]")


def quiz_static_html(chapter) -> str:
    """The questions as HTML for a rendered page: choices listed, each answer folded in `<details>`."""
    data = load(chapter)
    items = []
    for q in data["quiz"]:
        if q["kind"] == "choice":
            body = "<ol type='a'>" + "".join(f"<li>{inline_html(c['text'])}</li>" for c in q["choices"]) + "</ol>"
            answer = inline_html(_correct_text(q))
        else:
            body = f"<p><i>Answer with a number{' in ' + html.escape(q['unit']) if q.get('unit') else ''}.</i></p>"
            if q.get("hint"):
                body += f"<details><summary>Hint</summary><p>{inline_html(q['hint'])}</p></details>"
            answer = inline_html(_correct_text(q))
        items.append(f"<li><p>{inline_html(q['question'])}</p>{body}<details><summary>Answer</summary>"
                     f"<p><b>{answer}.</b> {inline_html(q['explanation'])} <i>See the section "
                     f"{section_link(q['section'])}.</i></p></details></li>")
    return (f"{_STATIC_CSS}<div class='minirt-static'><p><b>Quiz \u2014 {html.escape(data['title'])}</b> "
            "(static copy; in JupyterLab, run the notebook and answer in the widget above).</p>"
            f"<ol>{''.join(items)}</ol></div>")


def quiz_static_text(chapter) -> str:
    data = load(chapter)
    lines = [f"Quiz - {data['title']} (answers: open this notebook in JupyterLab)"]
    for n, q in enumerate(data["quiz"], 1):
        lines.append(f"{n}. {_plain(q['question'])}")
        if q["kind"] == "choice":
            lines += [f"   - {_plain(c['text'])}" for c in q["choices"]]
    return "\n".join(lines)


def quiz(chapter) -> None:
    """Display the chapter's quiz widget and, under it, its static copy (the `Quiz` is `current_quiz`)."""
    from IPython.display import display

    q = Quiz(chapter)
    display(q)
    display({"text/html": quiz_static_html(chapter), "text/plain": quiz_static_text(chapter)}, raw=True)


def current_quiz(chapter) -> Quiz | None:
    """The quiz of `chapter` displayed last in this kernel (None if none yet)."""
    return _QUIZZES.get(chapter_id(chapter))


# ===================================================================================== treasure hunt


def hunt_html(chapter) -> str:
    """The treasure hunt: each question, an optional folded hint, and a folded answer with the live lines."""
    data = load(chapter)
    items = []
    for h in data["hunt"]:
        ref = source_ref(h["symbol"], h.get("marker"), h.get("end_marker"))
        hint = (f"<details><summary>Hint</summary><p>{inline_html(h['hint'])}</p></details>"
                if h.get("hint") else "")
        items.append(f"<li><p>{inline_html(h['question'])}</p>{hint}<details><summary>Answer</summary>"
                     f"<p>{inline_html(h['answer'])}</p><p>{ref._repr_html_()}:</p>{ref.listing_html()}"
                     "</details></li>")
    return ("<div><p><b>Code treasure hunt \u2014 " + html.escape(data["title"]) + "</b>: find the answer in the "
            "source of <code>minirt</code> (open the files in JupyterLab's file browser, or use <code>??</code> on "
            "a function) before you open the answer. Line numbers are read from the code as this cell runs.</p>"
            f"<ol>{''.join(items)}</ol></div>")


def hunt_text(chapter) -> str:
    data = load(chapter)
    return "\n".join([f"Code treasure hunt - {data['title']}"]
                     + [f"{n}. {_plain(h['question'])}" for n, h in enumerate(data["hunt"], 1)])


def treasure_hunt(chapter) -> None:
    """Display the chapter's code treasure hunt (an HTML output; answers folded)."""
    from IPython.display import display

    display({"text/html": hunt_html(chapter), "text/plain": hunt_text(chapter)}, raw=True)


# ===================================================================================== recap card


def recap_html(chapter) -> str:
    data = load(chapter)
    r = data["recap"]
    rows = "".join(f"<tr><td style='text-align:left;vertical-align:top'><b>{lvl}</b></td>"
                   f"<td style='text-align:left'><ul style='margin:0'>"
                   + "".join(f"<li>{inline_html(s)}</li>" for s in r["levels"][lvl]) + "</ul></td></tr>"
                   for lvl in LEVELS)
    return (f"<div style='border:1px solid #ccc;padding:8px'><p><b>Recap card \u2014 {html.escape(data['title'])}"
            f"</b></p><p>{inline_html(r['prompt'])}</p><p><i>Say it out loud (or write it down) first, then open "
            "the card.</i></p><details><summary>A 30-second answer</summary>"
            f"<p>{inline_html(r['answer'])}</p></details>"
            "<details><summary>Self-assessment: what your explanation should contain</summary>"
            "<table><tr><th style='text-align:left'>level</th><th style='text-align:left'>"
            "your explanation covers</th></tr>" + rows + "</table><p>Each level includes the ones above it.</p>"
            "</details></div>")


class RecapRating:
    """The student's own rating of their recap: not yet / pass / good / excellent."""

    OPTIONS = ("not yet",) + LEVELS

    def __init__(self, chapter):
        import ipywidgets as widgets

        self.chapter = chapter_id(chapter)
        self.buttons = widgets.ToggleButtons(options=self.OPTIONS, value="not yet",
                                             description="my recap:", style={"button_width": "auto"})
        self.buttons.observe(lambda change: _refresh_scores(self.chapter), names="value")
        _RATINGS[self.chapter] = self

    @property
    def level(self) -> str:
        return self.buttons.value

    def _repr_mimebundle_(self, include=None, exclude=None):
        return _widget_bundle(self.buttons, "[self-assessment buttons: not yet / pass / good / excellent]")


def recap(chapter) -> None:
    """Display the recap card (folded) and the self-assessment buttons."""
    from IPython.display import display

    data = load(chapter)
    r = data["recap"]
    text = (f"Recap card - {data['title']}\n{_plain(r['prompt'])}\n"
            "(the answer and the pass/good/excellent criteria are folded in the rendered card)")
    display({"text/html": recap_html(chapter), "text/plain": text}, raw=True)
    display(RecapRating(chapter))


# ===================================================================================== score


def score_text(chapter) -> str:
    """The chapter's self-check score as one line, from the quiz and recap widgets of this kernel."""
    cid = chapter_id(chapter)
    q, rating = _QUIZZES.get(cid), _RATINGS.get(cid)
    if q is None:
        quiz_part = "quiz not shown yet"
    else:
        right, answered, total = q.score()
        quiz_part = f"quiz {right}/{total} right at the first try ({answered}/{total} answered)"
    recap_part = f"recap: {rating.level}" if rating is not None else "recap: not rated"
    return f"Self-check, {cid}: {quiz_part}; {recap_part}. Nothing leaves this notebook."


class Scoreboard:
    def __init__(self, chapter):
        import ipywidgets as widgets

        self.chapter = chapter_id(chapter)
        self.label = widgets.HTML()
        self.refresh()
        _SCOREBOARDS.setdefault(self.chapter, []).append(self)

    def refresh(self) -> None:
        self.label.value = f"<div style='font-size:110%;padding:4px'><b>{html.escape(score_text(self.chapter))}</b></div>"

    def _repr_mimebundle_(self, include=None, exclude=None):
        return _widget_bundle(self.label, f"[self-check score of {self.chapter}: updated live in JupyterLab]")


def _refresh_scores(chapter: str) -> None:
    for board in _SCOREBOARDS.get(chapter, []):
        board.refresh()


def score(chapter) -> None:
    """Display the chapter's live score (quiz first answers, recap self-assessment)."""
    from IPython.display import display

    display(Scoreboard(chapter))
