"""docs/planning.md's plan tables are the ones `python -m bench.plan_docs` printed and stored."""

import json

import pytest

from bench import plan_docs


def test_every_plan_table_in_the_doc_is_the_stored_one():
    store = json.loads(plan_docs.STORE.read_text())
    assert set(store) == set(plan_docs.PLANS)
    doc = plan_docs.DOC.read_text()
    assert plan_docs.rewrite(doc, store) == doc
    for entry in store.values():
        assert plan_docs.block(entry) in doc
        first = entry["table"].splitlines()[0]
        ranked = sum(c["dropped"] is None for c in entry["plan"]["candidates"])
        assert f"{ranked} ranked" in first  # the table and its data are of one plan


def test_a_doc_without_a_tables_markers_is_an_error():
    store = json.loads(plan_docs.STORE.read_text())
    with pytest.raises(SystemExit, match="has no table"):
        plan_docs.rewrite("# no tables here\n", store)
