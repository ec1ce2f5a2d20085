"""The ``kvcascade`` command and its trace replay tooling.

``cli`` (the command line; ``--help`` and ``--version`` import no torch), ``trace`` (the
Mooncake trace reader), ``run`` (the byte-exact replay through a real :class:`~kvcascade.Cascade`),
``compare`` (the policy comparison engine of ``kvcascade replay --compare-policies``) and ``opt``
(Belady's OPT on the same model). Nothing is imported here, so ``kvcascade.replay.cli`` starts
without torch; see docs/architecture.md and docs/policies.md.
"""
