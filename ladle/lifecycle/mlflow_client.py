"""The MLflow registry client ladle uses everywhere: one client with request deadlines, what "not found" looks
like, and one error for a registry that failed, saying what was being done."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ladle.errors import LadleError
from ladle.platform.secrets import redact_url, with_credentials


def client(uri: str):
    """MLflow's client, with ladle's request deadlines where neither a config nor the environment set them
    (``tracking.request_timeout_s``/``request_retries``: the CLI's ``ladle model`` commands have no config)."""
    import os

    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    return MlflowClient(with_credentials(uri))


def absent(exc: BaseException) -> bool:
    """MLflow's "not found" (a missing model, version or alias), as opposed to a registry that failed."""
    from mlflow.exceptions import MlflowException

    if not isinstance(exc, MlflowException):
        return False
    code = exc.error_code
    return code == "RESOURCE_DOES_NOT_EXIST" or (code == "INVALID_PARAMETER_VALUE" and "not found" in str(exc))


REFUSALS = ("INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "PERMISSION_DENIED", "UNAUTHENTICATED")


def unreachable(uri: str, exc: BaseException, doing: str) -> LadleError:
    """One error for a registry that failed while ``doing``: a refusal (the registry answered no, and will
    again) says what it refused; anything else is an outage, to be run again once the registry answers."""
    if getattr(exc, "error_code", None) in REFUSALS:
        return LadleError(
            f"tracking.uri = {redact_url(uri)}: the MLflow model registry refused {doing}: {str(exc)[:400]}. "
            "Nothing was decided. (A tracking server accepts only model sources it can reach: with a remote "
            "tracking.uri, set output to a URL both can reach, e.g. s3://...)",
            exit_code=1,
        )
    return LadleError(
        f"tracking.uri = {redact_url(uri)}: the MLflow model registry failed while {doing} ({type(exc).__name__}: "
        f"{str(exc)[:300]}). Nothing was decided; run it again once the registry answers.",
        exit_code=1,
    )


@contextlib.contextmanager
def registry(uri: str, doing: str) -> Iterator[None]:
    """Any failure of the registry inside becomes one ``unreachable`` error saying what was being done."""
    try:
        yield
    except LadleError:
        raise
    except Exception as exc:  # noqa: BLE001 - MLflow raises RestException, MlflowException, requests errors
        raise unreachable(uri, exc, doing) from None
