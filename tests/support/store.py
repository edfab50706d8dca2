"""Helpers shared by several test modules (moved from tests/server/test_store.py)."""

from __future__ import annotations

import random

from hwr_client.core.plan import check_plan, to_proto
from hwr_client.tensors import iter_payload
from hwr_server.config import ServerConfig
from hwr_server.publish.publication import Publication
from hwr_server.store.store import Store


def make_store(tmp_path, **kw) -> Store:
    store = Store(ServerConfig(root=str(tmp_path / "root"), **kw))
    store.recover()
    return store


def publish_inproc(store, plan, tensors, *, shuffle=False, size=1000):
    pub = Publication.begin(store, to_proto(plan))
    try:
        chunks = chunks_of(plan, tensors, size)
        if shuffle:
            random.Random(1).shuffle(chunks)
        for fi, off, data in chunks:
            pub.write(fi, off, data)
        return pub.commit()
    finally:
        pub.close()


def chunks_of(plan, tensors, size=1000):
    checked = check_plan(plan)
    return [(fi, off, bytes(d)) for fi, lay in enumerate(checked.layouts) for off, d in iter_payload(lay, tensors, size)]
