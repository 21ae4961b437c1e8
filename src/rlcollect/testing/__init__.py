"""Tools to test collectors and transports: envs that tell on themselves, and a suite.

:class:`CountingEnv` writes its id, episode and step (and the last action it received)
into its observation, so a test can check routing, order, gaps and episode ends row by
row. :func:`check_transport` runs the transport conformance suite against any
:class:`~rlcollect.transports.Transport` subclass (``AssertionError`` naming the failed
check if one fails). The submodules:

* ``envs``: :class:`CountingEnv`, :class:`CountingVectorEnv`, :func:`episode_length`,
  :func:`counting_actions`, :func:`counting_info` and the columns of an observation
  (``ENV_ID``, ``EPISODE``, ``STEP``, ``LAST_ACTION``).
* ``programs``: :func:`counting_layout` and :func:`counting_programs`, a ring and the
  worker programs of CountingEnv workers.
* ``conformance``: :func:`check_transport` and :data:`CHECKS`; the checks themselves
  live in ``_checks``, the numpy stand-in for the inference server in ``_responder``.

This package imports no torch: ``CountingEnv`` runs inside worker processes.

Examples:
    >>> from rlcollect.testing import check_transport
    >>> from rlcollect.transports import ThreadQueueTransport
    >>> check_transport(ThreadQueueTransport)  # returns None when every check passes
"""

from rlcollect.testing.conformance import CHECKS, check_transport
from rlcollect.testing.envs import ENV_ID as ENV_ID
from rlcollect.testing.envs import EPISODE as EPISODE
from rlcollect.testing.envs import LAST_ACTION as LAST_ACTION
from rlcollect.testing.envs import STEP as STEP
from rlcollect.testing.envs import (
    CountingEnv,
    CountingVectorEnv,
    counting_actions,
    counting_info,
    episode_length,
)
from rlcollect.testing.programs import counting_layout, counting_programs

__all__ = [
    "CHECKS",
    "CountingEnv",
    "CountingVectorEnv",
    "check_transport",
    "counting_actions",
    "counting_info",
    "counting_layout",
    "counting_programs",
    "episode_length",
]
