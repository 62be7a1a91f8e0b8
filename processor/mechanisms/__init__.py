"""Pure mechanisms, no I/O: keyed noise, the DP trees, key selection (DP-SQLP Algorithm 2),
perturbation (Algorithm 3), contribution bounding, hierarchical consistency and the dynamic-count
mechanisms. They take arrays and a :class:`dpstream.accountant.plan.PrivacyPlan`, and return arrays
(docs/architecture.md, "Layers")."""
