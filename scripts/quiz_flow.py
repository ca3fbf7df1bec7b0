"""The ``--quiz`` flow of ``scripts/browser_check.py``: a chapter's self-check activities, clicked as a student would.

After ``flow_run_all`` (Run All Cells in JupyterLab), for the chapter's activity cells
(``minirt.course.activities``, added by ``tools/add_activities.py``):

  1. the quiz widget renders (radio buttons / number boxes) and its static copy is hidden in JupyterLab;
  2. every radio label's text, wrapped or not, starts right of its button (no line under or left of it);
     clicking a wrong answer of the first multiple-choice question shows "Not quite" and its explanation,
     whose "See the section ..." link looks like a link (underlined, a link colour) and, clicked, scrolls
     the notebook to that heading (it was out of view before; ``07a_section_link_clicked.png``); the right
     answer of the next one shows "Right."; a too-high number in the first number question gets
     "Not yet: too high" and a second try (no answer shown), the right number then "Right."; the quiz's
     score line and the chapter's score cell both say 1 right at the first try of 3 answered;
  3. opening the first treasure-hunt answer shows the live source lines with their line numbers;
  4. the same notebook converted with nbconvert to HTML (no kernel, no widgets) shows the questions as
     text with every answer folded.

Screenshots: ``06_quiz_before.png``, ``07a_section_link_clicked.png``, ``07_quiz_after.png`` (the quiz output),
``08_score.png``,
``09_hunt_open.png``, ``10_static_html_quiz.png``. Kept in its own module so that the browser
checker stays one screen of flows; ``browser_check.py --quiz`` appends ``flow_quiz``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _bc():
    """browser_check's helpers (whether it runs as __main__ or was imported)."""
    main = sys.modules.get("__main__")
    if main is not None and hasattr(main, "scroll_to_cell") and hasattr(main, "JS_PANEL"):
        return main
    import browser_check
    return browser_check


def find_cell(ctx, needle: str) -> int | None:
    bc = _bc()
    return ctx.page.evaluate("""([path, needle]) => {
      const panel = (%s)(path);
      const i = panel.content.widgets.findIndex(c => c.model.type === 'code'
                                                && c.model.sharedModel.getSource().includes(needle));
      return i < 0 ? null : i;
    }""" % bc.JS_PANEL, [ctx.nb_path, needle])


def tall_shot(ctx, index: int, name: str, height: int = 2200) -> None:
    """Screenshot cell `index`'s outputs whole: the notebook scrolls inside the page, so grow the window."""
    bc = _bc()
    size = ctx.page.viewport_size
    ctx.page.set_viewport_size({"width": size["width"], "height": height})
    try:
        cell = bc.scroll_to_cell(ctx, index, f"tall-{index}")
        ctx.page.wait_for_timeout(500)
        ctx.shot(name, cell.locator(".jp-Cell-outputWrapper"))
    finally:
        ctx.page.set_viewport_size(size)


JS_RADIO_LAYOUT = """(index) => {
  // every line of every radio label's text starts right of its button (none wraps under or left of it)
  const cells = document.querySelectorAll('.jp-Notebook .jp-Cell');
  const root = Array.from(cells).find(c => c.querySelector('.minirt-quiz')) || document;
  const out = {labels: 0, wrapped: 0, under: []};
  root.querySelectorAll('.minirt-quiz .widget-radio-box label').forEach(label => {
    const input = label.querySelector('input[type=radio]');
    const text = Array.from(label.childNodes).find(n => n.nodeType === 3 && n.textContent.trim());
    if (!input || !text) return;
    out.labels += 1;
    const range = document.createRange();
    range.selectNodeContents(text);
    const rects = Array.from(range.getClientRects()).filter(r => r.width > 0);
    const tops = new Set(rects.map(r => Math.round(r.top)));
    if (tops.size > 1) out.wrapped += 1;
    const right = input.getBoundingClientRect().right;
    if (rects.some(r => r.left < right - 0.5)) out.under.push(text.textContent.slice(0, 40));
  });
  return out;
}"""

JS_LINK_STYLE = """(a) => {
  const s = getComputedStyle(a), p = getComputedStyle(a.parentElement);
  return {color: s.color, parent: p.color, underline: s.textDecorationLine.includes('underline'),
          cursor: s.cursor};
}"""

JS_HEADING_VISIBLE = """(id) => {
  const h = Array.from(document.querySelectorAll('.jp-Notebook [id], .jp-Notebook [data-jupyter-id]'))
    .find(e => (e.id || e.getAttribute('data-jupyter-id')) === id);
  if (!h) return null;
  const r = h.getBoundingClientRect(), s = document.querySelector('.jp-WindowedPanel-outer')
    || document.querySelector('.jp-Notebook');
  const v = s.getBoundingClientRect();
  return {top: r.top, bottom: r.bottom, viewTop: v.top, viewBottom: v.bottom,
          visible: r.bottom > v.top && r.top < v.bottom, text: h.textContent.slice(0, 60)};
}"""


