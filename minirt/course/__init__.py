"""The exercise system of the minirt course.

* `minirt.course.checks`  - one checker per graded task: runs the student's function and the reference
  function of the package on the same device over many seeded cases and prints exactly one line,
  `PASS exNN.task (k/k cases)`, or raises `CheckFailed` naming the case, the expected value and what came back.
* `minirt.course.grading` - `python -m minirt grade SUBMISSIONS...`: runs submitted notebooks under nbval
  and writes a grade sheet (CSV).

Nothing is imported here, so `from minirt.course import checks` loads only what a notebook needs.
"""
