"""The policy's choice read from the store (pipeline.studies.choices), on hand-written rows."""

import json

from pipeline.store import Store
from pipeline.studies.choices import policy_odds


def test_policy_odds_average_the_policys_own_design_odds_per_part(tmp_path):
    store = Store(tmp_path)
    store.write("queries", [dict(split="train", query_id=q, benchmark="mixed", prompt="p", reference="1",
                              meta=json.dumps({"task": part})) for q, part in (("a", "products"), ("b", "products"),
                                                                                ("c", "calendar"))], "r", 0)
    odds = {"a": {"direct": 0.9, "pot": 0.1}, "b": {"direct": 0.5, "pot": 0.5}, "c": {"direct": 0.2, "pot": 0.8}}
    rows = [dict(gen_id=f"{q}{slot}", kind="workflow", query_id=q, slot=slot, text="x",
                 sampling=json.dumps({"choice_step": {"temperature": 8.0, "odds": odds[q]}}))
            for q in odds for slot in range(2)]
    rows.append(dict(gen_id="d0", kind="workflow", query_id="a", slot=9, text="x", sampling=json.dumps({"n": 1})))
    store.write("generations", rows, "r", 0)
    got = {(r["part"], r["design"]): r["odds"] for r in policy_odds(store, "r").iter_rows(named=True)}
    # products: direct (0.9 + 0.5) / 2 = 0.7, pot 0.3; calendar: 0.2 / 0.8; the row without a design step left out
    assert got == {("calendar", "direct"): 0.2, ("calendar", "pot"): 0.8, ("products", "direct"): 0.7,
                   ("products", "pot"): 0.3}
