from tests.tasks.conftest import prefect_harness  # noqa: F401 - shared session fixture
