"""Whether a tensor has memory behind it: shared by the model (which makes parameters without
memory, `DeepseekV41.without_weights`) and the backend (which refuses to run on them). A leaf:
it imports nothing of the package."""

from __future__ import annotations

import torch

__all__ = ["has_no_weights"]


def has_no_weights(value: torch.Tensor) -> bool:
    """A parameter with no memory behind it: on the meta device, or a broadcast whose storage
    is smaller than its elements (`DeepseekV41.without_weights`)."""
    if value.is_meta:
        return True
    return value.untyped_storage().nbytes() < value.numel() * value.element_size()