def section_link_flow(ctx, box, section: str) -> None:
    """The feedback's "See the section ..." link looks like a link and, clicked, scrolls JupyterLab to the heading."""
    from minirt.course import activities

    bc = _bc()
    page, report = ctx.page, ctx.report
    link = box.locator(".widget-html a").last
    style = page.evaluate(JS_LINK_STYLE, link.element_handle())
    report.check(style["underline"] and style["color"] != style["parent"] and style["cursor"] == "pointer",
                 "section link looks like a link", str(style))
    heading_id = activities.heading_anchor(section)[1:]
    from urllib.parse import unquote
    heading_id = unquote(heading_id)
    before = page.evaluate(JS_HEADING_VISIBLE, heading_id)
    url_before = page.url
    link.click()
    try:
        bc.wait_for(lambda: (page.evaluate(JS_HEADING_VISIBLE, heading_id) or {}).get("visible"), 10,
                    f"heading {section!r} to scroll into view")
        after = page.evaluate(JS_HEADING_VISIBLE, heading_id)
    except TimeoutError:
        after = page.evaluate(JS_HEADING_VISIBLE, heading_id)
    page.wait_for_timeout(500)
    ctx.shot("07a_section_link_clicked.png")
    report.check(bool(after and after["visible"]), "section link scrolls to the heading",
                 f"{section!r}: before the click {'visible' if before and before['visible'] else 'not in view'}, "
                 f"after: {after}; " + ("the page's URL unchanged (the link's own scroll ran)" if page.url == url_before
                                        else f"the URL changed to ...{page.url[-40:]} (the href was followed)"))


