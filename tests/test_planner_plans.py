"""The planner gives the recorded plans (tests/data/planner_plans.json) for a fixed set of inputs on
two synthetic pairs: every part, choice, prediction and line of the explanation, and every refusal.
A change to the planner's numbers is deliberate only with a re-recording
(``python tests/planner_cases.py --record``) in the same commit."""

from __future__ import annotations

import json

import pytest
from planner_cases import PAIRS, RECORDED, cases, make_pair, plan_summary


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(RECORDED.read_text())


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request, tiny_model_factory, tmp_path_factory):
    return request.param, make_pair(request.param, tiny_model_factory, tmp_path_factory.mktemp("plans"))


def test_the_plans_are_the_recorded_ones(pair, recorded):
    name, (model, sidecar) = pair
    assert [r["case"] for r in recorded[name]] == json.loads(json.dumps(cases(name)))
    for row in recorded[name]:
        got = json.loads(json.dumps(plan_summary(model, sidecar, row["case"])))
        assert got == row["plan"], row["case"]
