"""The store interface: RocksDB and memory backends agree; RocksDB survives close and reopen."""
import numpy as np
import pytest

from dpstream.state import keys as sk
from dpstream.state.store import MemoryStore, PartitionStores, RocksDBStore, WriteBatch


def fill(store):
    batch = WriteBatch()
    for i in range(50):
        batch.put(sk.trigger_prefix(sk.JOURNAL, b"qqqq", 1000, i % 7) + i.to_bytes(8, "big"), bytes([i]))
    batch.put(b"zz", b"last")
    batch.put(b"gone", b"x")
    batch.delete(b"gone")  # last write to a key wins
    store.write(batch)


@pytest.fixture(params=["memory", "rocksdb"])
def store(request, tmp_path):
    s = MemoryStore() if request.param == "memory" else RocksDBStore(tmp_path / "db")
    yield s
    s.close()


def test_backends_agree(store, tmp_path):
    fill(store)
    reference = MemoryStore()
    fill(reference)
    prefix = sk.trigger_prefix(sk.JOURNAL, b"qqqq", 1000, 3)
    assert list(store.scan_prefix(prefix)) == list(reference.scan_prefix(prefix))
    assert len(list(store.scan_prefix(prefix))) == 7
    assert store.get(b"gone") is None and store.get(b"zz") == b"last"
    keys = [prefix + i.to_bytes(8, "big") for i in (3, 10, 11)]
    assert store.get_many(keys) == [bytes([3]), bytes([10]), None]
    # scans come back in key order: big-endian triggers sort numerically
    window = sk.window_prefix(sk.JOURNAL, b"qqqq", 1000)
    triggers = [int.from_bytes(k[len(window):len(window) + 4], "big") for k, _ in store.scan_prefix(window)]
    assert triggers == sorted(triggers) and len(triggers) == 50
    store.delete_prefix(sk.trigger_prefix(sk.JOURNAL, b"qqqq", 1000, 3))
    assert not list(store.scan_prefix(prefix))
    assert len(list(store.scan_prefix(window))) == 43


def test_rocksdb_survives_close_and_reopen(tmp_path):
    stores = PartitionStores(tmp_path / "state")
    fill(stores.store(3))
    stores.close()
    reopened = PartitionStores(tmp_path / "state")
    assert reopened.store(3).get(b"zz") == b"last"
    assert reopened.store(0).get(b"zz") is None  # one database per partition
    assert (tmp_path / "state" / "partition-3").is_dir()
    reopened.destroy()
    assert not (tmp_path / "state").exists()


def test_fixed_keys_and_suffix():
    ids = np.array([1, 2**63 + 5, 0], dtype=np.uint64)
    keys = sk.fixed_keys(b"pre", ids)
    assert keys == [b"pre" + int(i).to_bytes(8, "big") for i in ids.tolist()]
    np.testing.assert_array_equal(sk.suffix_u64(keys, 3), ids)
    assert sk.query_id("a") != sk.query_id("b") and len(sk.query_id("a")) == 4
