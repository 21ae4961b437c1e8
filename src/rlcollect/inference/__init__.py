"""The inference server and the policy runner."""

from rlcollect.inference.policy import PolicyRunner
from rlcollect.inference.server import BatchingConfig, InferenceServer
from rlcollect.inference.step import build_action_step

__all__ = ["BatchingConfig", "InferenceServer", "PolicyRunner", "build_action_step"]
