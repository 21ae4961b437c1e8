"""The worker loop for vector envs: sub-envs become collector envs.

A worker holds one or more vector envs of ``n`` sub-envs each; sub-env ``j`` of its
``g``-th vector env is the worker's env ``g * n + j``, collector env
``env_offset + g * n + j``. Each vector env is a group with a request of its own
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
until their actions arrive, and each numpy call there costs microseconds on a host
whose cores all step sub-envs.

Why staging: a result names an arbitrary subset of sub-envs, so the columns of a
request do not line up with per-env chunk columns (see ``transports/layout.py``). The
server reads each observation from, and writes each action into, a cell of that env's
own, which routes every action to the env whose observation chose it. Two cells per
env, used in turn, let the request go out before the finished transitions are copied
out of the other cell: from a result to its actions, the worker copies each
observation once. A chunk's rows are filled in the order transitions finish; a
sub-env's transitions finish in its own step order, so a chunk (and every batch)
holds each env's stream in order, without gaps. The price is one more copy of each
observation (staging cell → chunk) than the in-place loop makes.

Autoreset, by the vector env's mode:

``NextStep``
    The result that ends an episode carries its true final observation; the sub-env's
    next step only resets it (its action is ignored, its reward is 0). That step is
    never a transition: the sub-env takes part in the request (its action is
    discarded), and its next result starts the new episode.
``SameStep``
    The result that ends an episode carries the reset observation; the final one is in
    ``info["final_obs"]`` and becomes the last transition's ``next.observation``.
``Disabled`` (stepped whole only)
    The worker resets finished sub-envs itself, with ``reset(options={"reset_mask":
    ...})``, before their next request.

Each transition also carries its episode's running return and length and the
``info_keys`` entries (``infos.py``: masks, and ``final_info`` under ``SameStep``).

On-policy (``spec.on_policy``, ``collector/batches/rounds.py``), allowed for vector envs
stepped whole with ``SameStep`` or ``Disabled`` autoreset (every step then finishes one
transition of every sub-env, so a round of ``chunk_steps`` steps fills the one slot
with ``chunk_steps`` transitions of each): the result that finishes a vector env's
last step of a round stages the next observations but holds their request back; once
the last vector env's transitions fill the slot, the worker hands it over and waits
for the consumer's go-ahead (``_Rows.written``), and only then sends the held requests,
in group order. The first requests also wait for the first round's go-ahead.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode

from rlcollect.errors import EnvError
from rlcollect.transports.base import WorkerEnd
from rlcollect.transports.layout import PROGRESS, STAGED, Key
from rlcollect.worker.infos import NUMERIC_KINDS, vector_entry
from rlcollect.worker.progress import Progress, Stage
from rlcollect.worker.spec import IS_INIT, Path, WorkerSpec, info_key, observation_key

__all__ = ["vector_loop"]

_Result = tuple[np.ndarray, Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]


class _Rows:
    """Hands out the chunk's rows in order; hands a full slot over, takes the next: the
    one the transport gives back, where it names it (a slot lent to the caller as a
    batch comes back whenever the caller lets go of it: ``collector/batches/loans.py``), else
    the next in turn."""

    def __init__(self, end: WorkerEnd, rows_per_slot: int, slots: int) -> None:
        self._end = end
        self._per_slot = rows_per_slot
        self._slots = slots
        self._slot = 0
        self._filled = 0  # rows of the slot written

    def begin(self) -> None:
        """Wait for the first slot to write."""
        given = self._end.wait_slot()
        self._slot = 0 if given is None else given

    def take(self, wanted: int) -> tuple[int, int]:
        """Start and length of the next run of free rows (at most ``wanted``)."""
        start = self._slot * self._per_slot + self._filled
        return start, min(wanted, self._per_slot - self._filled)

    def written(self, count: int) -> None:
        """``count`` rows from the start :meth:`take` gave are written."""
        self._filled += count
        if self._filled == self._per_slot:
            self._end.hand_over(self._slot)
            self._filled = 0
            given = self._end.wait_slot()
            self._slot = (self._slot + 1) % self._slots if given is None else given


class _VectorEnvDriver:
    """One vector env of the worker: how to act on it, and what its results mean."""

    def __init__(self, env: Any, spec: WorkerSpec, group: int, progress: Progress) -> None:
        source = spec.source
        self.env = env
        self.progress = progress
        self.n = source.sub_envs
        self.first = spec.env_offset + group * self.n  # collector index of sub-env 0
        self.base = group * self.n  # worker column of sub-env 0
        self.asynchronous = source.asynchronous
        self.batch = source.batch_size
        self.mode = source.autoreset
        self.paths = spec.observation_paths
        self.seed = None if spec.seed is None else spec.seed + self.first

    def _fail(self, during: str) -> EnvError:
        last = self.first + self.n - 1
        return EnvError(self.first, f"{during} of the vector env of envs {self.first}-{last}")

    def reset(self) -> _Result:
        try:
            self.progress.enter(Stage.RESET, self.first)
            obs, info = self.env.reset(seed=self.seed)
            self.progress.leave()
        except Exception as exc:
            raise self._fail("reset") from exc
        rows = len(_leaf(obs, self.paths[0]))
        zeros = np.zeros(rows, dtype=bool)
        return self._ids(info, rows), obs, np.zeros(rows, np.float32), zeros, zeros, info

    def act(self, actions: np.ndarray) -> _Result:
        if self.asynchronous:
            self.send(actions)
            return self.recv()
        try:
            self.progress.enter(Stage.STEP, self.first)
            obs, reward, term, trunc, info = self.env.step(actions)
            self.progress.leave()
        except Exception as exc:
            raise self._fail("step") from exc
        return self._result(obs, reward, term, trunc, info)

    def send(self, actions: np.ndarray) -> None:
        """Driven asynchronously: hand the sub-envs of the last result their actions."""
        try:
            self.progress.enter(Stage.STEP, self.first)
            self.env.send(actions)
            self.progress.leave()
        except Exception as exc:
            raise self._fail("step") from exc

    def recv(self) -> _Result:
        """Driven asynchronously: the next ``batch_size`` sub-envs to finish their step."""
        try:
            self.progress.enter(Stage.STEP, self.first)
            obs, reward, term, trunc, info = self.env.recv()
            self.progress.leave()
        except Exception as exc:
            raise self._fail("step") from exc
        return self._result(obs, reward, term, trunc, info)

    def _result(
        self, obs: Any, reward: Any, term: Any, trunc: Any, info: dict[str, Any]
    ) -> _Result:
        rows = len(reward)
        return (
            self._ids(info, rows),
            obs,
            np.asarray(reward),
            np.asarray(term, dtype=bool),
            np.asarray(trunc, dtype=bool),
            info,
        )

    def reset_some(self, sub_envs: np.ndarray) -> tuple[np.ndarray, Any]:
        """``Disabled`` mode: reset ``sub_envs``. Returns the sub-env of each row of the
        reset's observations (every sub-env's, reset or not), and the observations."""
        mask = np.zeros(self.n, dtype=bool)
        mask[sub_envs] = True
        try:
            self.progress.enter(Stage.RESET, self.first)
            new, info = self.env.reset(options={"reset_mask": mask})
            self.progress.leave()
        except Exception as exc:
            raise self._fail("reset") from exc
        return self._ids(info, len(_leaf(new, self.paths[0]))), new

    def _ids(self, info: dict[str, Any], rows: int) -> np.ndarray:
        """Sub-env of each result row: ``info["env_id"]``, or ``0 … n-1`` when stepped whole
        without it. Checked: a wrong id would route actions to the wrong env."""
        ids = info.get("env_id") if isinstance(info, dict) else None
        if ids is None:
            if self.asynchronous:
                raise self._fail("the result check") from KeyError(
                    "a vector env driven with send/recv must name the sub-env of each result "
                    "row in info['env_id']"
                )
            if rows != self.n:
                raise self._fail("the result check") from ValueError(
                    f"a step returned {rows} rows for {self.n} sub-envs"
                )
            return np.arange(self.n, dtype=np.int64)
        out = np.asarray(ids, dtype=np.int64).reshape(-1)
        if (
            len(out) != rows
            or len(out) != self.batch
            or (out.size and (out.min() < 0 or out.max() >= self.n))
        ):
            raise self._fail("the result check") from ValueError(
                f"info['env_id'] = {out.tolist()} does not name {rows} sub-envs of {self.n}"
            )
        return out


def _leaf(obs: Any, path: Path) -> Any:
    for name in path:
        obs = obs[name]
    return obs


def vector_loop(end: WorkerEnd, spec: WorkerSpec, envs: list[Any], progress: Progress) -> None:
    """Run the vector-env loop until the transport closes; ``progress`` marks each call
    into a vector env (``collector/batches/stall.py``)."""
    # Raised only where its own env's sub-envs step while it works (send/recv): stepped
    # whole, they wait for it, and a raised thread would only outrank other programs.
    raise_priority = end.answers_in_request and spec.source.asynchronous
    _schedule_as_the_envs_driver(raise_priority=raise_priority)
    _VectorLoop(end, spec, envs, progress).run()


# The niceness the thread driving a vector env through send/recv asks for when it also
# runs the policy: weight 9548 against its env threads' 1024 (nice 0). See
# _schedule_as_the_envs_driver.
DRIVER_NICE = -10


def _schedule_as_the_envs_driver(*, raise_priority: bool) -> None:
    """Put this thread back on the normal scheduling policy if it runs as ``SCHED_BATCH``,
    and, where it runs the policy itself beside an env driven with send/recv
    (``raise_priority``), ask for ``DRIVER_NICE``.

    Worker processes run as ``SCHED_BATCH`` (``transports/process_slots.py``: a woken
    worker does not preempt the driver), and a vector env's threads, started after,
    inherit it. This thread is what keeps those threads fed: when its actions arrive
    with every core stepping sub-envs, as a batch task it would wait for one of them to
    yield before it could ``send``, and the sub-envs whose actions it holds would idle
    meanwhile. On the normal policy it preempts them on waking; they stay batch tasks.

    That is not enough where the policy runs in this worker (``inference_backend=
    "worker"``): the thread then also runs each forward and writes every transition,
    and is busy about three quarters of the time, as much as an env thread. The fair
    scheduler then no longer counts it owed time when its result is ready, and on the
    H200 (64 sub-envs on 16 threads) it waited 140-170 us per ``recv`` for a core, where
    a hand-written loop's thread, asleep most of the time, waited 3-6 us. At nice -5 that
    wait fell to 31-70 us and the collector went from 0.82-0.87x to 0.89-0.96x the hand
    loop's throughput; at nice -10 to 5 us, and 0.96-1.00x (``docs/tuning.md``). Served
    by a server, the thread does little besides ``send`` and ``recv``, and raising it
    showed no gain. Only this thread is raised: the env's threads keep their niceness,
    so they still share the cores fairly with other programs, and this one takes no
    more than its own work (it sleeps in ``recv``).

    Lowering a niceness needs ``CAP_SYS_NICE``, or an ``RLIMIT_NICE`` of ``20 - nice``
    or more. Where ``DRIVER_NICE`` is refused, the thread takes the lowest niceness its
    ``RLIMIT_NICE`` allows, if that is below its own; otherwise it keeps its own, which
    works, only slower.
    """
    get, set_ = getattr(os, "sched_getscheduler", None), getattr(os, "sched_setscheduler", None)
    batch = getattr(os, "SCHED_BATCH", None)
    if get is None or set_ is None or batch is None:
        return  # not Linux: nothing was changed
    try:
        if get(0) != batch:
            return  # not a worker process (worker threads share the driver's policy)
        set_(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        return  # refused (some sandboxes): the batch policy works, only slower
    if raise_priority:
        _lower_niceness(DRIVER_NICE)


def _lower_niceness(wanted: int) -> None:
    """Set this thread's niceness (on Linux a thread's own: not the env's threads) to
    ``wanted``, or, where that is refused, to the lowest ``RLIMIT_NICE`` allows; never
    higher than the thread's own."""
    import resource  # here: only Linux comes this far, and Windows has no such module

    me = threading.get_native_id()
    own = os.getpriority(os.PRIO_PROCESS, me)
    if own <= wanted:
        return  # started lower already (a user's `nice -n -15`): never raised the other way
    try:
        os.setpriority(os.PRIO_PROCESS, me, wanted)
        return
    except OSError:
        pass  # neither CAP_SYS_NICE nor an RLIMIT_NICE of 20 - wanted
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    lowest = 20 - soft  # what the limit allows; RLIM_INFINITY would have allowed wanted
    if wanted < lowest < own:
        try:
            os.setpriority(os.PRIO_PROCESS, me, lowest)
        except OSError:
            pass  # refused after all (a security module): the thread keeps its own


