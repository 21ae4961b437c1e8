"""The collector's face and plan: ``AsyncBatchedCollector``, the checks and probe its plan
is made from, and background collection. The chunks-to-batches machinery is the
``batches`` wing; what runs inside the workers is ``rlcollect.worker``.
"""
