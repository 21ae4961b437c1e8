"""The inference server and the policy runner."""

from rlcollect.inference.build import build_action_step
from rlcollect.inference.policy import PolicyRunner
from rlcollect.inference.server import BatchingConfig, InferenceServer

__all__ = ["BatchingConfig", "InferenceServer", "PolicyRunner", "build_action_step"]
