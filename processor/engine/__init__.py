"""The engine: the one drive loop every adapter (replay, the Kafka worker) and every benchmark
runs (:mod:`processor.engine.runner`; docs/architecture.md)."""
