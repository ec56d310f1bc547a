import os

import pytest

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the accelerator machine runs only tests/gpu and may lack hypothesis
    settings = None

if settings is not None:
    # Every run (CI and the README's command alike) explores the same few hundred stateful examples (250 a
    # machine): derandomized, so the suite's verdict depends on the code, never on which examples a run happened
    # to draw. New examples come from the search profile (LORAPUB_HYPOTHESIS_PROFILE=search, a fresh random
    # search each run; CONTRIBUTING.md); what it finds becomes a fix and a test. dev shortens the loop while editing.
    quiet = [HealthCheck.too_slow, HealthCheck.filter_too_much]
    settings.register_profile("ci", max_examples=250, stateful_step_count=60, deadline=None, derandomize=True,
                              database=None, suppress_health_check=quiet)
    settings.register_profile("search", max_examples=1000, stateful_step_count=60, deadline=None,
                              suppress_health_check=quiet)
    settings.register_profile("dev", max_examples=60, stateful_step_count=40, deadline=None)
    settings.load_profile(os.environ.get("LORAPUB_HYPOTHESIS_PROFILE", "ci"))

# Import torch once before any test: its cold import (seconds on a small machine) would
# otherwise land inside the first engine-side `end` and eat the short test deadlines.
try:
    import safetensors.torch  # noqa: F401
except ImportError:
    pass


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (--dist loadgroup, pyproject's addopts)
def pytest_collection_modifyitems(config, items):
    """Every test marked ``ray`` (it starts a local Ray cluster) goes to one xdist worker, which runs
    them one after another: two Ray clusters at once on CI's 2 cores would starve each other."""
    for item in items:
        if item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.xdist_group("ray"))
