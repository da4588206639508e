"""The passes of ``materialize`` and the Program under construction they work on (a ``Draft``).

:mod:`planlab.plan.materialize` applies them in order (its ``PASSES``); ``docs/architecture.md``
describes each. ZeRO (:mod:`planlab.plan.zero`), coshard (:mod:`planlab.plan.coshard`) and the
zero-bubble split (:mod:`planlab.plan.backward_split`) are passes too, in modules of their own.
"""
