"""Decoding, at the import path it had before the family's wing:
`dsv41_compile.deepseek_v41.serving` re-exported (CHANGELOG.md: "The DeepSeek V4.1 wing")."""

from dsv41_compile.deepseek_v41.serving import Decoded, accept_sampled, generate, propose, sample

__all__ = ["Decoded", "accept_sampled", "generate", "propose", "sample"]
