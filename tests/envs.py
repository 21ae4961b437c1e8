"""Test envs. This module imports no torch, so worker processes can unpickle them."""

import sys

import gymnasium as gym
import numpy as np

from rlcollect.testing import CountingEnv, CountingVectorEnv


def cartpole():
    return gym.make("CartPole-v1")


class TorchProbeEnv(CountingEnv):
    """Reports in its observation whether torch is imported in its process."""

    def _obs(self):
        obs = super()._obs()
        obs[3] = int("torch" in sys.modules) * 1000 + (self.last_action if self.t else 0)
        return obs


class StepCounter(CountingEnv):
    steps = 0  # thread transport: every env lives in the test's process

    def step(self, action):
        type(self).steps += 1
        return super().step(action)


class SlowCounting(CountingEnv):
    """A CountingEnv whose every step takes ``seconds`` longer: an env slower than its
    peers (nothing waits on the delay; it only makes the env slow)."""

    def __init__(self, env_id, seconds=0.002):
        super().__init__(env_id)
        self.seconds = seconds

    def step(self, action):
        import time

        time.sleep(self.seconds)
        return super().step(action)


class DictObsEnv(gym.Env):
    def __init__(self, env_id):
        self.env_id = env_id
        self.observation_space = gym.spaces.Dict(
            {
                "pos": gym.spaces.Box(-10, 10, (2,), np.float32),
                "grid": gym.spaces.Dict({"cells": gym.spaces.Box(0, 255, (3, 4), np.uint8)}),
            }
        )
        self.action_space = gym.spaces.Box(-1, 1, (2,), np.float32)
        self.t = 0

    def _obs(self):
        cells = np.full((3, 4), self.env_id, np.uint8)
        return {"pos": np.array([self.env_id, self.t], np.float32), "grid": {"cells": cells}}

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), float(action.sum()), False, self.t >= 7, {}


class OtherActions(CountingEnv):
    def __init__(self, env_id):
        super().__init__(env_id)
        self.action_space = gym.spaces.Discrete(3)


class WrongShape(CountingEnv):
    def _obs(self):
        return np.zeros(3, np.int64)


class BadRewardLater(CountingEnv):
    """Returns a string as its reward from its fourth step on: a change after the first
    calls, which a check of the first step alone would miss."""

    def step(self, action):
        obs, reward, term, trunc, info = super().step(action)
        return obs, ("a lot" if self.t >= 4 else reward), term, trunc, info


class Unprintable(Exception):
    """An exception whose ``str()`` and ``repr()`` both raise (a message built from a
    resource already closed, say)."""

    def __str__(self):
        raise RuntimeError("str() of this exception fails")

    def __repr__(self):
        raise RuntimeError("repr() of this exception fails")


class RaisesUnprintable(CountingEnv):
    """Raises an :class:`Unprintable` in its fourth step."""

    def step(self, action):
        if self.t == 3:
            raise Unprintable("lost")
        return super().step(action)


class NoneRewardLater(CountingEnv):
    """Returns ``None`` as its reward from its fourth step on (numpy would store NaN)."""

    def step(self, action):
        obs, reward, term, trunc, info = super().step(action)
        return obs, (None if self.t >= 4 else reward), term, trunc, info


