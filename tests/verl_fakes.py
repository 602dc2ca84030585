"""Stand-ins for verl's TransferQueue client, shared by the verl adapter and example tests."""
from __future__ import annotations


class FakeTransferQueue:
    """The two TransferQueue calls verl's v1 ``_compute_advantage`` makes, over one TensorDict."""

    def __init__(self, store):
        self.store, self.put, self.gets = store, None, []

    def kv_batch_get(self, keys, partition_id, select_fields):
        self.gets.append(list(select_fields))
        return self.store.select(*[f for f in select_fields if f in self.store.keys()])

    def kv_batch_put(self, keys, partition_id, fields):
        self.put = fields
        return Meta(keys)


class Meta:
    """The batch handle the queue returns: keys, partition and extra info."""

    def __init__(self, keys):
        self.keys, self.partition_id, self.extra_info = keys, "train", {}

    def __len__(self):
        return len(self.keys)
