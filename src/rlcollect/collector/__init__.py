"""The collector and its worker loop.

Import from the submodules: ``rlcollect.collector.collector`` pulls in torch, while
``rlcollect.collector.worker`` must stay importable without it (worker processes).
"""
