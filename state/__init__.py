"""Storage behind one small interface (RocksDB in production, in-memory for tests). Lands with the pipeline."""
