"""Ray is optional: rlcollect works without it, and rlcollect.distributed says what is missing.

Each case runs in a fresh interpreter: what a process has imported is process-wide.
"""

import subprocess
import sys


def test_importing_rlcollect_does_not_import_ray():
    code = (
        "import sys, rlcollect; from rlcollect import AsyncBatchedCollector, ReplayBuffer; "
        "assert 'ray' not in sys.modules, 'import rlcollect imported ray'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_without_ray_the_import_error_says_what_to_install():
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "try:\n    import rlcollect.distributed\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert "pip install rlcollect[ray]" in out.stdout, out.stdout + out.stderr
