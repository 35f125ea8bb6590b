"""The single-device DeepSeek V4.1 model: plain PyTorch, no `torch.distributed`, nothing of the
compiler (`dsv41_compile.deepseek_v41` is how the compiler sees it)."""

from dsv41_compile.deepseek_v41.model.cache import KVCache
from dsv41_compile.deepseek_v41.model.checkpoint import load_checkpoint
from dsv41_compile.deepseek_v41.model.config import PRESETS, ModelConfig
from dsv41_compile.deepseek_v41.model.model import DeepseekV41

__all__ = ["PRESETS", "DeepseekV41", "KVCache", "ModelConfig", "load_checkpoint"]
