"""Test utilities shipped with the package (batch builders; later graph printer and harness)."""