class FarObservationLater(gym.Env):
    """A float32 observation space, float64 observations: from step 3 on one holds 1e300,
    beyond float32's range (numpy's cast would store inf)."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, env_id=0):
        self.t = 0

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return np.zeros(2, np.float64), {}

    def step(self, action):
        self.t += 1
        obs = np.array([self.t, 1e300 if self.t >= 3 else 0.5])
        return obs, 1.0, False, self.t >= 50, {}


class _Float64Observations(gym.vector.VectorObservationWrapper):
    """Hands out a vector env's observations as float64, one value beyond float32's
    range from the third step on (SyncVectorEnv itself stores its sub-envs' in the
    space's dtype)."""

    steps = 0

    def observations(self, observations):
        out = np.asarray(observations, np.float64)
        if self.steps >= 3:
            out[:, 1] = 1e300
        self.steps += 1
        return out


def far_observation_vector():
    """Two float32-space envs, stepped together, whose observations come as float64."""
    return _Float64Observations(
        gym.vector.SyncVectorEnv([FarObservationLater, FarObservationLater])
    )


class _Lenient(gym.spaces.Discrete):
    def contains(self, x):
        return True


class TrustingEnv(CountingEnv):
    """A CountingEnv that takes any action, as many envs do (they index a table with
    it): its observation's last_action shows what reached it."""

    def __init__(self, env_id):
        super().__init__(env_id)
        self.action_space = _Lenient(5)


class PicksActionTypes(CountingEnv):
    """A CountingEnv that raises unless an action reaches it as a numpy int64 (the
    dtype of the batch's discrete actions), as gymnasium's vector envs pass each env
    its element of the action array."""

    def step(self, action):
        if type(action) is not np.int64:
            raise TypeError(f"got an action of type {type(action).__name__}, not numpy.int64")
        return super().step(action)


def trusting_vector(first=0):
    """A SyncVectorEnv of two TrustingEnvs."""
    import functools

    return gym.vector.SyncVectorEnv([functools.partial(TrustingEnv, first + j) for j in range(2)])


class BadFlagLater(CountingEnv):
    """Returns a string as its terminated flag from its fourth step on."""

    def step(self, action):
        obs, reward, term, trunc, info = super().step(action)
        return obs, reward, ("no" if self.t >= 4 else term), trunc, info


def frozen_lake():
    return gym.make("FrozenLake-v1")


def pendulum():
    return gym.make("Pendulum-v1")


def counting_vector(first, n, autoreset_mode="NextStep", copy=True):
    """CountingEnvs ``first … first + n - 1`` in a gymnasium SyncVectorEnv (with
    ``copy=False`` each step's observations overwrite the last one's array)."""
    import functools

    return gym.vector.SyncVectorEnv(
        [functools.partial(CountingEnv, first + j) for j in range(n)],
        autoreset_mode=autoreset_mode,
        copy=copy,
    )


def sync_factories(num_vector_envs, n, mode="NextStep"):
    """Factories of ``num_vector_envs`` ``counting_vector``s of ``n``, consecutive ids."""
    import functools

    return [functools.partial(counting_vector, n * i, n, mode) for i in range(num_vector_envs)]


def async_factories(num_vector_envs, n, batch, mode="NextStep"):
    """Factories of ``num_vector_envs`` CountingVectorEnvs of ``n`` (consecutive ids),
    each ``recv`` naming ``batch`` sub-envs picked at random (seeded per vector env)."""
    import functools

    return [
        functools.partial(CountingVectorEnv, n * i, n, batch, autoreset_mode=mode, order_seed=i)
        for i in range(num_vector_envs)
    ]


def failing_vector():
    """A SyncVectorEnv of 3 CountingEnvs whose third raises in step 4 of episode 0."""
    import functools

    fns = [functools.partial(CountingEnv, j) for j in range(3)]
    fns[2] = functools.partial(CountingEnv, 2, fail_at=(0, 4))
    return gym.vector.SyncVectorEnv(fns)


class NoneRewardsVector(CountingVectorEnv):
    """From its fourth result on, returns its rewards as a list of ``None``."""

    def recv(self):
        obs, reward, term, trunc, info = super().recv()
        self._results = getattr(self, "_results", 0) + 1
        if self._results >= 4:
            reward = [None] * len(reward)
        return obs, reward, term, trunc, info


class LyingIds(CountingVectorEnv):
    """After its first result, names one sub-env twice in info['env_id']."""

    def recv(self):
        obs, reward, term, trunc, info = super().recv()
        if getattr(self, "_lie", False):
            info["env_id"] = np.full_like(info["env_id"], info["env_id"][0])
        self._lie = True
        return obs, reward, term, trunc, info


def atari_vector(autoreset_mode="NextStep", num_envs=4, batch_size=2):
    """ale-py's AtariVectorEnv: Pong, 84x84 grayscale, 4 stacked frames, episodes cut at
    200 frames (50 steps: no noop starts, so every episode is as long)."""
    from ale_py.vector_env import AtariVectorEnv

    return AtariVectorEnv(
        "pong",
        num_envs,
        batch_size=batch_size,
        num_threads=2,
        max_num_frames_per_episode=200,
        noop_max=0,
        autoreset_mode=autoreset_mode,
    )


def envpool_pong(num_envs=4, batch_size=2, seed=0):
    """EnvPool's Pong pool (84x84 grayscale, 4 stacked frames, no-op starts), episodes cut
    at 20 steps; its sub-env ``j`` is seeded with ``seed + j`` when it is built."""
    import envpool

    return envpool.make(
        "Pong-v5",
        env_type="gymnasium",
        num_envs=num_envs,
        batch_size=batch_size,
        num_threads=2,
        max_episode_steps=20,
        seed=seed,
    )


class StepCountingVector(CountingVectorEnv):
    """A CountingVectorEnv of StepCounters: StepCounter.steps counts its sub-envs' steps."""

    def __init__(self, first, num_envs, batch_size, **kwargs):
        super().__init__(first, num_envs, batch_size, **kwargs)
        self.envs = [StepCounter(first + j) for j in range(num_envs)]


class CrashOnce(CountingEnv):
    """A CountingEnv that raises once per ``marker`` file, in the step ``at`` =
    (episode, step) of its own count, or in the reset that starts episode ``at[0]``.

    The marker (created atomically) makes it crash once in all, however many times the
    env is rebuilt, in whichever process.
    """

    def __init__(self, env_id, marker, at=(0, 3), in_reset=False):
        super().__init__(env_id)
        self.marker = marker
        self.at = at
        self.in_reset = in_reset

    def _crash(self, where):
        import os

        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        raise RuntimeError(f"CrashOnce {self.env_id} crashed on purpose in {where}")

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed, options=options)
        if self.in_reset and self.episode == self.at[0]:
            self._crash("reset")
        return obs, info

    def step(self, action):
        if not self.in_reset and (self.episode, self.t) == self.at:
            self._crash("step")
        return super().step(action)


