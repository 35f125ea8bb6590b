"""The single-device DeepSeek V4.1 model (see DESIGN §3 for the contract)."""

from dsv41_compile.model.cache import KVCache
from dsv41_compile.model.config import PRESETS, ModelConfig
from dsv41_compile.model.model import DeepseekV41

__all__ = ["PRESETS", "DeepseekV41", "KVCache", "ModelConfig"]
