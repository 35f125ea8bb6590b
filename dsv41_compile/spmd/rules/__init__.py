"""The sharding rules, in one home: the registry and the lookup (`registry`: `RULES`,
`@rule(op)` for a rule of one's own, `strategy_for`), DTensor's rules through one adapter
(`dtensor`), and the built-in rule modules, each a `RuleTable` registered here, explicitly:
token-preserving views, size reads and the vocab-sharded lookup (`views`), the ops along the
token dim (`token_ops`). The rule of a routed-experts op (`routed_experts`) is the family's to
give (`ModelAdapter.rules`), made from its `core.adapter.RoutedExperts` contract."""

from dsv41_compile.spmd.rules.registry import (
    EXACT_SUMS,
    RULES,
    RuleAnswers,
    RuleTable,
    is_token_shard,
    reads_an_unsplit_dim,
    register_table,
    rule,
    rule_answers,
    strategy_for,
    tensor_outputs,
)
from dsv41_compile.spmd.rules.token_ops import TOKEN_RULES
from dsv41_compile.spmd.rules.views import VIEW_RULES

__all__ = [
    "EXACT_SUMS",
    "RULES",
    "RuleAnswers",
    "RuleTable",
    "is_token_shard",
    "reads_an_unsplit_dim",
    "register_table",
    "rule",
    "rule_answers",
    "strategy_for",
    "tensor_outputs",
]

for _table in (VIEW_RULES, TOKEN_RULES):
    register_table(_table)
