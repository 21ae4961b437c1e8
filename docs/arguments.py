"""Write docs/arguments.md from the collector's options (rlcollect/collector/options.py).

Run after changing an option: ``python docs/arguments.py``;
tests/collector/test_options.py fails while the page and the options disagree.
"""

from pathlib import Path

from rlcollect.collector.options import arguments_table

HEADER = """# Arguments

Every keyword argument of `AsyncBatchedCollector`, its default and what it does, one line
each (generated from `rlcollect/collector/options.py` by `python docs/arguments.py`),
after the two positional ones: `env_fns`, the env factories, and `policy`. The
guide says how they work together ([usage.md](usage.md)); the class's docstring in the
[API reference](api/collector.md) says the same in more words. `RayCollector` takes the
same keywords and keeps `replay_buffer`, `train_ratio`, `learning_starts` and `seed` in
the driver ([distributed.md](distributed.md)).

"""


def page() -> str:
    """The whole page."""
    return HEADER + arguments_table()


if __name__ == "__main__":
    Path(__file__).with_name("arguments.md").write_text(page())