class CrashWhen(CountingEnv):
    """A CountingEnv that raises in its next step once the file ``trigger`` exists
    (the test renames a file there: a rename opens no descriptor)."""

    def __init__(self, env_id, trigger):
        super().__init__(env_id)
        self.trigger = trigger

    def step(self, action):
        import os

        if os.path.exists(self.trigger):
            raise RuntimeError(f"CrashWhen {self.env_id} crashed on purpose")
        return super().step(action)


# Released by tests that run HangOnce in worker threads, so that no thread stays blocked.
RELEASE_HANGS = __import__("threading").Event()


class HangOnce(CountingEnv):
    """A CountingEnv that blocks once per ``marker`` file, in the step ``at`` = (episode,
    step) of its own count, or in the reset that starts episode ``at[0]``: an env stuck
    in a call that never returns (for five minutes, or until RELEASE_HANGS is set)."""

    def __init__(self, env_id, marker, at=(0, 3), in_reset=False):
        super().__init__(env_id)
        self.marker = marker
        self.at = at
        self.in_reset = in_reset

    def _hang_here(self):
        import os

        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        RELEASE_HANGS.wait(300)

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed, options=options)
        if self.in_reset and self.episode == self.at[0]:
            self._hang_here()
        return obs, info

    def step(self, action):
        if not self.in_reset and (self.episode, self.t) == self.at:
            self._hang_here()
        return super().step(action)


def HangingFactory(marker):
    """An env factory that blocks the first time it is called (per ``marker`` file),
    until RELEASE_HANGS is set or five minutes pass."""
    import os

    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return CountingEnv(0)
    RELEASE_HANGS.wait(300)
    return CountingEnv(0)


def with_info(env_id):
    return CountingEnv(env_id, with_info=True)


def info_vector(first, n, autoreset_mode="SameStep"):
    """CountingEnvs with info in a gymnasium SyncVectorEnv (info as arrays and masks)."""
    import functools

    return gym.vector.SyncVectorEnv(
        [functools.partial(CountingEnv, first + j, with_info=True) for j in range(n)],
        autoreset_mode=autoreset_mode,
    )


