"""DeepSeek V4.1's test helpers, shipped with the package for the tests, the tools and users'
own checks: batches, the configurations compiler tests compile, one rank of a fake world,
the per-rank comparison against the single-device model, an edit corpus, synthetic
checkpoints, serving faults and speculative decoding on real ranks. They import the library;
the library never imports them."""
