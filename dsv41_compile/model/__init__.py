"""The single-device DeepSeek V4.1 model, at the import path it had before the family's wing:
`dsv41_compile.deepseek_v41.model` re-exported (CHANGELOG.md: "The DeepSeek V4.1 wing")."""

from dsv41_compile.deepseek_v41.model import (
    PRESETS,
    DeepseekV41,
    KVCache,
    ModelConfig,
    load_checkpoint,
)

__all__ = ["PRESETS", "DeepseekV41", "KVCache", "ModelConfig", "load_checkpoint"]
