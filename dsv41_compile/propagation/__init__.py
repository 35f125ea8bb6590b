"""Sharding propagation: placements per FX node (the adapter to DTensor's rules lives here)."""
