"""The single-device DeepSeek V4.1 model, at its public import path (the code lives in
`dsv41_compile.models.deepseek_v41`)."""

from dsv41_compile.models.deepseek_v41.cache import KVCache
from dsv41_compile.models.deepseek_v41.checkpoint import load_checkpoint
from dsv41_compile.models.deepseek_v41.config import PRESETS, ModelConfig
from dsv41_compile.models.deepseek_v41.model import DeepseekV41

__all__ = ["PRESETS", "DeepseekV41", "KVCache", "ModelConfig", "load_checkpoint"]
