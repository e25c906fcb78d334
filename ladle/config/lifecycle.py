"""Config sections of the model lifecycle: serving (on this machine or on Kubernetes), evaluation, the
promotion gate and its canary, and tracking."""

from __future__ import annotations

import re
from datetime import date
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ladle.config.compute import KubernetesPods
from ladle.section import Section
from ladle.serve import backends
from ladle.serve.capture import CaptureSettings
from ladle.serve.limits import ServeLimits

BUILTIN_METRICS = ("exact_match", "loss", "preference_accuracy", "reward")


class ServeKubernetesConfig(KubernetesPods):
    kind: Literal["deployment", "inferenceservice"] = Field(
        "deployment",
        description="What serves the champion: `deployment` (a Deployment and a Service) or `inferenceservice` (a "
        "KServe `serving.kserve.io/v1beta1` InferenceService with ladle's server as its predictor).",
    )
    replicas: int = Field(1, ge=1, le=256, description="Server pods (each loads the whole model).")
    gpus: int | None = Field(
        None,
        ge=0,
        le=64,
        description="`nvidia.com/gpu` per pod. null: what serve.backend takes (a backend that shards the model: "
        "serve.tensor_parallel, at least 1, x serve.replica_num; another CUDA-only backend: 1; else 0).",
    )
    port: int = Field(8000, ge=1, le=65535, description="The server's port in the pod (and the Service's).")
    startup_timeout_s: float = Field(
        1800.0,
        gt=0,
        le=86400,
        description="Seconds a new pod may take to copy the version from the artifact store, load it and answer "
        "/health (its startup probe) before Kubernetes restarts it.",
    )
    access: Literal["namespace", "api_key", "open"] = Field(
        "namespace",
        description="Who may call the server pods. namespace: a NetworkPolicy admits only pods of the same "
        "namespace (needs a network plugin that enforces NetworkPolicy). api_key: every request needs the key in "
        "serve.api_key_env, which the pods read from the Secret serve.kubernetes.env_secret. open: anyone who can "
        "reach the pods (say so on purpose).",
    )
    tracking_uri: str | None = Field(
        None,
        max_length=2048,
        description="The MLflow tracking URI as the pods reach it, for adapters (promote.merge: false): each pod "
        "reads its adapters' champion and challenger from the registry when it starts. null: the config's tracking "
        "URI, which must then be a server the pods reach (http(s)://, not a file or SQLite on this machine). "
        "Credentials come from serve.kubernetes.env_secret.",
    )
    rollout_timeout_s: float = Field(
        900.0,
        gt=0,
        le=86400,
        description="Seconds a new version's rollout may take before ladle rolls the object back to the version "
        "that kept serving and fails naming the pods' reason.",
    )


BACKEND_PREAMBLE = "Inference backend. "


class ServeAdaptersConfig(Section):
    max_loaded: int = Field(
        8,
        ge=1,
        le=1024,
        description="LoRA adapters a server holds in memory beside its base (transformers backend). A request for "
        "another is served once the least recently used adapter without running requests is unloaded; while every "
        "loaded adapter has requests running it waits, and past serve.limits.queue_timeout_s gets 503 with "
        "Retry-After.",
    )
    max_mb: float = Field(
        0.0,
        ge=0,
        le=1_000_000,
        description="Cap on the loaded adapters' weights, in MiB (evicting as max_loaded does). 0: no cap but "
        "max_loaded.",
    )


