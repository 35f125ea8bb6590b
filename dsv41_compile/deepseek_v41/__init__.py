"""DeepSeek V4.1, the built-in model family, in one wing: the single-device model (`model/`),
how the compiler sees it (`adapter.py`, `options.py`, `plan.py`, `graph_mode.py`), decoding
with its DSpark drafter (`serving.py`) and its test helpers (`testing/`). Generic code never
imports it (an import-linter contract): the registry finds it as a plug-in, through the entry
point this package declares (`families.load_entry_points`), as it finds a family of one's own."""

from dsv41_compile.deepseek_v41.adapter import DEEPSEEK_V41
from dsv41_compile.deepseek_v41.model import (
    PRESETS,
    DeepseekV41,
    KVCache,
    ModelConfig,
    load_checkpoint,
)

__all__ = ["DEEPSEEK_V41", "PRESETS", "DeepseekV41", "KVCache", "ModelConfig", "load_checkpoint"]
