"""The single-device DeepSeek V4.1 model: plain PyTorch, no `torch.distributed`, nothing of the
compiler (`dsv41_compile.models.deepseek_v41` is how the compiler sees it)."""

from dsv41_compile.model.cache import KVCache
from dsv41_compile.model.checkpoint import load_checkpoint
from dsv41_compile.model.config import PRESETS, ModelConfig
from dsv41_compile.model.model import DeepseekV41

__all__ = ["PRESETS", "DeepseekV41", "KVCache", "ModelConfig", "load_checkpoint"]
