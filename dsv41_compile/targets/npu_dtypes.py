"""torch_npu's dtype codes, as its MX ops take them (`dst_type`, `src_type`, `scale_dtype`):
ACL's data type numbers + 256 for the MX element and scale formats, torch's ScalarType numbers
for the float outputs. Shared by the graph-mode rewrites that call the ops and the CPU
stand-ins that define them."""

from __future__ import annotations

import torch

__all__ = ["DTYPE_CODES", "E2M1", "E4M3", "E8M0", "NPU_DTYPES"]

E4M3, E2M1, E8M0 = 292, 296, 293
"""torch_npu's codes of float8_e4m3fn, float4_e2m1 (two per byte) and float8_e8m0fnu."""
DTYPE_CODES = {torch.bfloat16: 15, torch.float32: 6, torch.float16: 5}
"""The output dtypes of the MX ops, as torch's ScalarType numbers."""
NPU_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
"""The output dtypes of the MX ops, by their codes."""
