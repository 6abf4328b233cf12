"""kernel_testing.pairwise: the cases the kernel tests with several crossed settings run."""

import itertools

import kernel_testing
from kernel_testing import pairwise

AXES = {
    "dtype": ["fp32", "fp16", "bf16"],
    "num_q_heads, num_kv_heads, head_dim, block_size": [(2, 2, 64, 16), (4, 1, 128, 16), (8, 1, 64, 8), (8, 2, 32, 4)],
    "window": [None, 20],
    "num_splits": [1, 3, 8],
    "ids_in_registers": [False, True],
}


def _cases(axes):
    mark = pairwise(axes)
    return mark.args[0], mark.args[1]


def test_every_pair_of_two_settings_meets_in_some_case(monkeypatch):
    monkeypatch.setattr(kernel_testing, "ALL_CASES", False)
    names, cases = _cases(AXES)
    assert names == "dtype, num_q_heads, num_kv_heads, head_dim, block_size, window, num_splits, ids_in_registers"
    assert all(len(case) == 8 for case in cases)
    split = [(case[0], case[1:5], case[5], case[6], case[7]) for case in cases]  # back to one value per axis
    values = list(AXES.values())
    for i, j in itertools.combinations(range(len(values)), 2):
        for a, b in itertools.product(values[i], values[j]):
            assert any(case[i] == a and case[j] == b for case in split), (i, a, j, b)
    assert len(cases) == len(set(cases)) <= 16  # of 144 combinations: at least 4 x 3 = 12 are needed
    assert _cases(AXES) == (names, cases)  # the same every run


def test_all_cases_runs_the_whole_product(monkeypatch):
    monkeypatch.setattr(kernel_testing, "ALL_CASES", True)
    _, cases = _cases(AXES)
    assert len(cases) == len(set(cases)) == 3 * 4 * 2 * 3 * 2


def test_one_axis_is_each_of_its_values_and_one_value_is_kept(monkeypatch):
    monkeypatch.setattr(kernel_testing, "ALL_CASES", False)
    assert _cases({"dtype": ["fp32", "bf16"]}) == ("dtype", ["fp32", "bf16"])
    assert _cases({"a": [1], "b": [2, 3]}) == ("a, b", [(1, 2), (1, 3)])
