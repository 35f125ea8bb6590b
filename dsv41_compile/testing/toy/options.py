"""The toy family's own option (`FamilyOptions`): how its MLPs are held."""

from __future__ import annotations

from dataclasses import dataclass

from dsv41_compile.options import FamilyOptions, check_choice

__all__ = ["ToyOptions"]


@dataclass(frozen=True, kw_only=True)
class ToyOptions(FamilyOptions):
    mlp: str = "split"
    """"split": `up` column-parallel and `down` row-parallel over tp (the MLP's input gathered,
    its output's partial sum reduce-scattered); "replicated": both whole on every rank (the
    input gathered, each rank's output its own tokens' rows)."""

    def __post_init__(self) -> None:
        check_choice("mlp", self.mlp, ("split", "replicated"))
