"""`validate_batch` at the import path it had before the family's wing:
`dsv41_compile.deepseek_v41.model.validate` re-exported (CHANGELOG.md: "The DeepSeek V4.1 wing")."""

from dsv41_compile.deepseek_v41.model.validate import validate_batch

__all__ = ["validate_batch"]
