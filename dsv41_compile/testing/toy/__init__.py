"""A toy model family, in a folder of its own as a family's wing is: its model (`model.py`: an
embedding, residual MLP blocks on token-sharded residuals, a head), its own options
(`options.py`), its adapter (`adapter.py`), registered for a block by `toy_family`. Pass
tests compile it on the same harness as DeepSeek V4.1's (about 80 nodes per graph, a second):

    with toy_family():
        gm, ctx, _ = compile_model_on_fake_rank(ToyLM(), (tokens,), {"tp": 4, "mlp": "split"})
        gm, ctx, _ = plan_rank(ToyConfig(), {"tp": 4}, world_size=8)  # on meta tensors

docs/architecture.md builds the same family step by step."""

from dsv41_compile.testing.toy.adapter import ToyAdapter, toy_family
from dsv41_compile.testing.toy.model import ToyConfig, ToyLM
from dsv41_compile.testing.toy.options import ToyOptions

__all__ = ["ToyAdapter", "ToyConfig", "ToyLM", "ToyOptions", "toy_family"]
