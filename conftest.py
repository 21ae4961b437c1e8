"""Collection settings for the whole repository (tests/conftest.py holds the tests' own).

Ray is an optional extra (``rlcollect[ray]``): where it is not installed, the modules of
``rlcollect.distributed`` cannot be imported, so their doctests are not collected (the
tests of tests/distributed/ skip themselves).
"""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("ray") else ["src/rlcollect/distributed/*"]