class ServeConfig(Section):
    backend: str = Field(
        default_factory=lambda: backends.REGISTRY.first().name,  # the first registered: runs anywhere
        description=BACKEND_PREAMBLE + "Any registered backend (`ladle schema --markdown` lists them).",
        json_schema_extra=backends.REGISTRY.schema(BACKEND_PREAMBLE),
    )
    host: str = Field("127.0.0.1", description="Address the server binds.")
    port: int = Field(0, ge=0, le=65535, description="Port. 0: pick a free one.")
    max_new_tokens: int = Field(
        32,
        ge=1,
        le=8192,
        description="Default completion length (a request's max_tokens when it sends none), in tokens.",
    )
    max_batch_size: int = Field(
        32,
        ge=1,
        le=1024,
        description="Requests generated together (backends that batch: transformers). 1: one at a time.",
    )
    kv_cache_tokens: int = Field(
        0,
        ge=0,
        le=100_000_000,
        description="KV cache the transformers backend holds across its batch, in tokens (rows x padded width). "
        "Requests join the running batch in arrival order while it fits; one whose prompt plus max_tokens exceeds "
        "it is refused with HTTP 400. 0: max_batch_size x (data.seq_len + max_new_tokens), the size the planner "
        "counts (a bare `python -m ladle.serve`: max_batch_size x the model's context).",
    )
    api_key_env: str | None = Field(
        None,
        description="Environment variable holding the API key clients must send as `Authorization: Bearer`. "
        "null: no key. The key itself never appears in the config, logs or artifacts.",
    )
    tensor_parallel: int = Field(
        0,
        ge=0,
        le=64,
        description="Backends that shard the model (mii): GPUs per replica. 0: every GPU the server sees.",
    )
    replica_num: int = Field(
        1, ge=1, le=64, description="Backends with replicas (mii): model copies behind one endpoint."
    )
    start_timeout_s: float = Field(
        600.0,
        gt=0,
        le=7200,
        description="Backends that start their own server processes (mii): seconds before the start is given up "
        "and its processes are killed (MII itself would wait forever).",
    )
    drain_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="On SIGTERM, seconds in-flight requests may take to finish before exit."
    )
    health_timeout_s: float = Field(180.0, gt=0, description="Seconds to wait for /health before failing.")
    smoke_prompt: str | None = Field(
        None,
        description="Chat message sent as the deploy stage's smoke request. null: the first held-out eval "
        "conversation, whose answer is then checked against its reference (`answer_correct`); with no held-out "
        "conversation, `Hello!`.",
    )
    keep_running: bool = Field(
        False,
        description="Leave the server running after the smoke request (its PID is reported). "
        "false: stop it when the pipeline ends.",
    )
    front_port: int = Field(
        8600,
        ge=1,
        le=65535,
        description="Stable port of ladle's front (a proxy on `serve.host`) that serves the registered model's "
        "`champion`: clients keep this address while versions are swapped behind it (`ladle model serve`, the "
        "serving deployment).",
    )
    target: Literal["local", "kubernetes"] = Field(
        "local",
        description="Where the registered model's champion is served (`ladle model serve`, the serving deployment). "
        "local: ladle's front and a server process on this machine. kubernetes: an object on the cluster "
        "(serve.kubernetes) whose model version each promotion or rollback updates (`ladle k8s render-serving`).",
    )
    kubernetes: ServeKubernetesConfig = Field(
        default_factory=ServeKubernetesConfig, description="Options of serve.target kubernetes."
    )
    adapters: ServeAdaptersConfig = Field(
        default_factory=ServeAdaptersConfig,
        description="LoRA adapters served unmerged beside the base (`promote.merge: false`, `ladle serve --adapter`): "
        "how many the server holds in memory at once.",
    )
    limits: ServeLimits = Field(
        default_factory=ServeLimits,
        description="What one request may ask of the server: body size, messages, prompt characters, stop strings, "
        "max_tokens, and its place and wait in the queue.",
    )
    capture: CaptureSettings = Field(
        default_factory=CaptureSettings,
        description="Traffic capture and feedback (off by default): each answered request, redacted, and what users "
        "said about the answers (POST /v1/feedback), kept as files for the next model to learn from.",
    )

    _known_backend = field_validator("backend", mode="before")(backends.REGISTRY.validator())

    @model_validator(mode="after")
    def _kubernetes_key_is_set(self) -> ServeConfig:
        if self.kubernetes.access != "api_key":
            return self
        missing = [
            f
            for f, v in (
                ("serve.api_key_env", self.api_key_env),
                ("serve.kubernetes.env_secret", self.kubernetes.env_secret),
            )
            if not v
        ]
        if missing:
            raise ValueError(
                f"serve.kubernetes.access = 'api_key': {' and '.join(missing)} not set, so the pods would have no key "
                "to require. Set serve.api_key_env to the variable and serve.kubernetes.env_secret to the Secret "
                "holding it, or choose access namespace"
            )
        return self

    @model_validator(mode="after")
    def _default_within_cap(self) -> ServeConfig:
        if self.max_new_tokens > self.limits.max_tokens:
            raise ValueError(
                f"serve.max_new_tokens = {self.max_new_tokens}: above serve.limits.max_tokens = "
                f"{self.limits.max_tokens}, so a request that sends no max_tokens would be refused. Lower "
                "serve.max_new_tokens or raise serve.limits.max_tokens"
            )
        return self


