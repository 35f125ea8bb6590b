"""Test helpers shipped with the package, for the tests, the tools and users' own checks:
batches, one rank of a fake world, real multi-rank runs on gloo, the per-rank comparison
against the single-device model, the model configurations compiler tests compile, capture
through the official hooks, serving faults, small graphs for pass tests and a CPU stand-in for
torchair. They import the library; the library never imports them."""
