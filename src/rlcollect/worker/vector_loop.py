"""The worker loop for vector envs: sub-envs become collector envs.

A worker holds one or more vector envs of ``n`` sub-envs each; sub-env ``j`` of its
``g``-th vector env is the worker's column ``g * n + j``, collector env
``env_offset + g * n + j``. Each vector env is a split with a request of its own
(double buffering: while one waits for its actions, the worker receives the next
results of another). One round visits the vector envs in order::

    wait     the response to vector env g's request: its sub-envs' actions are staged
    act      send the actions, in the order of the sub-envs of the last result:
             ``send`` + ``recv`` when driven asynchronously (``batch_size < num_envs``:
             ``recv`` returns the first ``batch_size`` sub-envs to finish, named by
             ``info["env_id"]``), ``step`` otherwise
    stage    each returned observation goes to a staging cell of its sub-env (the one
             its previous step did not use), the cells' numbers to the request index,
             and the request goes out
    finish   while the server works on that request, every returned sub-env that had a
             transition under way completes it: its observation, action, policy
             outputs and version (from the staging cell of its previous step), the
             returned observation as ``next.observation``, reward and flags are
             written together into the next free rows of the chunk

Where the worker answers its own requests (``inference_backend="worker"``: the end's
``answers_in_request``), the actions exist as soon as the request is made: a vector env
driven asynchronously with ``NextStep`` autoreset (and no ``info_keys``) is sent them
right there, before ``finish``, so its threads step those sub-envs while the worker
writes the transitions. ``finish`` then reads the next observations from the cells just
staged, not from the result's arrays, which the env may reuse once it steps again. On
that path only what the actions need runs before the send (the observations' check,
the staging, the request); the check that each returned sub-env had a step under way,
and the search for finished transitions, run after it: the sub-envs of a result idle
until their actions arrive, and where every core steps sub-envs, each numpy call on
that path is time they idle.

The modules beside this one hold each part: ``vector_env.py`` drives one vector env
and checks its results, ``vector_staging.py`` holds the staging cells and their
protocol with the server, ``vector_rows.py`` copies finished transitions into the
chunk and hands full slots over, ``vector_autoreset.py`` keeps each env's episodes
across the env's autoreset mode (and resets ``Disabled`` ones), ``infos.py`` writes
the ``info_keys`` entries, and ``vector_priority.py`` schedules the driving thread.

On-policy (``spec.on_policy``, ``collector/batches/rounds.py``), allowed for vector envs
stepped whole with ``SameStep`` or ``Disabled`` autoreset (every step then finishes one
transition of every sub-env, so a round of ``chunk_steps`` steps fills the one slot
with ``chunk_steps`` transitions of each): the result that finishes a vector env's
last step of a round stages the next observations but holds their request back; once
the last vector env's transitions fill the slot, the worker hands it over and waits
for the consumer's go-ahead (``Rows.written``, ``vector_rows.py``), and only then sends
the held requests, in vector env order. The first requests also wait for the first
round's go-ahead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode

from rlcollect.transports.base import WorkerEnd
from rlcollect.worker.progress import Progress
from rlcollect.worker.spec import WorkerSpec
from rlcollect.worker.vector_autoreset import Episodes, reset_finished
from rlcollect.worker.vector_env import Result, VectorEnvDriver, leaf
from rlcollect.worker.vector_priority import schedule_as_the_envs_driver
from rlcollect.worker.vector_rows import TransitionWriter
from rlcollect.worker.vector_staging import Staging

__all__ = ["vector_loop"]


def vector_loop(end: WorkerEnd, spec: WorkerSpec, envs: list[Any], progress: Progress) -> None:
    """Run the vector-env loop until the transport closes; ``progress`` marks each call
    into a vector env (``collector/batches/stall.py``)."""
    # Raised only where its own env's sub-envs step while it works (send/recv): stepped
    # whole, they wait for it, and a raised thread would only outrank other programs.
    raise_priority = end.answers_in_request and spec.source.asynchronous
    schedule_as_the_envs_driver(raise_priority=raise_priority)
    _VectorLoop(end, spec, envs, progress).run()


class _VectorLoop:
    """The loop's state: its vector envs, the staging, the chunk's writer, each env's
    episodes, which sub-envs are under way, and the on-policy rounds."""

    def __init__(
        self, end: WorkerEnd, spec: WorkerSpec, envs: list[Any], progress: Progress
    ) -> None:
        self.end = end
        self.drivers = [VectorEnvDriver(env, spec, g, progress) for g, env in enumerate(envs)]
        k = spec.num_envs
        self.paths = spec.observation_paths
        self.staging = Staging(end, spec)
        self.episodes = Episodes(k)
        self.writer = TransitionWriter(end, spec, self.staging.staged, self.episodes)
        self.in_flight = np.zeros(k, bool)  # asked to step or reset, result not yet back
        # On-policy: steps each vector env has finished in this round, and the vector
        # envs whose request for the next round waits for the go-ahead.
        self.on_policy = spec.on_policy
        self.round_steps = spec.chunk_steps
        self.stepped = [0] * len(self.drivers)
        self.held: list[int] = []
        # The worker's own policy answers a request as it is made: an asynchronous
        # NextStep vector env then gets its actions before the finished transitions are
        # written, which it steps meanwhile (as a hand-written send/recv loop would).
        send_early = end.answers_in_request and not spec.info_keys and not spec.on_policy
        self.early = [
            send_early and d.asynchronous and d.mode is AutoresetMode.NEXT_STEP
            for d in self.drivers
        ]
        self.sent = [False] * len(self.drivers)  # actions already sent; only recv is due

    def run(self) -> None:
        self.writer.rows.begin()
        if self.on_policy:
            self.end.wait_slot()  # the first round's go-ahead
        for g, driver in enumerate(self.drivers):
            self.in_flight[driver.base : driver.base + driver.n] = True
            self.receive(g, driver.reset())
        k = len(self.in_flight)
        while True:
            for g, driver in enumerate(self.drivers):
                if self.sent[g]:
                    self.sent[g] = False
                    self.receive(g, driver.recv())
                    continue
                self.end.wait_response()
                cells = self.staging.request_index[g]
                self.in_flight[cells % k] = True  # its sub-envs are under way from here
                self.receive(g, driver.act(self.staging.actions(cells)))

    def receive(self, g: int, result: Result) -> None:
        """Stage a result's observations and make its request, then finish the
        transitions it completes (:meth:`finish`) while the server works."""
        driver = self.drivers[g]
        ids, obs, reward, term, trunc, info = result
        cols = driver.base + ids
        check = self.staging.checked
        leaves = [
            check(driver, leaf(obs, path), key, len(ids))
            for path, key in zip(self.paths, self.staging.obs_keys, strict=True)
        ]
        if self.early[g]:
            self._receive_early(g, driver, cols, leaves, reward, term, trunc, info)
            return
        self._returned(driver, cols, ids)
        done = term | trunc
        finishing = np.flatnonzero(self.episodes.pending[cols])
        staged = leaves
        fin_done = cols[finishing[done[finishing]]]
        if fin_done.size and driver.mode is AutoresetMode.DISABLED:
            # Kept: the reset may write into the arrays the step returned (SyncVectorEnv
            # with copy=False does), and these hold the final observations.
            leaves = [arr.copy() for arr in leaves]
            staged = reset_finished(driver, self.staging, fin_done, cols, leaves, self.paths)
        # Stage into each env's other cell and send the request, then finish the
        # transitions from the cells of the step before while the server works.
        old_cells, _ = self._stage(g, driver, cols, staged, done)
        round_ends = False
        if self.on_policy and finishing.size:
            self.stepped[g] += 1
            round_ends = self.stepped[g] == self.round_steps
        if round_ends:
            self.stepped[g] = 0
            self.held.append(g)  # the next round's request waits for the go-ahead
        else:
            self.end.request(g)
        self.finish(
            driver, cols, old_cells, finishing, (leaves, finishing), reward, term, trunc, info
        )

    def _receive_early(
        self,
        g: int,
        driver: VectorEnvDriver,
        cols: np.ndarray,
        leaves: list[np.ndarray],
        reward: np.ndarray,
        term: np.ndarray,
        trunc: np.ndarray,
        info: dict[str, Any],
    ) -> None:
        """:meth:`receive` where the request is answered as it is made, for a vector env
        driven asynchronously with ``NextStep`` autoreset: the actions go out before
        anything that can wait. Between a result and its actions its sub-envs idle,
        and so does every numpy call of the worker there; the result's checks and the
        finish come after the send."""
        old_cells, new_cells = self._stage(g, driver, cols, leaves, None)
        self.end.request(g)
        # From the send on, the env's threads step the sub-envs and may reuse the arrays
        # of its last result: what finish reads is taken from this worker's own memory
        # (the next observations from the cells just staged; NextStep needs nothing else).
        reward, term, trunc = reward.copy(), term.copy(), trunc.copy()
        driver.send(self.staging.actions(new_cells))
        self.sent[g] = True
        # Only now the check that every returned sub-env had a step under way, once each
        # (a sub-env named twice was staged and sent twice: the worker fails either way).
        self._returned(driver, cols, cols - driver.base)
        self.in_flight[cols] = True  # under way again since the send
        finishing = np.flatnonzero(self.episodes.pending[cols])
        staged = [self.staging.staged[key] for key in self.staging.obs_keys]
        next_obs = (staged, new_cells[finishing])
        self.finish(driver, cols, old_cells, finishing, next_obs, reward, term, trunc, info)

    def _returned(self, driver: VectorEnvDriver, cols: np.ndarray, ids: np.ndarray) -> None:
        """Check that every sub-env of a result had a step under way, and that none is
        named twice; they are not under way any more."""
        mine = self.in_flight[driver.base : driver.base + driver.n]
        under_way = int(np.count_nonzero(mine))
        self.in_flight[cols] = False
        if under_way - int(np.count_nonzero(mine)) != len(cols):
            raise driver.fail("the result check") from ValueError(
                f"results for sub-envs {ids.tolist()}, but not all of them had an action or "
                "a reset under way, or one is named twice"
            )

    def _stage(
        self,
        g: int,
        driver: VectorEnvDriver,
        cols: np.ndarray,
        leaves: list[np.ndarray],
        done: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Stage the observations of ``cols`` for request ``g`` (:meth:`Staging.stage`);
        ``done``: the result's episode ends (``None`` under ``NextStep``, whose ends
        never mark an observation as an episode's first)."""
        starts = None
        if self.staging.is_init is not None:
            starts = self.episodes.starts(driver.mode, cols, done)
        return self.staging.stage(g, cols, leaves, starts)

    def finish(
        self,
        driver: VectorEnvDriver,
        result_cols: np.ndarray,
        old_cells: np.ndarray,
        rows_in_result: np.ndarray,
        next_obs: tuple[list[np.ndarray], np.ndarray],
        reward: np.ndarray,
        term: np.ndarray,
        trunc: np.ndarray,
        info: dict[str, Any],
    ) -> None:
        """What follows a result's request (for the worker's columns ``result_cols``).
        Write the transitions that its rows ``rows_in_result`` finish
        (:meth:`TransitionWriter.write`; ``old_cells``: the staging cells of the step
        before, ``next_obs``: where their next observations are). Then send the held
        on-policy requests once every vector env's are held, and update the episodes'
        bookkeeping (:meth:`Episodes.advance`)."""
        cols = result_cols[rows_in_result]
        cells = old_cells[rows_in_result]
        done_at = self.writer.write(
            driver, cols, cells, rows_in_result, next_obs, reward, term, trunc, info
        )
        if len(self.held) == len(self.drivers):
            # The slot was full, handed over, and the go-ahead taken (Rows.written).
            for held in self.held:
                self.end.request(held)
            self.held.clear()
        self.episodes.advance(driver.mode, result_cols, cols, cols[done_at])