class EvalConfig(Section):
    max_examples: int = Field(
        200,
        ge=0,
        le=100_000,
        description="Held-out eval conversations scored by exact match of greedy answers, for the base model "
        "(cached per base and data) and the merged model. 0: measure eval loss only.",
    )
    batch_size: int = Field(32, ge=1, le=1024, description="Prompts generated together while evaluating.")
    metric: str = Field(
        "exact_match",
        description="The task metric scored on the held-out split for the base, the new model and the champion: "
        "`exact_match` (greedy answer equals the reference), `loss` (token-weighted eval loss; lower is better), "
        "`preference_accuracy` (training.objective: dpo; held-out pairs whose implicit reward ranks chosen above "
        "rejected, against the run's reference, a tie counting half), `reward` (training.objective: grpo; the mean "
        "weighted reward of one greedy completion per held-out prompt, by the run's training.rl.rewards), "
        "or a Python entry point `module:function` called as `function(model_dir: pathlib.Path, "
        "conversations: list[list[dict]]) -> float`, each conversation ending with its reference turn.",
    )
    greater_is_better: bool | None = Field(
        None,
        description="Direction of `eval.metric`. null: true, except for `loss`. Set it for an entry point whose "
        "score is better when lower.",
    )
    probe: str | None = Field(
        None,
        description='General-ability probe: a JSONL file (local or fsspec URL) of `{"question": ..., '
        '"answers": [...]}` rows, or `ladle://general-probe` (32 general-knowledge questions shipped with '
        "ladle). Each question is asked alone through the chat template, greedily; an answer is right when it "
        "contains one of the accepted answers as a whole word, case ignored. Scored as `probe` (fraction right) "
        "beside the task metric for the base, the new model and the champion, so a fine-tune that teaches the "
        "task but costs what the model knew shows it. null: no probe.",
    )
    probe_max_new_tokens: int = Field(
        32, ge=1, le=512, description="Tokens generated per probe answer (the accepted word must come within them)."
    )

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, value: str) -> str:
        if value in BUILTIN_METRICS or re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value):
            return value
        raise ValueError(
            f"eval.metric = {value!r}: use one of {', '.join(BUILTIN_METRICS)} or an entry point "
            "`package.module:function`"
        )

    def higher_wins(self) -> bool:
        return self.metric != "loss" if self.greater_is_better is None else self.greater_is_better


class CanaryConfig(Section):
    weight: float = Field(
        0.1, gt=0.0, lt=1.0, description="Share of live requests the front sends to the challenger during its canary."
    )
    duration_s: float = Field(
        600.0,
        gt=0.0,
        le=7 * 86400,
        description="How long the canary takes traffic before it passes (it rolls back earlier on a breach).",
    )
    min_requests: int = Field(
        20,
        ge=1,
        description="Challenger requests needed before any verdict; fewer by the end of duration_s rolls back "
        "(not enough evidence).",
    )
    max_error_rate_increase: float = Field(
        0.02,
        ge=0.0,
        le=1.0,
        description="The challenger's share of failed requests (HTTP 5xx, refused or broken connections) may exceed "
        "the champion's, measured over the same time, by at most this; more rolls it back at once.",
    )
    max_latency_ratio: float = Field(
        1.5,
        ge=1.0,
        description="The challenger's p95 latency (request sent to last byte, answered requests) may be at most "
        "this multiple of the champion's; more rolls it back at once (unless within latency_slack_s).",
    )
    latency_slack_s: float = Field(
        0.05,
        ge=0.0,
        description="A p95 latency at most this many seconds above the champion's is never a breach, whatever the "
        "ratio (milliseconds of jitter on fast answers are not a regression).",
    )


