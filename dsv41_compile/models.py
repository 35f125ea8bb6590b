"""The model-family registry, at the import path it had before it became `families`
(`dsv41_compile.families` re-exported; CHANGELOG.md: "The DeepSeek V4.1 wing")."""

from dsv41_compile.families import (
    adapter_for,
    adapters,
    layouts,
    register_adapter,
    unregister_adapter,
)

__all__ = ["adapter_for", "adapters", "layouts", "register_adapter", "unregister_adapter"]
