"""dsv41_compile: a torch.compile backend that shards single-device DeepSeek V4.1 for TP/SP/EP.

Importing the package registers the `dsv41_sp` backend; the model families are plug-ins, found
through the entry-point group `dsv41_compile.families` (the built-in DeepSeek V4.1,
`dsv41_compile.deepseek_v41`, among them) when the backend first looks for one:

    import dsv41_compile
    compiled = torch.compile(model, backend="dsv41_sp", options={"tp": 4})
"""

from dsv41_compile.backend import dsv41_sp, mark_token_dim
from dsv41_compile.options import BackendOptions

__all__ = ["BackendOptions", "dsv41_sp", "mark_token_dim"]
__version__ = "0.1.0"