class RetrainConfig(Section):
    """``retrain``: what a run learns from its served model's traffic (``serve.capture``), and when a scheduled
    run trains."""

    from_traffic: bool = Field(
        False,
        description="Add the captured traffic's rows of training.objective's kind (sft: corrections and well-judged "
        "answers; dpo: corrections against the answers they correct; grpo: the captured prompts) to the run's data "
        "as one more data.sources entry (`ladle data from-traffic` shows what it would add).",
    )
    traffic_url: str | None = Field(
        None, description="Where the server captured to. null: serve.capture.url (the output's traffic folder)."
    )
    since: date | None = Field(None, description="The oldest capture day used (YYYY-MM-DD). null: all of it.")
    traffic_epochs: float = Field(
        2.0,
        gt=0,
        le=100,
        description="Passes over the traffic rows in the mix (their data.sources entry's epochs). Epochs, not a "
        "weight: a weight would shrink the recipe's own data to the traffic's size (the mix uses weighted sources "
        "until the first runs out).",
    )
    good_score: float = Field(
        0.5,
        description="A numeric feedback at least this is good (a score of 4 of 5 stars: set 4); true/false feedback "
        "is good/bad as it says.",
    )
    overlap_ngram: int = Field(
        8,
        ge=3,
        le=50,
        description="Word n-grams a traffic prompt may not share with the evaluation set (held-out rows, "
        "data.eval_path, eval.probe); a shorter prompt may not equal one of them.",
    )
    min_new_feedback: int = Field(
        0,
        ge=0,
        le=10**9,
        description="Scheduled retraining (retrain.from_traffic): train only when at least this many new rows of the "
        "objective's kind came from traffic newer than the champion's (its ladle.traffic.last_at); otherwise skip, "
        "saying how many there are. 0: train whenever the inputs changed.",
    )

    @field_validator("traffic_url")
    @classmethod
    def _no_password(cls, value: str | None) -> str | None:
        from ladle.platform.secrets import refuse_url_password

        return refuse_url_password(
            value, "retrain.traffic_url", "Give the store's credentials through its own settings"
        )


class ShadowConfig(Section):
    """``promote.shadow``: the challenger answers a replay of the champion's captured traffic before it takes any."""

    requests: int = Field(
        0,
        ge=0,
        le=100_000,
        description="The champion's newest captured requests (serve.capture) the challenger answers on the deploy "
        "stage's server, as they were sent; those a user corrected or approved are scored (eval.metric exact_match) "
        "and a significant regression holds promotion back. 0: off.",
    )
    max_regression: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Drop in success rate tolerated on the replay (on top of the measured run-to-run spread: a "
        "sampled request is replayed twice, and the challenger's own difference between the passes is allowed).",
    )
    alpha: float = Field(
        0.05,
        gt=0.0,
        lt=1.0,
        description="Significance of McNemar's exact paired test: a drop counts only when losing that many of the "
        "requests the two disagree on has a chance below alpha under 'equally good'.",
    )


