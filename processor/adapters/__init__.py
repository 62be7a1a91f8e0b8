"""Where events come from and releases go: the replay runner (files), the Kafka worker core
(``worker``, free of any Kafka client), the Faust app (the only Faust code), metrics and the
produce/tail tools. Adapters hold no privacy policy: they call :mod:`dpstream.processor.engine`
(docs/architecture.md, "Layers")."""
