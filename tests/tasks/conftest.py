import pytest


@pytest.fixture(scope="session")
def prefect_harness():
    """A real Prefect API (temporary server + database) for in-process flows."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