class InfoDropsLives(CountingEnv):
    """Returns info without 'lives' from its fourth step on."""

    def __init__(self, env_id):
        super().__init__(env_id, with_info=True)

    def step(self, action):
        obs, reward, term, trunc, info = super().step(action)
        if self.t >= 4:
            del info["lives"]
        return obs, reward, term, trunc, info


class InfoLivesTurnString(CountingEnv):
    """Returns info['lives'] as a string from its fourth step on."""

    def __init__(self, env_id):
        super().__init__(env_id, with_info=True)

    def step(self, action):
        obs, reward, term, trunc, info = super().step(action)
        if self.t >= 4:
            info["lives"] = "three"
        return obs, reward, term, trunc, info


def exit_marking(directory, env_id):
    """A CountingEnv whose process, at its exit, writes a file named after its pid into
    ``directory`` (an exit handler, as an env with something to clean up registers)."""
    import atexit
    import os

    atexit.register(lambda: open(os.path.join(directory, str(os.getpid())), "w").close())
    return CountingEnv(env_id)


def _stop_on_arrival(marker, env_id, driver_pid):
    """Unpickling a StopsOnArrival: in a worker process, stop it (once per ``marker``)."""
    import os
    import signal

    if os.getpid() != driver_pid:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            os.kill(os.getpid(), signal.SIGSTOP)
    return StopsOnArrival(marker, env_id, driver_pid)


class StopsOnArrival:
    """An env factory (a CountingEnv) that stops its worker process with SIGSTOP as the
    worker unpickles its program: before the worker has written anything or sent its
    first request, as a debugger attached at start would. Once per ``marker`` file."""

    def __init__(self, marker, env_id, driver_pid):
        self.marker, self.env_id, self.driver_pid = marker, env_id, driver_pid

    def __call__(self):
        return CountingEnv(self.env_id)

    def __reduce__(self):
        return (_stop_on_arrival, (self.marker, self.env_id, self.driver_pid))


class ForksAHelper(CountingEnv):
    """A CountingEnv that starts a helper process, as many simulators do, which inherits
    every inheritable descriptor of its worker (its pipes among them) and would run for
    five minutes; the helper's pid goes to ``directory/helper-<env_id>-<worker pid>``."""

    def __init__(self, env_id, directory):
        import os
        import subprocess

        super().__init__(env_id)
        helper = subprocess.Popen(
            ["sleep", "300"],
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        path = os.path.join(directory, f"helper-{env_id}-{os.getpid()}")
        with open(path + ".part", "w") as f:
            f.write(str(helper.pid))
        os.rename(path + ".part", path)  # whole when it appears


class LoggedVector(CountingVectorEnv):
    """A CountingVectorEnv (a ``VectorEnv`` class: a declared vector env) that appends
    the id of the process building it to the file ``log``, one line per construction."""

    def __init__(self, log, first, n, batch, **kwargs):
        import os

        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        super().__init__(first, n, batch, **kwargs)


class VectorRaising(CountingVectorEnv):
    """A declared vector env whose constructor raises."""

    def __init__(self, first, n, batch):
        raise RuntimeError("no vector env today")


class VectorDying(CountingVectorEnv):
    """A declared vector env whose constructor kills its process (as a crash would)."""

    def __init__(self, first, n, batch):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


class VectorHanging(CountingVectorEnv):
    """A declared vector env whose constructor writes its process id to ``marker`` and
    blocks (five minutes, or until RELEASE_HANGS is set)."""

    def __init__(self, marker, first, n, batch):
        import os

        with open(marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(marker + ".tmp", marker)
        RELEASE_HANGS.wait(300)
        super().__init__(first, n, batch)


def plain_declared_vector(log) -> gym.vector.VectorEnv:
    """Says it builds a vector env, builds a plain one (logged as LoggedVector does)."""
    import os

    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    return CountingEnv(0)


def logged_info_vector(log, first, n) -> gym.vector.SyncVectorEnv:
    """``info_vector`` (declared: annotated), logged as LoggedVector does."""
    import os

    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    return info_vector(first, n)
