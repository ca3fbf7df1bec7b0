"""A kernel before the kernel under test that is still running long after that kernel has started: what a PDL test
needs to show that the kernel waits (`griddepcontrol.wait`) before it reads the earlier kernel's output
(`spin_before_writing`, called at the start of such a writer; lab/tests/slow_copy.py builds one on it)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:     # no Triton: the PDL tests skip before they get here
    triton = None
else:
    @triton.jit
    def spin_before_writing(SPIN_NS: tl.constexpr):
        """In a kernel launched with PDL: let the next kernel start, wait for the one before, then spin SPIN_NS
        nanoseconds before the writes that follow."""
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        t0 = tl.extra.cuda.globaltimer()
        t = t0
        while t - t0 < SPIN_NS:
            t = tl.extra.cuda.globaltimer()
