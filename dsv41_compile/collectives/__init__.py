"""Collectives: the transition table and the pass that inserts what placements imply."""
