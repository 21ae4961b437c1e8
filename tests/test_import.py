"""What importing rlcollect costs: no torch._dynamo (about 1.4 s) unless something compiles.

tensordict marks a few of its functions for the compiler while it is imported, which
imports torch._dynamo; rlcollect imports it through ``rlcollect._tensordict``,
which defers those marks until torch._dynamo is imported. Each case runs in a
fresh interpreter: what a process has imported is process-wide.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def run_fresh(code: str) -> str:
    """Runs ``code`` in a fresh interpreter; returns what it printed (fails on an error)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,  # generous: the machine may be busy
        check=False,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_collecting_without_compile_imports_no_dynamo():
    out = run_fresh(
        """
        import functools
        import sys

        import rlcollect

        assert "torch" not in sys.modules, "import rlcollect imported torch"
        from rlcollect import AsyncBatchedCollector
        from rlcollect.testing import CountingEnv
        import torch

        class Policy(torch.nn.Module):
            def forward(self, obs):
                return {"action": obs[:, 2] % 5}

        envs = [functools.partial(CountingEnv, i) for i in range(2)]
        with AsyncBatchedCollector(
            envs,
            Policy(),
            frames_per_batch=8,
            total_frames=32,
            transport="thread",
            policy_device="cpu",
            compile=False,
        ) as collector:
            rows = sum(batch.batch_size[0] for batch in collector)
        assert rows == 32, rows
        print(sorted(name for name in sys.modules if name.startswith("torch._dynamo")))
        """
    )
    assert out.strip() == "[]", f"torch._dynamo was imported: {out}"


@pytest.mark.parametrize("dynamo_first", [False, True], ids=["dynamo_later", "dynamo_first"])
def test_compiling_sees_tensordict_as_after_a_plain_import(dynamo_first):
    # fullgraph: tensordict's vmap goes through functorch functions that dynamo traces
    # only where tensordict marked them allow_in_graph; without the deferred marks this
    # compile fails ("Attempted to call function marked as skipped"). The body indexes
    # the TensorDict before any arithmetic: tensordict 0.14 (what torchrl 0.14 in the dev
    # extra pins) has no vmap batching rule for the _foreach_mul of `td * 2` under
    # compile, with or without rlcollect; vmap over the TensorDict still goes through
    # the marked functions (checked: with the marks dropped, this compile fails).
    out = run_fresh(
        f"""
        import sys

        if {dynamo_first}:
            import torch._dynamo
        from rlcollect import AsyncBatchedCollector
        from tensordict import TensorDict
        import torch

        assert ("torch._dynamo" in sys.modules) == {dynamo_first}

        def double_a(td):
            return torch.vmap(lambda t: t["a"] * 2 + 1, (0,))(td)

        td = TensorDict({{"a": torch.arange(6.0).reshape(3, 2)}}, batch_size=[3])
        compiled = torch.compile(double_a, backend="eager", fullgraph=True)
        assert torch.equal(compiled(td), double_a(td))
        print([type(f).__name__ for f in sys.meta_path if "HandOver" in type(f).__name__])
        """
    )
    assert out.strip() == "[]", f"the import hook stayed in sys.meta_path: {out}"


def test_version_is_the_distributions():
    # Read from the installed metadata: one version, pyproject.toml's.
    out = run_fresh(
        """
        import sys
        from importlib.metadata import version

        import rlcollect

        assert "torch" not in sys.modules, "reading the version imported torch"
        print(rlcollect.__version__ == version("rlcollect"), rlcollect.__version__)
        """
    )
    assert out.split()[0] == "True", out