class _VectorLoop:
    """The loop's state: the worker's views of the ring and each env's bookkeeping."""

    def __init__(
        self, end: WorkerEnd, spec: WorkerSpec, envs: list[Any], progress: Progress
    ) -> None:
        self.end = end
        self.drivers = [_VectorEnvDriver(env, spec, g, progress) for g, env in enumerate(envs)]
        k = spec.num_envs
        self.k = k
        buf = end.buffers
        positions = spec.chunk_steps * spec.slots
        # Every transition field seen as [positions * k, *shape]: rows in chunk order.
        self.chunk = {
            key: a.reshape(positions * k, *a.shape[2:])
            for key, a in buf.items()
            if key[0] != STAGED and key != PROGRESS
        }
        self.staged = {key[1:]: a for key, a in buf.items() if key[0] == STAGED}
        self.request_index = self.staged.pop(("rows",))
        # Only with a recurrent policy: set with each staged observation that starts an
        # episode, read by the server (to reset the env's state) and copied into the chunk.
        self.is_init = self.staged.get(IS_INIT.key)
        self.paths = spec.observation_paths
        self.obs_keys = [observation_key(p) for p in self.paths]
        self.next_keys = [observation_key(p, nxt=True) for p in self.paths]
        self.copied: list[Key] = list(self.staged)  # the observations and the outputs
        self.rows = _Rows(end, spec.chunk_steps * k, spec.slots)
        self.episode = np.zeros(k, np.int64)
        self.step = np.zeros(k, np.int64)
        self.pending = np.zeros(k, bool)  # a transition is under way (obs staged, action sent)
        self.ended = np.zeros(k, bool)  # NextStep: the next result only resets the env
        self.in_flight = np.zeros(k, bool)  # asked to step or reset, result not yet back
        self.cell = np.arange(k)  # each env's staging cell in use: env e's are e and e + k
        self.offset = spec.env_offset
        self.returns = np.zeros(k, np.float64)  # each env's episode rewards so far
        self.info_names = spec.info_keys
        # On-policy: steps each vector env has finished in this round, and the groups
        # whose request for the next round waits for the go-ahead.
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
        self.rows.begin()
        if self.on_policy:
            self.end.wait_slot()  # the first round's go-ahead
        for g, driver in enumerate(self.drivers):
            self.in_flight[driver.base : driver.base + driver.n] = True
            self.receive(g, driver.reset())
        while True:
            for g, driver in enumerate(self.drivers):
                if self.sent[g]:
                    self.sent[g] = False
                    self.receive(g, driver.recv())
                    continue
                self.end.wait_response()
                cells = self.request_index[g]
                self.in_flight[cells % self.k] = True  # its sub-envs are under way from here
                self.receive(g, driver.act(self._actions(cells)))

    def _actions(self, cells: np.ndarray) -> np.ndarray:
        """The answered actions of the request of ``cells``, in its result's order."""
        actions: np.ndarray = self.staged[("action",)][cells]  # a copy
        return actions

    def receive(self, g: int, result: _Result) -> None:
        driver = self.drivers[g]
        ids, obs, reward, term, trunc, info = result
        cols = driver.base + ids
        leaves = [self._checked(driver, _leaf(obs, path), key, len(ids))
                  for path, key in zip(self.paths, self.obs_keys, strict=True)]  # fmt: skip
        if self.early[g]:
            self._receive_early(g, driver, cols, leaves, reward, term, trunc, info)
            return
        self._returned(driver, cols, ids)
        done = term | trunc
        finishing = np.flatnonzero(self.pending[cols])
        staged = leaves
        fin_done = cols[finishing[done[finishing]]]
        if fin_done.size and driver.mode is AutoresetMode.DISABLED:
            # Kept: the reset may write into the arrays the step returned (SyncVectorEnv
            # with copy=False does), and these hold the final observations.
            leaves = [leaf.copy() for leaf in leaves]
            staged = self._reset_finished(driver, fin_done, cols, leaves)
        # Stage into each env's other cell and send the request, then finish the
        # transitions from the cells of the step before while the server works.
        old_cells, new_cells = self._stage(g, driver, cols, staged, done)
        round_ends = False
        if self.on_policy and finishing.size:
            self.stepped[g] += 1
            round_ends = self.stepped[g] == self.round_steps
        if round_ends:
            self.stepped[g] = 0
            self.held.append(g)  # the next round's request waits for the go-ahead
        else:
            self.end.request(g)
        cells = (old_cells, new_cells)
        self.finish(driver, cols, cells, finishing, (leaves, finishing), reward, term, trunc, info)

    def _receive_early(
        self,
        g: int,
        driver: _VectorEnvDriver,
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
        and the worker's every numpy call there, tens of microseconds on a loaded host,
        is on that path; the result's checks and the finish come after the send."""
        old_cells, new_cells = self._stage(g, driver, cols, leaves, None)
        self.end.request(g)
        # From the send on, the env's threads step the sub-envs and may reuse the arrays
        # of its last result: what finish reads is taken from this worker's own memory
        # (the next observations from the cells just staged; NextStep needs nothing else).
        reward, term, trunc = reward.copy(), term.copy(), trunc.copy()
        driver.send(self._actions(new_cells))
        self.sent[g] = True
        # Only now the check that every returned sub-env had a step under way, once each
        # (a sub-env named twice was staged and sent twice: the worker fails either way).
        self._returned(driver, cols, cols - driver.base)
        self.in_flight[cols] = True  # under way again since the send
        finishing = np.flatnonzero(self.pending[cols])
        next_obs = ([self.staged[key] for key in self.obs_keys], new_cells[finishing])
        cells = (old_cells, new_cells)
        self.finish(driver, cols, cells, finishing, next_obs, reward, term, trunc, info)

    def _returned(self, driver: _VectorEnvDriver, cols: np.ndarray, ids: np.ndarray) -> None:
        """Check that every sub-env of a result had a step under way, and that none is
        named twice; they are not under way any more."""
        mine = self.in_flight[driver.base : driver.base + driver.n]
        under_way = int(np.count_nonzero(mine))
        self.in_flight[cols] = False
        if under_way - int(np.count_nonzero(mine)) != len(cols):
            raise driver._fail("the result check") from ValueError(
                f"results for sub-envs {ids.tolist()}, but not all of them had an action or "
                "a reset under way, or one is named twice"
            )

    def _stage(
        self,
        g: int,
        driver: _VectorEnvDriver,
        cols: np.ndarray,
        leaves: list[np.ndarray],
        done: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Copy each observation of ``cols`` into its env's other staging cell and name
        the cells in request ``g``'s index; returns the cells of the step before and the
        new ones. ``done``: the result's episode ends (``None`` under ``NextStep``,
        whose ends never mark an observation as an episode's first)."""
        old_cells = self.cell[cols]
        new_cells = (old_cells + self.k) % (2 * self.k)
        for key, leaf in zip(self.obs_keys, leaves, strict=True):
            self.staged[key][new_cells] = leaf
        if self.is_init is not None:
            self.is_init[new_cells] = self._starts(driver, cols, done)
        self.request_index[g] = new_cells
        return old_cells, new_cells

    def _advance(
        self,
        driver: _VectorEnvDriver,
        cols: np.ndarray,
        new_cells: np.ndarray,
        fin_cols: np.ndarray,
        fin_done: np.ndarray,
    ) -> None:
        """Bookkeeping for the observations just staged: ``fin_cols`` finished a
        transition, ``fin_done`` an episode."""
        self.cell[cols] = new_cells
        self.step[fin_cols] += 1
        starting = cols[~self.pending[cols]]  # reset results: a new episode starts
        renewed = starting[self.ended[starting]]
        self.episode[renewed] += 1
        self.step[renewed] = 0
        self.ended[renewed] = False
        self.pending[cols] = True
        if fin_done.size:
            if driver.mode is AutoresetMode.NEXT_STEP:
                self.ended[fin_done] = True
                self.pending[fin_done] = False  # the next result is only the reset
            else:
                self.episode[fin_done] += 1
                self.step[fin_done] = 0

    def _starts(
        self, driver: _VectorEnvDriver, cols: np.ndarray, done: np.ndarray | None
    ) -> np.ndarray:
        """Which of the observations just returned for ``cols`` start an episode (step
        0), by the bookkeeping below: a reset result (no transition under way), or, where
        the result carries the reset observation itself (``SameStep``, ``Disabled``),
        one that ended an episode. A ``NextStep`` final observation is never a
        transition's: its env's next observation, the reset one, starts the episode."""
        starts: np.ndarray = ~self.pending[cols]
        if driver.mode is not AutoresetMode.NEXT_STEP:
            assert done is not None  # only NextStep stages without its result's ends
            starts |= done
        return starts

    def _reset_finished(
        self, driver: _VectorEnvDriver, finished: np.ndarray, cols: np.ndarray, leaves: list[Any]
    ) -> list[np.ndarray]:
        """``Disabled`` mode: reset ``finished``; returns ``leaves`` with their rows replaced
        by the new episodes' observations (``leaves`` keeps the final ones)."""
        ids, new = driver.reset_some(finished - driver.base)
        row_of = np.empty(self.k, np.intp)
        row_of[cols] = np.arange(len(cols))
        reset_rows = np.flatnonzero(np.isin(driver.base + ids, finished))
        out = []
        for i, path in enumerate(self.paths):
            fresh = self._checked(driver, _leaf(new, path), self.obs_keys[i], len(ids))
            leaf = leaves[i].copy()  # leaves[i] keeps the final observations
            leaf[row_of[driver.base + ids[reset_rows]]] = fresh[reset_rows]
            out.append(leaf)
        return out

    def _checked(self, driver: _VectorEnvDriver, leaf: Any, key: Key, rows: int) -> np.ndarray:
        arr = np.asarray(leaf)
        want = self.staged[key].shape[1:]
        if arr.shape != (rows, *want):
            raise driver._fail("the observation check") from ValueError(
                f"{'/'.join(key)} of shape {arr.shape} for {rows} sub-envs; the observation "
                f"space says {want} per sub-env"
            )
        if arr.dtype != self.staged[key].dtype:
            try:
                arr = arr.astype(self.staged[key].dtype, casting="same_kind")
            except TypeError as exc:
                raise driver._fail("the observation check") from exc
        return arr

    def finish(
        self,
        driver: _VectorEnvDriver,
        result_cols: np.ndarray,
        result_cells: tuple[np.ndarray, np.ndarray],
        rows_in_result: np.ndarray,
        next_obs: tuple[list[np.ndarray], np.ndarray],
        reward: np.ndarray,
        term: np.ndarray,
        trunc: np.ndarray,
        info: dict[str, Any],
    ) -> None:
        """What follows a result's request. Write the transitions that its rows
        ``rows_in_result`` finish: their envs' observations are in the cells
        ``result_cells[0]`` of the step before, their rewards and flags in those rows of
        the result, their next observations in rows ``next_obs[1]`` of the arrays
        ``next_obs[0]`` (the result's leaves, or the cells they were just staged in).
        Then send the held on-policy requests once every vector env's are held, and do
        the bookkeeping of :meth:`_advance` (``result_cells[1]``: the cells just staged)."""
        old_cells, new_cells = result_cells
        cols = result_cols[rows_in_result]
        cells = old_cells[rows_in_result]
        leaves, next_rows = next_obs
        chunk, staged = self.chunk, self.staged
        done_at = np.flatnonzero(term[rows_in_result] | trunc[rows_in_result])
        final_obs = info.get("final_obs") if driver.mode is AutoresetMode.SAME_STEP else None
        if driver.mode is AutoresetMode.SAME_STEP and done_at.size and final_obs is None:
            raise driver._fail("the result check") from KeyError(
                "a SameStep vector env ended an episode without info['final_obs']"
            )
        taken = 0
        while taken < len(cols):
            start, count = self.rows.take(len(cols) - taken)
            dst = slice(start, start + count)
            c = cols[taken : taken + count]
            r = rows_in_result[taken : taken + count]
            # mode="clip": the indices are valid, and the default ("raise") copies twice.
            for key in self.copied:
                np.take(
                    staged[key],
                    cells[taken : taken + count],
                    axis=0,
                    out=chunk[key][dst],
                    mode="clip",
                )
            n = next_rows[taken : taken + count]
            for key, leaf in zip(self.next_keys, leaves, strict=True):
                np.take(leaf, n, axis=0, out=chunk[key][dst], mode="clip")
            chunk[("env_index",)][dst] = self.offset + c
            chunk[("episode",)][dst] = self.episode[c]
            chunk[("step",)][dst] = self.step[c]
            chunk[("next", "reward")][dst] = reward[r]
            chunk[("next", "terminated")][dst] = term[r]
            chunk[("next", "truncated")][dst] = trunc[r]
            self.returns[c] += reward[r]
            chunk[("next", "episode_return")][dst] = self.returns[c]
            chunk[("next", "episode_length")][dst] = self.step[c] + 1
            self.returns[c[term[r] | trunc[r]]] = 0.0
            if self.info_names:
                self._write_infos(driver, dst, c, r, term[r] | trunc[r], info)
            if final_obs is not None:
                local = done_at[(done_at >= taken) & (done_at < taken + count)]
                for i in local:
                    self._write_final(driver, start + i - taken, final_obs[r[i - taken]])
            taken += count
            self.rows.written(count)
        if len(self.held) == len(self.drivers):
            # The slot was full, handed over, and the go-ahead taken (_Rows.written).
            for held in self.held:
                self.end.request(held)
            self.held.clear()
        self._advance(driver, result_cols, new_cells, cols, cols[done_at])

    def _write_infos(
        self,
        driver: _VectorEnvDriver,
        dst: slice,
        cols: np.ndarray,
        rows: np.ndarray,
        done: np.ndarray,
        info: dict[str, Any],
    ) -> None:
        """Write the ``info_keys`` entries of result rows ``rows`` (envs ``cols``)."""
        final = None
        if driver.mode is AutoresetMode.SAME_STEP and done.any():
            final = info.get("final_info") if isinstance(info, dict) else None
        for name in self.info_names:
            value, mask = vector_entry(info, name)
            have = np.zeros(len(rows), bool)
            values: np.ndarray | None = None
            if value is not None:
                values = value[rows]
                have[:] = True if mask is None else mask[rows]
            if final is not None:
                # SameStep: a finished sub-env's row holds the reset's info; its last
                # step's own entry is in final_info.
                f_value, f_mask = vector_entry(final, name)
                have[done] = False
                if f_value is not None:
                    f_have = np.ones(len(rows), bool) if f_mask is None else f_mask[rows]
                    have[done] = f_have[done]
                    if values is None:
                        values = f_value[rows].copy()
                    else:
                        values = values.copy()
                        values[done] = f_value[rows][done]
            if values is None or not have.all():
                env = int(self.offset + cols[np.flatnonzero(~have)[0]])
                raise EnvError(env, "the info check") from KeyError(
                    f"env {env} (a sub-env of the vector env of envs {driver.first}-"
                    f"{driver.first + driver.n - 1}) returned an info without {name!r}, "
                    "which info_keys asks for"
                )
            out = self.chunk[info_key(name)][dst]
            if values.dtype.kind not in NUMERIC_KINDS or values.shape[1:] != out.shape[1:]:
                env = int(self.offset + cols[0])
                raise EnvError(env, "the info check") from TypeError(
                    f"env {env} returned info[{name!r}] of dtype {values.dtype} and shape "
                    f"{values.shape[1:]} per sub-env; info_keys carries numbers of the dtype "
                    f"and shape env 0 gave at its probe: {out.dtype}, {out.shape[1:]}"
                )
            try:
                np.copyto(out, values, casting="same_kind")
            except TypeError as exc:
                raise EnvError(int(self.offset + cols[0]), "the info check") from exc

    def _write_final(self, driver: _VectorEnvDriver, row: int, final: Any) -> None:
        for path, key in zip(self.paths, self.next_keys, strict=True):
            value = np.asarray(_leaf(final, path))
            dst = self.chunk[key][row, ...]
            if value.shape != dst.shape:
                raise driver._fail("the observation check") from ValueError(
                    f"info['final_obs'] holds a {'/'.join(key)} of shape {value.shape}; the "
                    f"observation space says {dst.shape}"
                )
            np.copyto(dst, value, casting="same_kind")
