"""`validate_batch` at its public import path (the code lives in
`dsv41_compile.models.deepseek_v41.validate`)."""

from dsv41_compile.models.deepseek_v41.validate import validate_batch

__all__ = ["validate_batch"]
