"""dsv41_compile: a torch.compile backend that shards single-device DeepSeek V4.1 for TP/SP/EP."""

__version__ = "0.1.0"
