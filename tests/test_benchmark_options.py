"""Options of the cost benchmark: ``python -m benchmarks.core_cost --press-option`` (the labelled-press syntax of
:mod:`core_kv.eval.press_labels`)."""

from __future__ import annotations

import pytest

from benchmarks import core_cost
from core_kv.eval.press_labels import parse_press_options

COST = vars(core_cost)


def test_core_cost_press_options_are_typed_per_variant_name():
    variants = parse_press_options([
        "repair.head_budgets=adaptive", "repair.memory=false", "repair.repair=true", "repair.repair_threshold=0.9",
        "other.k=3",
    ])  # fmt: skip
    assert variants == {
        "repair": {"head_budgets": "adaptive", "memory": False, "repair": True, "repair_threshold": 0.9},
        "other": {"k": 3},
    }
    assert type(variants["other"]["k"]) is int and type(variants["repair"]["repair_threshold"]) is float


@pytest.mark.parametrize("bad", ["repair", "repair=true", "repair:memory=false", ".memory=false", "repair.=1"])
def test_core_cost_refuses_malformed_press_options_naming_the_option(bad):
    with pytest.raises(SystemExit, match="--press-option"):
        COST["main"](["--press-option", bad])


def test_core_cost_column_names_must_not_repeat(capsys):
    with pytest.raises(SystemExit) as e:
        COST["main"](["--press-option", "float16.repair=true", "--memory-dtypes", "float16"])
    assert e.value.code == 2 and "column names repeat" in capsys.readouterr().err
