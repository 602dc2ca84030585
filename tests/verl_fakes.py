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

    def __init__(self, keys, tags=None):
        self.keys, self.partition_id, self.extra_info = keys, "train", {}
        self.tags = [{} for _ in keys] if tags is None else tags
        self.fields = None

    def __len__(self):
        return len(self.keys)


class RowTransferQueue:
    """A TransferQueue over rows stored per key (what verl's padding and colocated-reward code read and
    write one sample at a time): ``kv_batch_get`` drops fields a row does not have, as the real one."""

    def __init__(self, rows):
        self.rows, self.put = rows, None

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        return list_of_dict_to_tensordict([{k: v for k, v in self.rows[key].items()
                                            if select_fields is None or k in select_fields} for key in keys])

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        import torch

        if fields is None:
            return None
        for i, key in enumerate(keys):
            row = fields[i]
            for name in row.keys():
                value = row.get(name)
                self.rows.setdefault(key, {})[name] = value if isinstance(value, torch.Tensor) else getattr(value, "data", value)
        self.put = fields
        return Meta(keys)
