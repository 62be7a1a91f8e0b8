"""``dpstream bench ...``: benchmarks of the product's own path (:mod:`dpstream.processor.engine.runner`),
each against a baseline measured in the same run (docs/architecture.md, "Benchmarks")."""