def flow_quiz(ctx) -> None:
    from minirt.course import activities

    bc = _bc()
    page, report = ctx.page, ctx.report
    chapter = activities.chapter_id(ctx.nb_path)
    questions = activities.load(chapter)["quiz"]
    index = find_cell(ctx, "activities.quiz(")
    if not report.check(index is not None, "quiz cell present",
                        f"{chapter}: no cell calls activities.quiz (run tools/add_activities.py)" if index is None
                        else f"cell {index}"):
        return
    cell = bc.scroll_to_cell(ctx, index, "quiz-cell")
    output = cell.locator(".jp-Cell-outputWrapper")
    radios = cell.locator(".widget-radio-box input[type=radio]")
    try:
        radios.first.wait_for(state="visible", timeout=30_000)
    except Exception:
        ctx.shot("06_quiz_page.png")
        report.check(False, "quiz widget renders", "no radio buttons visible; see 06_quiz_page.png")
        return
    static = cell.locator(".minirt-static")
    report.check(radios.count() == sum(len(q.get("choices", [])) for q in questions)
                 and static.count() == 1 and not static.is_visible(),
                 "quiz widget renders", f"{len(questions)} questions, {radios.count()} radio buttons; "
                 f"static copy present {static.count() == 1}, hidden {not static.is_visible()}")
    page.wait_for_timeout(300)
    ctx.shot("06_quiz_before.png", output)

    boxes = cell.locator(".widget-vbox .widget-vbox")         # one VBox per question, in order
    choice = [i for i, q in enumerate(questions) if q["kind"] == "choice"]
    number = [i for i, q in enumerate(questions) if q["kind"] == "number"]
    first, second = choice[0], choice[1]
    wrong = next(c["text"] for c in questions[first]["choices"] if not c["correct"])
    right = next(c["text"] for c in questions[second]["choices"] if c["correct"])

    def click(i: int, text: str) -> str:
        boxes.nth(i).locator(".widget-radio-box label", has_text=activities._plain(text)).first.click()
        return feedback(i)

    def feedback(i: int) -> str:
        fb = boxes.nth(i).locator(".widget-html").last
        bc.wait_for(lambda: fb.inner_text().strip(), 15, f"feedback of question {i + 1}")
        return " ".join(fb.inner_text().split())

    layout = page.evaluate(JS_RADIO_LAYOUT, index)
    report.check(layout["labels"] > 0 and not layout["under"],
                 "radio labels wrap beside their buttons",
                 f"{layout['labels']} labels, {layout['wrapped']} wrap onto several lines, every line starts right "
                 f"of its button" if not layout["under"] else f"text under its button: {layout['under'][:3]}")

    text = click(first, wrong)
    report.check(text.startswith("\u2718 Not quite.") and "See the section" in text,
                 "wrong answer: feedback", f"Q{first + 1} {wrong[:40]!r} -> {text[:110]!r}")
    section_link_flow(ctx, boxes.nth(first), questions[first]["section"])
    cell = bc.scroll_to_cell(ctx, index, "quiz-cell-again")          # back to the quiz
    boxes = cell.locator(".widget-vbox .widget-vbox")
    text = click(second, right)
    report.check(text.startswith("\u2714 Right."), "right answer: feedback", f"Q{second + 1} -> {text[:110]!r}")
    answered, right_first = 2, 1
    if number:
        n = number[0]
        box = boxes.nth(n).locator("input[type=text]").first
        q = questions[n]
        box.fill(f"{q['answer'] + q.get('tolerance', 0) + max(1, abs(q['answer'])):g}")    # too high first
        box.press("Enter")
        text = feedback(n)
        shown = f"{q['answer']:g}"
        report.check(text.startswith("\u2718 Not yet: too high.") and "Try once more" in text,
                     "wrong number: hint, second try", f"Q{n + 1} -> {text[:110]!r}")
        box.fill(shown)
        box.press("Enter")
        bc.wait_for(lambda: feedback(n).startswith("\u2714"), 15, "the second try's feedback")
        text = feedback(n)
        report.check(text.startswith("\u2714 Right."), "number answer, second try: feedback",
                     f"Q{n + 1} -> {text[:110]!r}")
        answered += 1
    expect = f"Score: {right_first} / {len(questions)}"
    label = cell.get_by_text("Score:").last
    bc.wait_for(lambda: expect in label.inner_text(), 10, "the quiz score to update")
    report.check(expect in label.inner_text(), "quiz score", " ".join(label.inner_text().split()))
    tall_shot(ctx, index, "07_quiz_after.png")

    score = find_cell(ctx, "activities.score(")
    if score is not None:
        cell = bc.scroll_to_cell(ctx, score, "score-cell")
        want = f"quiz {right_first}/{len(questions)} right at the first try ({answered}/{len(questions)} answered)"
        with_text = cell.get_by_text("Self-check")
        try:
            bc.wait_for(lambda: want in with_text.first.inner_text(), 10, "the score cell to update")
            ok = True
        except TimeoutError:
            ok = False
        report.check(ok, "chapter score cell", " ".join(with_text.first.inner_text().split())[:160])
        ctx.shot("08_score.png", cell.locator(".jp-Cell-outputWrapper"))

    hunt = find_cell(ctx, "activities.treasure_hunt(")
    if hunt is not None:
        cell = bc.scroll_to_cell(ctx, hunt, "hunt-cell")
        summary = cell.locator("details > summary", has_text="Answer").first
        summary.click()
        pre = cell.locator("details[open] pre").first
        pre.wait_for(state="visible", timeout=10_000)
        first_line = pre.inner_text().splitlines()[0]
        ref = activities.load(chapter)["hunt"][0]
        live = activities.source_ref(ref["symbol"], ref.get("marker"), ref.get("end_marker"))
        report.check(first_line.split()[0] == str(live.start), "treasure hunt answer opens",
                     f"shows {live} from line {first_line.split()[0]}: {first_line.strip()[:70]!r}")
        page.wait_for_timeout(300)
        ctx.shot("09_hunt_open.png", cell.locator(".jp-Cell-outputWrapper"))

    # the static render: nbconvert HTML of the committed notebook, opened without a kernel
    with tempfile.TemporaryDirectory(prefix="minirt_quiz_html_") as tmp:
        proc = subprocess.run([sys.executable, "-m", "nbconvert", "--to", "html", "--output-dir", tmp,
                               str(REPO / ctx.nb_path)], capture_output=True, text=True)
        html_file = Path(tmp) / (Path(ctx.nb_path).stem + ".html")
        if not report.check(proc.returncode == 0 and html_file.exists(), "nbconvert HTML",
                            proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""):
            return
        page.goto(html_file.as_uri())
        static = page.locator(".minirt-static").first
        static.wait_for(state="visible", timeout=10_000)
        visible_q = sum(page.get_by_text(activities._plain(q["question"])[:50]).first.is_visible()
                        for q in questions)
        folded = page.locator(".minirt-static details:not([open]) > summary", has_text="Answer").count()
        report.check(visible_q == len(questions) and folded == len(questions), "static HTML shows the quiz",
                     f"{visible_q}/{len(questions)} questions visible, {folded} answers folded")
        static.scroll_into_view_if_needed()
        page.wait_for_timeout(300)
        ctx.shot("10_static_html_quiz.png", static)
