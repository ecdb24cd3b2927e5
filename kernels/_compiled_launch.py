"""Launching an already compiled Triton kernel through its low-level handle.

`kernel[grid](*args)` binds every argument, specialises each integer and pointer, formats a
cache key and looks the compiled kernel up on every call: tens of microseconds of Python for
a kernel of ~35 arguments, which a decode step pays per layer. A launcher that has already
made one such call with the same argument geometry can keep the `CompiledKernel` it returned
and hand the next call's arguments straight to the kernel's launcher, as the JIT itself does
after its lookup. The caller guarantees that everything Triton specialises on (dtypes,
pointer alignment, the integer arguments it specialises, constexprs) is as in that first
call; `kernels._attention_launch` keys its prepared launches by exactly these facts.

Only Triton versions that pass all bound arguments, constexprs included, to the launcher
(3.3 and later) are handled; elsewhere `CompiledLaunch.of` returns None and the caller keeps
using the JIT.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import triton

#: Oldest Triton whose JIT passes every bound argument (constexprs too) to the launcher.
_MIN_TRITON = (3, 3)


def _triton_version() -> tuple[int, int]:
    parts = triton.__version__.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


@dataclass(slots=True)
class CompiledLaunch:
    """One compiled kernel and its grid, launched without the JIT's argument binding.

    Call it with the CUDA stream handle (an int) and the kernel's arguments in parameter
    order, constexprs included, exactly as they were passed to the JIT.
    """

    kernel: Any  # triton.compiler.CompiledKernel
    grid: tuple[int, int, int]
    run: Callable[..., Any]
    function: Any
    packed_metadata: Any
    hooks: Any  # triton.knobs.runtime: launch hooks (profilers) are read per launch

    @staticmethod
    def of(compiled: Any, grid: tuple[int, ...]) -> CompiledLaunch | None:
        """The handle of `compiled` (what `kernel[grid](...)` returned); None when there is
        none to use: the interpreter, an asynchronous compile, or a Triton older than 3.3."""
        knobs = getattr(triton, "knobs", None)
        if compiled is None or knobs is None or _triton_version() < _MIN_TRITON:
            return None
        try:
            run = compiled.run  # loads the module on first access
            function = compiled.function
            packed_metadata = compiled.packed_metadata
            hooks = knobs.runtime
            hooks.launch_enter_hook  # noqa: B018 - present on every supported version
            if not callable(getattr(compiled, "launch_metadata", None)):
                return None
        except AttributeError:
            return None
        full_grid = tuple(grid) + (1,) * (3 - len(grid))
        return CompiledLaunch(compiled, full_grid, run, function, packed_metadata, hooks)

    def __call__(self, stream: int, args: tuple) -> None:
        grid = self.grid
        hooks = self.hooks
        self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata,
                 self.kernel.launch_metadata(grid, stream, *args), hooks.launch_enter_hook,
                 hooks.launch_exit_hook, *args)
