"""Agreement math on hand-made routes."""

import torch

from megatron_rl.routing.agreement import AgreementCounts, mean_route_metrics, route_agreement, slot_matches


def test_slot_matches_compares_sets_not_order() -> None:
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])  # [tokens=2, layers=2, k=2]
    b = torch.tensor([[[1, 0], [2, 4]], [[0, 1], [7, 6]]])
    assert slot_matches(a, b).tolist() == [[2, 1], [0, 2]]


def test_route_agreement_by_hand() -> None:
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 1], [0, 1]]])
    b = torch.tensor([[[1, 0], [3, 2]], [[0, 1], [7, 6]], [[0, 2], [0, 1]]])
    r = route_agreement(a, b)
    # matches per (token, layer): [2, 2], [0, 2], [1, 2] -> 9 of 12 slots
    assert r.agreement == 9 / 12
    assert r.token_all_layers_agree == 1 / 3
    assert r.per_layer == [3 / 6, 6 / 6]
    assert r.tokens == 3
    valid = torch.tensor([True, False, True])
    assert route_agreement(a, b, valid).agreement == 7 / 8
    m = r.as_metrics("routing/", [0, 2])
    assert m == {
        "routing/agreement": 0.75,
        "routing/token_all_layers_agree": 1 / 3,
        "routing/layer_0_agreement": 0.5,
        "routing/layer_2_agreement": 1.0,
    }


def test_counts_add_and_roundtrip() -> None:
    a = torch.tensor([[[0, 1]], [[2, 3]]])
    b = torch.tensor([[[0, 1]], [[2, 4]]])
    from megatron_rl.routing.agreement import agreement_counts

    c = agreement_counts(a[:1], b[:1]) + agreement_counts(a[1:], b[1:])
    assert AgreementCounts.from_tensor(c.to_tensor()).result() == route_agreement(a, b)
    assert route_agreement(a, b).agreement == 3 / 4
    assert mean_route_metrics([{"x": 1.0}, {"x": 0.5, "y": 1.0}]) == {"x": 0.75, "y": 1.0}
