"""The engine: one query's pipeline (:mod:`dpstream.processor.engine.pipeline`), the one drive loop every
adapter and benchmark runs (:mod:`dpstream.processor.engine.runner`), dynamic-count state and the budget
gate (docs/architecture.md)."""