class PromoteConfig(Section):
    merge: bool = Field(
        True,
        description="Register the model merged into a full copy of the base (served by a server of its own). false: "
        "register the LoRA adapter itself, with the signature of the base it was trained on, served unmerged on a "
        "server of that base beside other adapters (`ladle model serve` puts it there; "
        "docs/howto/adapters.md). Evaluation scores the same weights either way.",
    )
    parity: bool = Field(
        True,
        description="Before promotion, the server's log-probabilities of held-out answers must equal the trained "
        "model's forward in the training process, and its chat template must give the prompt tokens training "
        "used; a mismatch blocks promotion and says where the two differ. false: measured and reported, not gated.",
    )
    parity_tolerance: float | None = Field(
        None,
        gt=0,
        le=10,
        description="Largest per-token log-probability difference the parity gate allows. null: 1e-4 for weights "
        "trained in float32, 0.25 for 16-bit ones.",
    )
    metric: str | None = Field(
        None,
        description="Score that decides promotion: `loss` or `eval.metric`'s name. null: `eval.metric`.",
    )
    min_improvement: float = Field(
        0.0,
        ge=0.0,
        description="The new model becomes `champion` only when it beats the current champion (or, with none, the "
        "base model) on the same held-out set by more than this, in the metric's units (0: strictly better).",
    )
    max_probe_drop: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="With eval.probe: the new model is not promoted when its probe score is more than this below "
        "the probe score of what it is compared with (the champion, or with none the base model), whatever its "
        "task score. null: the probe is reported, not gated.",
    )
    enabled: bool = Field(
        True,
        description="Register the model and run the gate. false: register nothing (a trial run).",
    )
    canary: CanaryConfig | None = Field(
        None,
        description="A version that passes the gate first serves a share of live traffic beside the champion "
        "(where the champion is served: the serving deployment or `ladle model serve`); the front compares their "
        "error rates and latencies and promotes it or rolls it back by itself. null: the gate promotes directly.",
    )
    shadow: ShadowConfig = Field(
        default_factory=ShadowConfig,
        description="Shadow evaluation before any live traffic: the champion's captured requests replayed to the "
        "challenger, gated by a paired test (off until promote.shadow.requests is set).",
    )


class TrackingConfig(Section):
    uri: str | None = Field(
        None,
        description="MLflow tracking URI. null: $MLFLOW_TRACKING_URI when set, else sqlite in the output folder "
        "(in $LADLE_HOME/mlflow when output is remote). Credentials in an http(s) URI are taken out when the config is "
        "read and kept by the process for that server alone (its training processes get them as "
        "MLFLOW_TRACKING_USERNAME/PASSWORD), so no parameter, spec file or artifact carries them, and are never "
        "logged; a URI of another scheme with a password is refused (set MLFLOW_TRACKING_URI).",
    )
    experiment: str = Field("ladle", description="MLflow experiment name.")
    registered_model: str | None = Field(
        None, description="Registered-model name for the merged model. null: the config's `name`."
    )
    ui_url: str = Field("http://127.0.0.1:5000", description="Base URL of the MLflow UI, for links.")
    request_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Deadline of each request to an MLflow server, per try (MLFLOW_HTTP_REQUEST_TIMEOUT, set for "
        "ladle and the training processes; MLflow's own default is 120 s). A server that does not answer fails "
        "the stage with one error naming tracking.uri.",
    )
    request_retries: int = Field(
        3,
        ge=0,
        le=10,
        description="Retries of a failed MLflow request, with MLflow's doubling backoff from 2 s "
        "(MLFLOW_HTTP_REQUEST_MAX_RETRIES; MLflow's default is 7, minutes of waiting on a dead server). With "
        "the defaults a dead server is reported within about 2.5 minutes, a refused connection within 15 s.",
    )

    @field_validator("uri")
    @classmethod
    def _no_password_in_the_config(cls, value: str | None) -> str | None:
        """The config travels (Prefect parameters, spec files, artifacts): an http(s) password moves to MLflow's
        environment here, and a URI of another scheme that carries one is refused."""
        if value is None:
            return None
        from urllib.parse import urlsplit

        from ladle.platform.secrets import redact_url, strip_credentials

        try:
            parts = urlsplit(value)
            has_password = bool(parts.password)
        except ValueError:
            has_password = False
        if has_password and parts.scheme not in ("http", "https"):
            raise ValueError(
                f"{redact_url(value)} carries a password, which would travel with the config (flow parameters, "
                "spec files, artifacts). Leave tracking.uri null and set MLFLOW_TRACKING_URI in the environment, or "
                "use the tracking server's http(s) address"
            )
        return strip_credentials(value)
