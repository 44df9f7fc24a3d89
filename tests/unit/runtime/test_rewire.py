"""Pure tests of the process-group reference rewriter."""

from collections import namedtuple
from dataclasses import dataclass

import torch

from mover_plugin.runtime.rewire import rewire


class Group:
    def __init__(self, name):
        self.name = name


@dataclass
class Collection:
    tp: object
    dp: object


class Layer(torch.nn.Module):
    def __init__(self, group):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.tp_group = group


def test_every_reference_is_replaced_once_and_cycles_terminate():
    old_tp, old_dp, new_tp, new_dp = Group("tp"), Group("dp"), Group("tp'"), Group("dp'")
    Pair = namedtuple("Pair", "a b")
    collection = Collection(tp=old_tp, dp=old_dp)
    model = torch.nn.Sequential(Layer(old_tp), Layer(old_tp))
    model.pg_collection = collection
    holder = {"groups": [old_dp, old_tp], "pair": Pair(old_tp, 3), "self": None}
    holder["self"] = holder  # a cycle
    count = rewire([model, holder], {id(old_tp): new_tp, id(old_dp): new_dp})
    assert model[0].tp_group is new_tp and model[1].tp_group is new_tp
    assert collection.tp is new_tp and collection.dp is new_dp
    assert holder["groups"] == [new_dp, new_tp]
    assert holder["pair"] == Pair(new_tp, 3) and type(holder["pair"]) is Pair
    assert count == 7


def test_parameters_are_untouched():
    model = Layer(Group("tp"))
    before = model.linear.weight
    rewire([model], {})
    assert model.linear.weight is before
