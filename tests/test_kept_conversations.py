"""The release order of kept verifier conversations: candidates below their best sibling first."""
from treeserve.runtime.kept_conversations import KeptConversations


def _kept(*keys):
    kept = KeptConversations()
    for i, key in enumerate(keys):
        kept.add(key, f"r{i}")
    return kept


def test_siblings_below_the_best_move_to_the_front_and_others_keep_their_order():
    a, b, c = ("q", "s1", "a"), ("q", "s1", "b"), ("q", "s1", "c")
    other = ("q2", "s1")
    kept = _kept(other, a, b, c)
    scores = {a: 0.2, b: 0.9, c: 0.5}
    demoted = kept.demote_below_best(c, scores.get)
    assert sorted(demoted) == ["r1", "r3"]
    assert list(kept)[-2:] == [other, b] and set(list(kept)[:2]) == {a, c}
    assert kept.first() in (a, c)


def test_siblings_without_a_score_stay_where_they_are():
    a, b = ("q", "s1", "a"), ("q", "s1", "b")
    kept = _kept(a, b)
    assert kept.demote_below_best(a, {a: 0.3}.get) == []
    assert list(kept) == [a, b]


def test_pop_forgets_the_sibling_index():
    a, b = ("q", "s1", "a"), ("q", "s1", "b")
    kept = _kept(a, b)
    assert kept.pop(b) == "r1"
    assert kept.demote_below_best(a, {a: 0.1, b: 0.9}.get) == []
    assert list(kept) == [a] and len(kept) == 1 and b not in kept
