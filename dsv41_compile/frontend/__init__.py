"""The front porch: the work before the pipeline, from Dynamo's graph to the flat ATen graph.

    captured = capture(gm, example_inputs, options)  # every rank: what the graph is, checked
    traced = trace(captured)                         # the rank that compiles: the ATen graph

`capture` (`capture.py`) reads Dynamo's graph once -- its inputs, its model family and that
family's options, how Dynamo traced the token count -- and refuses what a user can get wrong
before anything is traced. `trace` (`trace.py`) makes the token count a symbol however Dynamo
traced it (`tokens.py`), traces each kind of compiled region once, runs AOTAutograd and copies
the regions in: its result is the graph the pipeline rewrites and the runtime wrapper Dynamo
calls. A rank that loads a program the host compiled (`runtime.host_cache`) needs only the
first step. While either runs, a few of torch's meta kernels are replaced (`meta_kernels.py`).
"""

from dsv41_compile.frontend.capture import (
    Captured,
    GraphInputs,
    capture,
    computes_no_tensor,
    mark_call,
    read_inputs,
)
from dsv41_compile.frontend.meta_kernels import hold_during_dynamo_compiles
from dsv41_compile.frontend.trace import Traced, trace

__all__ = [
    "Captured",
    "GraphInputs",
    "Traced",
    "capture",
    "computes_no_tensor",
    "hold_during_dynamo_compiles",
    "mark_call",
    "read_inputs",
    "trace",
]
