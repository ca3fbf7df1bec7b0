"""The lab's tests run as the package's tests do (`pytest lab/tests` from the repository root): the repository root
(for `lab.kernels`) and tests/ (its shared helpers: `pdl_writer`, `test_paged_attention`'s cases) go on sys.path,
and tests/conftest.py is imported, not copied: its Triton-interpreter setup on a machine without CUDA (set before any
kernel is defined), its names (`TRITON_DEVICE`, ...) and its fixtures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "tests", ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

_spec = importlib.util.spec_from_file_location("minirt_tests_conftest", ROOT / "tests" / "conftest.py")
_shared = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _shared
_spec.loader.exec_module(_shared)
# Re-exported: pytest finds the fixtures here, and `from conftest import TRITON_DEVICE` finds the names, whichever of
# the two conftest modules was imported under that name.
globals().update({name: value for name, value in vars(_shared).items()
                  if not name.startswith("__") and name != "pytest_configure"})
