"""Many LoRA adapters on one base (``ladle.serve.adapters``): requests for different adapters share one batch and
each gets exactly its merged model's greedy answer (float32, same tokens, log-probabilities within 1e-4), with
fewer slots than adapters (least recently used evicted, reloaded on demand); a new version swaps in while a request
on the old one finishes on it; a budget that cannot hold an adapter answers 503, never an out-of-memory; and an
adapter that does not fit the base is refused naming why. Then the same through a real two-process server and the
OpenAI SDK: ``/v1/models``, the ``model`` field, 404 in OpenAI's shape, streamed and whole, structured output per
adapter, and an adapter added while traffic runs with no failed request."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import psutil
import pytest
import torch

from ladle.config import CanaryConfig
from ladle.errors import LadleError
from ladle.platform.files import write_atomic
from ladle.serve.adapters import RECORD, BaseWeights, Catalog, inspect
from ladle.serve.rows import Job
from ladle.serve.transformers_backend import TransformersBackend
from tests.helpers import Clients, fresh_registry
from tests.serve.adapter_kit import SHAPES, make_adapter, make_set

PROMPTS = ["red blue green", "one two three four", "x y", "the colour of"]
ADMIN_KEY = "test-admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def kit(tiny_model, tmp_path_factory):
    return make_set(tiny_model, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def merged(kit, tiny_model):
    """Each adapter's merged model, and the base, served alone: the references."""
    engines = {name: TransformersBackend(str(folder), max_batch=8) for name, (_, folder) in kit.items()}
    engines[None] = TransformersBackend(str(tiny_model), max_batch=8)
    return engines


def submit(backend, prompt: str, adapter: str | None = None, **fields) -> tuple[Job, threading.Event, dict]:
    done, end = threading.Event(), {}

    def emit(kind, data):
        if kind in ("done", "error"):
            end[kind] = data
            done.set()

    ids = backend.tokenizer(prompt, add_special_tokens=False).input_ids
    job = Job(ids=ids, max_new_tokens=fields.pop("max_new_tokens", 12), adapter=adapter, emit=emit, **fields)
    backend.submit(job)
    return job, done, end


def finished(job_done_end) -> Job:
    job, done, end = job_done_end
    assert done.wait(60), "no answer within 60 s"
    assert "done" in end, end
    return job


def registered(backend, catalog: Catalog, kit) -> dict[str | None, str | None]:
    keys: dict[str | None, str | None] = {None: None}
    for name, (folder, _) in kit.items():
        version, _ = catalog.add(name, str(folder))
        backend.add_adapter(version.key, version.info.path, version.info.bytes)
        keys[name] = version.key
    return keys


def test_mixed_adapters_in_one_batch_answer_as_their_merged_models_with_fewer_slots_than_adapters(
    kit, merged, tiny_model
):
    backend = TransformersBackend(str(tiny_model), max_batch=8, max_adapters=2)
    batches: list[int] = []
    backend.report_batches(batches.append)
    keys = registered(backend, Catalog("tiny", BaseWeights.of(tiny_model)), kit)
    names = [None, *SHAPES]
    sent = [(name, prompt, submit(backend, prompt, keys[name], logprobs=1)) for prompt in PROMPTS for name in names]
    answers = [(name, prompt, finished(job)) for name, prompt, job in sent]
    assert max(batches) > 2, f"requests of different adapters never shared a batch: {batches}"
    evicted = next(name for name in SHAPES if keys[name] not in backend.slots.loaded)
    answers.append((evicted, PROMPTS[0], finished(submit(backend, PROMPTS[0], keys[evicted], logprobs=1))))
    assert backend.slots.loads > len(SHAPES), "two slots for three adapters: one was evicted and loaded again"
    assert len(backend.slots.loaded) <= 2
    for name, prompt, job in answers:
        alone = finished(submit(merged[name], prompt, logprobs=1))
        assert job.tokens == alone.tokens, (name, prompt)
        gap = max(
            abs(a["logprob"] - b["logprob"]) for a, b in zip(job.token_logprobs, alone.token_logprobs, strict=True)
        )
        assert gap < 1e-4, (name, prompt, gap)
    distinct = {tuple(job.tokens) for name, prompt, job in answers if prompt == PROMPTS[0]}
    assert len(distinct) == len(names), "every adapter changes the answer (else the check above proves nothing)"


def test_a_new_version_swaps_in_while_a_request_on_the_old_one_finishes_on_it(kit, merged, tiny_model):
    backend = TransformersBackend(str(tiny_model), max_batch=8, max_adapters=4)
    catalog = Catalog("tiny", BaseWeights.of(tiny_model))
    first, _ = catalog.add("bot", str(kit["red"][0]), version="1")
    backend.add_adapter(first.key, first.info.path, first.info.bytes)
    long = submit(backend, PROMPTS[0], catalog.resolve("bot"), max_new_tokens=60, logit_bias={2: -100.0})
    while not long[0].tokens:
        time.sleep(0.01)
    second, dropped = catalog.add("bot", str(kit["blue"][0]), version="2")
    assert dropped == []  # version 1 stays addressable as bot@1
    backend.add_adapter(second.key, second.info.path, second.info.bytes)
    now = finished(submit(backend, PROMPTS[0], catalog.resolve("bot")))
    assert now.tokens == finished(submit(merged["blue"], PROMPTS[0])).tokens
    assert catalog.resolve("bot@1") == first.key and catalog.resolve("bot@v2") == second.key
    old = finished(long)
    assert old.tokens[:12] == finished(submit(merged["red"], PROMPTS[0], logit_bias={2: -100.0})).tokens
    for key in catalog.remove("bot", "1"):
        backend.drop_adapter(key)
    finished(submit(backend, PROMPTS[1], catalog.resolve("bot")))  # a turn after the drop: the old one is unloaded
    assert first.key not in backend.slots.loaded and second.key in backend.slots.loaded
    with pytest.raises(KeyError):
        catalog.resolve("bot@1")


def test_requests_queued_for_a_version_that_is_swapped_out_finish_on_it(kit, merged, tiny_model):
    """One row at a time: a request runs on bot v1, a second one for bot (resolved to v1) waits behind it; v1 is
    replaced (the same version label, other weights) and dropped. The waiting request still answers, on the version
    it was resolved to (before, it got 503 "no longer served": only running rows kept a dropped version); the next
    one runs on the new weights; the old version is forgotten once nothing names it."""
    backend = TransformersBackend(str(tiny_model), max_batch=1, max_adapters=4)
    catalog = Catalog("tiny", BaseWeights.of(tiny_model))
    told = []

    def engine(version):  # the catalog tells the engine of a key before any name resolves to it
        assert all(v is not version for v in catalog.names.get("bot", {}).values()), "published before the engine knew"
        told.append(version.key)
        backend.add_adapter(version.key, version.info.path, version.info.bytes)

    first, _ = catalog.add("bot", str(kit["red"][0]), version="1", engine=engine)
    running = submit(backend, PROMPTS[0], catalog.resolve("bot"), max_new_tokens=40, logit_bias={2: -100.0})
    while not running[0].tokens:
        time.sleep(0.01)
    queued = submit(backend, PROMPTS[1], catalog.resolve("bot"), max_new_tokens=6)
    second, dropped = catalog.add("bot", str(kit["blue"][0]), version="1", engine=engine)
    assert dropped == [first.key] and told == [first.key, second.key]
    for key in dropped:
        backend.drop_adapter(key)
    answered = finished(queued)  # "done", not a 503
    assert answered.tokens == finished(submit(merged["red"], PROMPTS[1], max_new_tokens=6)).tokens
    finished(running)
    now = finished(submit(backend, PROMPTS[1], catalog.resolve("bot"), max_new_tokens=6))
    assert now.tokens == finished(submit(merged["blue"], PROMPTS[1], max_new_tokens=6)).tokens
    assert first.key not in backend.slots.retired and first.key not in backend.slots.loaded


def test_an_adapter_the_budget_cannot_hold_gets_503_and_a_held_one_waits_for_a_slot(kit, tiny_model):
    small = TransformersBackend(str(tiny_model), max_batch=4, max_adapters=1, adapters_mb=0.001)
    keys = registered(small, Catalog("tiny", BaseWeights.of(tiny_model)), kit)
    job, done, end = submit(small, PROMPTS[0], keys["red"])
    assert done.wait(30) and end["error"]["status"] == 503
    assert "serve.adapters.max_mb" in end["error"]["message"]
    assert finished(submit(small, PROMPTS[0])).tokens  # the base still serves

    one = TransformersBackend(str(tiny_model), max_batch=4, max_adapters=1)
    keys = registered(one, Catalog("tiny", BaseWeights.of(tiny_model)), kit)
    running = submit(one, PROMPTS[0], keys["red"], max_new_tokens=40, logit_bias={2: -100.0})
    while not running[0].tokens:
        time.sleep(0.01)
    late = submit(one, PROMPTS[0], keys["blue"])
    late[0].deadline = time.monotonic() + 0.05  # its slot is held by the running request past this deadline
    assert late[1].wait(30) and late[2]["error"]["status"] == 503
    assert "serve.adapters.max_loaded = 1" in late[2]["error"]["message"]
    waits = submit(one, PROMPTS[0], keys["green"])  # no deadline: served once the running request ends
    assert finished(running).tokens and finished(waits).tokens


def test_adapters_that_do_not_fit_the_base_are_refused_naming_why(kit, tiny_model, tmp_path, monkeypatch):
    base = BaseWeights.of(tiny_model)
    catalog = Catalog("tiny", base)
    foreign = shutil.copytree(kit["red"][0], tmp_path / "foreign")
    (foreign / RECORD).write_text(json.dumps({"base_signature": "f" * 64}))
    with pytest.raises(
        LadleError, match=f"signature ffffffffffffffff, but this server's base .* {base.signature[:16]}"
    ):
        catalog.add("foreign", str(foreign))
    dora = shutil.copytree(kit["red"][0], tmp_path / "dora")
    settings = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**settings, "use_dora": True}))
    with pytest.raises(LadleError, match=r"DoRA .*\(promote.merge: true\)"):
        inspect(dora, base)
    unrecorded = make_adapter(tiny_model, tmp_path / "bare", 4, ["q_proj"], 5, record=False)
    assert inspect(unrecorded, base).base_signature is None  # trained elsewhere: accepted on its shapes
    wrong = BaseWeights(base.folder, base.signature, {k: (v[0] + 1, *v[1:]) for k, v in base.shapes.items()})
    with pytest.raises(LadleError, match="does not fit .* trained on another base"):
        inspect(unrecorded, wrong)
    missing = BaseWeights(base.folder, base.signature, {k: v for k, v in base.shapes.items() if "q_proj" not in k})
    with pytest.raises(LadleError, match="adapts model.layers.0.self_attn.q_proj, which the base"):
        inspect(unrecorded, missing)
    with pytest.raises(LadleError, match="not a LoRA adapter folder"):
        inspect(tiny_model, base)
    for bad in ("tiny", "a@b", ""):
        with pytest.raises(LadleError, match="adapter name"):
            catalog.add(bad, str(unrecorded))
    with pytest.raises(KeyError):
        catalog.resolve("nobody")
    small = Catalog("tiny", base)
    monkeypatch.setattr("ladle.serve.adapters.MAX_VERSIONS", 2)
    small.add("one", str(unrecorded))
    small.add("one", str(unrecorded), version="2")
    small.add("one", str(unrecorded), version="2")  # a version replaced: still two
    with pytest.raises(LadleError, match=r"already answers for 2 adapter versions, its most"):
        small.add("two", str(unrecorded))


def test_a_failed_load_never_gives_a_live_adapters_id_to_the_next_one(kit, tiny_model, tmp_path):
    """Load red and blue, remove red, fail a load (a damaged file: B of another rank), load green: green must get
    an id of its own. Before, the failed load lost the freed id and green took blue's: blue's rows then got both
    updates, and removing either made the other the base."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from ladle.serve.multi_lora import MultiLora

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    group = MultiLora(model)
    inputs = torch.tensor([[5, 6, 7, 8]])

    def logits(key):
        with torch.no_grad(), group.rows_of([key]):
            return model(inputs).logits

    group.add("red", kit["red"][0])
    group.add("blue", kit["blue"][0])
    blue_alone = logits("blue")
    group.remove("red")
    damaged = shutil.copytree(kit["red"][0], tmp_path / "damaged")
    tensors = load_file(damaged / "adapter_model.safetensors")
    name = next(k for k in tensors if "lora_B" in k)
    tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1)
    save_file(tensors, damaged / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="rank"):
        group.add("damaged", damaged)
    group.add("green", kit["green"][0])
    assert len(set(group.ids.values())) == 2, group.ids
    # green's columns add exact zeros to blue's rows, in sums of another length (float32: ~1e-7 apart); green's own
    # update, had it shared blue's id, moves the logits by ~1.
    same = {"rtol": 0, "atol": 1e-5}
    torch.testing.assert_close(logits("blue"), blue_alone, **same)
    assert (logits("green") - logits(None)).abs().max() > 1e-2, "green's rows take its update"
    group.remove("green")
    torch.testing.assert_close(logits("blue"), blue_alone, **same)  # and removing green leaves blue whole


def test_inspect_refuses_a_lora_bias_and_halves_of_two_ranks(kit, tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    base = BaseWeights.of(tiny_model)
    biased = shutil.copytree(kit["red"][0], tmp_path / "biased")
    tensors = load_file(biased / "adapter_model.safetensors")
    name = next(k for k in tensors if "lora_B" in k)
    tensors[name.replace(".weight", ".bias")] = torch.zeros(tensors[name].shape[0])
    save_file(tensors, biased / "adapter_model.safetensors")
    with pytest.raises(LadleError, match="lora_bias"):
        inspect(biased, base)
    tensors.pop(name.replace(".weight", ".bias"))
    tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1)
    save_file(tensors, biased / "adapter_model.safetensors")
    with pytest.raises(LadleError, match="LoRA ranks"):
        inspect(biased, base)


@pytest.fixture(scope="module")
def split(kit, tiny_model, tmp_path_factory, registry):
    """A real server (API and engine processes) over the tiny base with two adapters from the command line and one
    bound to the registry's model ``bot`` (its bindings in a file: ``split.bindings``)."""
    import sys

    from ladle.platform.processes import free_port, stop_process
    from ladle.serve import pool

    port = free_port()
    log = tmp_path_factory.mktemp("split-adapters") / "server.log"
    argv = [sys.executable, "-m", "ladle.serve", "--model", str(tiny_model), "--name", "tiny", "--port", str(port)]
    argv += ["--adapter", f"red={kit['red'][0]}", "--adapter", f"blue={kit['blue'][0]}"]
    argv += ["--option", "max_adapters=2", "--max-new-tokens", "12", "--adapter", "bot=models:/bot"]
    bindings = log.parent / "bindings.json"
    argv += ["--tracking-uri", registry, "--adapters-file", str(bindings), "--adapter-sync-s", "600"]
    admin_key = log.parent / "admin-key"
    write_atomic(admin_key, ADMIN_KEY + "\n", mode=0o600)
    argv += ["--admin-key-file", str(admin_key), "--adapter-source", str(Path(kit["green"][0]).parent)]
    proc = pool.launch(argv, log)  # forked from the suite's warm pool, as a host's servers are where one runs
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield SimpleNamespace(url=url, argv=argv, bindings=bindings, proc=proc, log=log)
    finally:
        stop_process(proc, grace_s=20, group=True)


def chat(client, model: str, text: str, **extra):
    settings = {"max_tokens": 12, "temperature": 0, **extra}
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], **settings)


def test_through_the_server_the_model_field_picks_the_adapter_whole_and_streamed(split, merged, kit):
    split = split.url
    client = openai.OpenAI(base_url=f"{split}/v1", api_key="unused", max_retries=0)
    listed = {m.id for m in client.models.list().data}
    assert {"tiny", "red", "blue", "red@1", "blue@1"} <= listed
    reference = {name: openai_reference(merged[name], PROMPTS[0]) for name in ("red", "blue", None)}
    results: dict[tuple, list] = {}

    def ask(model: str, stream: bool) -> None:  # each answer as its tokens' bytes (the tiny model's text is not UTF-8)
        if stream:
            chunks = chat(client, model, PROMPTS[0], stream=True, logprobs=True)
            results[model, stream] = [
                t.bytes for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
            ]
        else:
            answer = chat(client, model, PROMPTS[0], logprobs=True)
            assert answer.model == model
            results[model, stream] = [t.bytes for t in answer.choices[0].logprobs.content]

    threads = [threading.Thread(target=ask, args=(m, s)) for m in ("red", "blue", "tiny") for s in (False, True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 6
    for (model, _), tokens in results.items():
        assert tokens == reference[None if model == "tiny" else model], model
    assert len({json.dumps(v) for v in results.values()}) == 3, "each adapter changes the answer"

    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    for model in ("red", "blue"):
        shaped = chat(
            client,
            model,
            "a colour as JSON",
            max_tokens=100,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        )
        assert json.loads(shaped.choices[0].message.content)["colour"] in ("red", "blue")

    with pytest.raises(openai.NotFoundError) as missing:
        chat(client, "purple", "hi")
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"


def test_an_adapter_added_and_removed_under_traffic_fails_no_request(split, merged, kit):
    split = split.url
    errors: list[str] = []
    stop = threading.Event()

    def traffic(model: str) -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0}
                answer = http.post(f"{split}/v1/completions", json=body)
                if answer.status_code != 200:
                    errors.append(answer.text)

    threads = [threading.Thread(target=traffic, args=(m,)) for m in ("red", "blue", "tiny")]
    for thread in threads:
        thread.start()
    try:
        added = httpx.post(
            f"{split}/v1/adapters",
            json={"name": "green", "path": str(kit["green"][0]), "version": "3", "aliases": ["champion"]},
            headers=ADMIN,
            timeout=30,
        )
        assert added.status_code == 200, added.text
        body = {"model": "green@champion", "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0}
        answer = httpx.post(f"{split}/v1/completions", json=body, timeout=60).json()
        expected = finished(submit(merged["green"], PROMPTS[1], max_new_tokens=6))
        assert answer["choices"][0]["text"] == expected.text
        refused = httpx.post(
            f"{split}/v1/adapters", json={"name": "odd", "path": str(kit["red"][1])}, headers=ADMIN, timeout=30
        )
        assert refused.status_code == 400 and "not a LoRA adapter folder" in refused.json()["error"]["message"]
        assert httpx.delete(f"{split}/v1/adapters/green", headers=ADMIN, timeout=30).status_code == 200
        assert httpx.post(f"{split}/v1/completions", json=body, timeout=30).status_code == 404
        described = httpx.get(f"{split}/v1/adapters", timeout=30).json()
        assert [a["name"] for a in described["data"]] == ["blue", "bot", "red"]
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert errors == []


def test_control_routes_take_the_admin_key_load_only_from_their_sources_and_the_front_never_forwards_them(
    split, kit, tmp_path
):
    """Adding, binding, syncing and removing adapters change what a served name answers with: no key, or the API
    key, gets 403; a path outside ``--adapter-source`` (or climbing out of it) is refused with the admin key too;
    and ladle's front answers every control route itself, with 403, forwarding none."""
    from ladle.fleet import front as router
    from tests.serve.running import Running

    url = split.url
    stolen = shutil.copytree(kit["green"][0], tmp_path / "elsewhere")
    adding = {"name": "red", "path": str(kit["green"][0]), "version": "9"}  # would take red's traffic
    for headers in ({}, {"Authorization": "Bearer not-the-admin-key"}):
        for method, path, body in (
            ("POST", "/v1/adapters", adding),
            ("POST", "/v1/adapters/bind", {"name": "red", "registered_model": "bot"}),
            ("POST", "/v1/adapters/sync", None),
            ("DELETE", "/v1/adapters/red", None),
        ):
            answer = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            assert answer.status_code == 403, (method, path, answer.text)
            assert "admin key" in answer.json()["error"]["message"]
    for outside in (str(stolen), str(Path(kit["green"][0]).parent / ".." / stolen.parent.name / "elsewhere")):
        answer = httpx.post(url + "/v1/adapters", json={**adding, "path": outside}, headers=ADMIN, timeout=30)
        assert answer.status_code == 400 and "not under any adapter source" in answer.text, answer.text
    red = next(a for a in httpx.get(url + "/v1/adapters", timeout=30).json()["data"] if a["name"] == "red")
    assert [v["version"] for v in red["versions"]] == ["1"], "nothing refused was registered"

    upstream = {"url": url, "version": "base", "pid": None}
    front = Running(router.create_app("base-test", "t", {"upstream": upstream}, None))
    try:
        for method, path in (("POST", "/v1/adapters"), ("POST", "/v1/adapters/sync"), ("DELETE", "/v1/adapters/red")):
            answer = httpx.request(method, front.url + path, json=adding, headers=ADMIN, timeout=30)
            assert answer.status_code == 403 and "does not forward control routes" in answer.text, answer.text
        listed = httpx.get(front.url + "/v1/adapters", timeout=30)  # reading is not control: forwarded
        assert listed.status_code == 200 and listed.json()["base"] == "tiny"
    finally:
        front.stop()


def openai_reference(backend, text: str) -> list[list[int]]:
    """The merged model's greedy chat answer, as each token's bytes."""
    ids = backend.encode_chat([{"role": "user", "content": text}])
    done, end = threading.Event(), {}

    def emit(kind, data):
        if kind in ("done", "error"):
            end[kind] = data
            done.set()

    job = Job(ids=ids, max_new_tokens=12, logprobs=0, emit=emit)
    backend.submit(job)
    assert done.wait(60) and "done" in end
    return [entry["bytes"] for entry in job.token_logprobs]


# -- adapters bound to registered models ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def registry(kit, tiny_model, tmp_path_factory):
    """A SQLite MLflow registry with model ``bot``: v1 the red adapter (champion), v2 the blue one (challenger),
    registered as ``promote.merge: false`` registers them."""
    from ladle.lifecycle import promote
    from ladle.lifecycle.lineage import base_signature
    from ladle.platform import storage

    uri = fresh_registry(tmp_path_factory.mktemp("adapter-registry"))
    signature = base_signature(tiny_model)
    for name in ("red", "blue"):
        folder = kit[name][0]
        tags = {"ladle.kind": "adapter", "ladle.model_sha256": storage.weights_hash(folder)}
        promote.register(uri, "bot", str(folder), None, {**tags, "ladle.base_signature": signature})
    promote.promote(uri, "bot", "1", "the first")
    return uri


def start(argv: list[str], log) -> tuple:
    from ladle.serve import pool

    proc = pool.launch(argv, log, append=True)  # forked from the suite's warm pool
    url = "http://127.0.0.1:" + argv[argv.index("--port") + 1]
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)


def answer_tokens(url: str, model: str) -> list:
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "logprobs": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["logprobs"]["tokens"]


def test_a_server_bound_to_a_registered_model_serves_its_aliases_and_a_replica_or_restart_the_same(
    split, registry, kit, merged, tiny_model, tmp_path
):
    """The registry is the truth: champion and challenger by name, a promotion and a rollback served after a sync,
    a version whose files were altered named by /ready while the rest serves, and a second server (or the same one
    after SIGKILL) started from the bindings file alone serves the same versions."""
    import signal
    import sys

    from ladle.lifecycle import promote
    from ladle.platform.processes import free_port, stop_process

    def reference(name):
        return [
            e["token"] for e in finished(submit(merged[name], PROMPTS[0], max_new_tokens=8, logprobs=0)).token_logprobs
        ]

    red, blue = reference("red"), reference("blue")
    url, log = split.url, tmp_path / "replica.log"
    common = [sys.executable, "-m", "ladle.serve", "--model", str(tiny_model), "--name", "tiny"]
    common += ["--tracking-uri", registry, "--adapters-file", str(split.bindings), "--adapter-sync-s", "600"]
    replica = None
    try:
        assert answer_tokens(url, "bot") == red and answer_tokens(url, "bot@challenger") == blue
        assert answer_tokens(url, "bot@v2") == blue
        promote.promote(registry, "bot", "2", "better")
        state = httpx.post(f"{url}/v1/adapters/sync", headers=ADMIN, timeout=60).json()
        assert state["last_error"] is None and state["problems"] == {}
        assert answer_tokens(url, "bot") == blue and answer_tokens(url, "bot@champion") == blue
        promote.rollback(registry, "bot", "1")
        httpx.post(f"{url}/v1/adapters/sync", headers=ADMIN, timeout=60)
        assert answer_tokens(url, "bot") == red

        altered = shutil.copytree(kit["green"][0], tmp_path / "altered")
        tags = {"ladle.kind": "adapter", "ladle.model_sha256": "0" * 64}  # not its weights' hash
        third = promote.register(registry, "bot", str(altered), None, tags)  # now the challenger
        state = httpx.post(f"{url}/v1/adapters/sync", headers=ADMIN, timeout=60).json()
        assert f"bot v{third.version} (challenger)" in state["problems"]["bot"]
        ready = httpx.get(f"{url}/ready", timeout=10)
        assert ready.status_code == 503 and f"bot v{third.version} (challenger)" in ready.text
        assert answer_tokens(url, "bot") == red  # the rest keeps serving

        from mlflow.tracking import MlflowClient

        MlflowClient(registry).set_registered_model_alias("bot", "challenger", "2")
        httpx.post(f"{url}/v1/adapters/sync", headers=ADMIN, timeout=60)
        assert httpx.get(f"{url}/ready", timeout=10).status_code == 200

        # A second replica, or this one restarted as a supervisor restarts it: a start whose command line names
        # no adapter, the bindings file and the registry saying what to serve.
        replica, replica_url = start([*common, "--port", str(free_port())], log)
        assert answer_tokens(replica_url, "bot") == red and answer_tokens(replica_url, "bot@challenger") == blue
        assert httpx.get(f"{replica_url}/v1/adapters", timeout=10).json()["registry"]["bindings"] == {"bot": "bot"}
        engine = psutil.Process(replica.pid).children()[0]
        os.killpg(replica.pid, signal.SIGKILL)  # killed outright: its engine goes with it
        replica.wait(30)
        engine.wait(30)
        replica = None
    finally:
        if replica is not None:
            stop_process(replica, grace_s=20, group=True)


def test_a_registered_version_with_damaged_files_is_a_problem_the_sync_reports_and_survives(
    split, registry, kit, tmp_path
):
    """An adapter_config.json that is not JSON, then a torn weights file, registered as the challenger: each sync
    names the version's problem (and /ready with it) while everything loaded keeps answering; before, either one
    escaped the sync (a 500 here, the periodic thread's end there) while /ready stayed green."""
    from mlflow.tracking import MlflowClient

    from ladle.lifecycle import promote

    url = split.url
    damages = {
        "adapter_config.json": (b"{not json", "adapter_config.json is not JSON"),
        "adapter_model.safetensors": (b"torn", "adapter_model.safetensors cannot be read"),
    }
    try:
        for file, (content, words) in damages.items():
            damaged = shutil.copytree(kit["green"][0], tmp_path / file)
            (damaged / file).write_bytes(content)
            version = promote.register(registry, "bot", str(damaged), None, {"ladle.kind": "adapter"})
            synced = httpx.post(f"{url}/v1/adapters/sync", headers=ADMIN, timeout=60)
            assert synced.status_code == 200, synced.text
            problem = synced.json()["problems"]["bot"]
            assert f"bot v{version.version} (challenger)" in problem and words in problem, problem
            ready = httpx.get(f"{url}/ready", timeout=10)
            assert ready.status_code == 503 and words in ready.text
            assert answer_tokens(url, "bot") is not None and answer_tokens(url, "red") is not None
    finally:
        MlflowClient(registry).set_registered_model_alias("bot", "challenger", "2")
        httpx.post(f"{url}/v1/adapters/sync", headers=ADMIN, timeout=60)
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 200


class AdapterTraffic(Clients):
    """Clients sending greedy completions for their models through the front without pause; each outcome kept as
    (model, HTTP status, pinned version header, answer tokens)."""

    def __init__(self, url: str, models: list[str]):
        self.url = url
        super().__init__(models)

    def loop(self, model: str) -> None:
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "logprobs": 0}
        with httpx.Client(timeout=60) as client:
            while not self.stop_flag.is_set():
                try:
                    answer = client.post(f"{self.url}/v1/completions", json=body)
                    tokens = answer.json()["choices"][0]["logprobs"]["tokens"] if answer.status_code == 200 else None
                    self.results.append(
                        (model, answer.status_code, answer.headers.get("x-ladle-adapter-version"), tokens)
                    )
                except httpx.HTTPError as exc:
                    self.results.append((model, f"{type(exc).__name__}: {exc}", None, None))

    def wait(self, n: int) -> None:
        start, deadline = len(self.results), time.monotonic() + 60
        while len(self.results) < start + n:
            assert time.monotonic() < deadline, self.results[-5:]
            time.sleep(0.05)


def test_an_adapters_canary_splits_its_own_traffic_at_the_base_front_and_is_applied_to_it_alone(
    split, registry, kit, merged, tiny_model, tmp_path, monkeypatch
):
    """promote.canary for an adapter: at its base's front, a share of the requests for ``bot`` alone goes to the
    challenger version the same server holds; the front passes it, the registry makes it ``bot``'s champion and the
    server follows, with no failed request and ``red``'s traffic untouched. Then an operator's rollback ends another
    canary of ``bot``, and a challenger the server cannot load is rolled back before it takes any traffic."""
    from ladle.config import build_config
    from ladle.fleet import adapters as fleet
    from ladle.fleet import champion as champions
    from ladle.fleet.canary import pending
    from ladle.lifecycle import promote
    from ladle.lifecycle.copies import base_signature
    from ladle.platform.processes import free_port

    def reference(name):
        return [
            e["token"] for e in finished(submit(merged[name], PROMPTS[0], max_new_tokens=8, logprobs=0)).token_logprobs
        ]

    red, blue = reference("red"), reference("blue")
    assert red != blue
    monkeypatch.setenv("LADLE_HOME", str(tmp_path / "home"))
    promote.promote(registry, "bot", "1", "the champion before the canary")  # whatever earlier tests left
    limits = {"weight": 0.5, "duration_s": 3, "min_requests": 3, "max_latency_ratio": 20}
    sets = ["promote.merge=false", f"serve.front_port={free_port()}", "serve.max_new_tokens=8"]
    cfg = build_config({"base": str(tiny_model), "data": {"path": "ladle://demo-alpaca"}}, sets)
    cfg = cfg.model_copy(update={"promote": cfg.promote.model_copy(update={"canary": CanaryConfig(**limits)})})
    base = fleet.front_name(base_signature(tiny_model))
    front = champions.ensure_front(base, cfg.serving())
    admin = champions.admin_headers(front)
    # The suite's server was started with its own admin key: the one `ladle model serve` keeps for this base.
    write_atomic(tmp_path / "home" / "served" / f"{base}.admin-key", ADMIN_KEY + "\n", mode=0o600)
    # The suite's running server of this base behind the front, as `ladle model serve` of an adapter leaves one.
    body = {"url": split.url, "version": "base", "pid": split.proc.pid, "model_dir": str(tiny_model)}
    assert httpx.put(f"{front['url']}/ladle/upstream", json=body, headers=admin, timeout=30).status_code == 200
    try:
        promote.mark_canary(registry, "bot", "2")
        with AdapterTraffic(front["url"], ["bot", "bot", "bot", "red"]) as traffic:
            traffic.wait(4)
            served = fleet.reconcile(registry, "bot", cfg, promote.champion(registry, "bot"), tiny_model)
            t_done = len(traffic.results)
            traffic.wait(6)
        assert all(status == 200 for _, status, _, _ in traffic.results), traffic.results
        state = served["canary"]
        assert state["status"] == "passed" and served["version"] == "2", state
        assert promote.champion(registry, "bot").version == "2" and pending(registry, "bot", "2") is None
        arms = state["arms"]
        assert arms["challenger"]["requests"] >= 3 and arms["champion"]["requests"] >= 1, arms
        bot = [(pin, tokens) for model, _, pin, tokens in traffic.results[:t_done] if model == "bot"]
        assert {tuple(tokens) for pin, tokens in bot if pin == "2"} == {tuple(blue)}
        assert {tuple(tokens) for pin, tokens in bot if pin == "1"} == {tuple(red)}
        assert arms["challenger"]["requests"] + arms["champion"]["requests"] <= len(bot)  # red's never counted
        assert all(t == red and pin is None for m, _, pin, t in traffic.results if m == "red")
        assert all(t == blue for m, _, _, t in traffic.results[t_done:] if m == "bot")  # the new champion
        assert httpx.get(f"{front['url']}/ladle/canary", params={"adapter": "bot"}, headers=admin).json() == {
            "canary": None
        }

        # An operator's rollback during the next canary of bot: rolled back at the front, applied to bot alone.
        promote.mark_canary(registry, "bot", "1")
        long = cfg.model_copy(
            update={
                "promote": cfg.promote.model_copy(update={"canary": CanaryConfig(duration_s=120, min_requests=10**5)})
            }
        )
        result: dict = {}
        runner = threading.Thread(
            target=lambda: result.update(
                out=fleet.reconcile(registry, "bot", long, promote.champion(registry, "bot"), tiny_model)
            ),
            daemon=True,
        )
        with AdapterTraffic(front["url"], ["bot", "bot"]) as traffic:
            runner.start()
            deadline = time.monotonic() + 60
            while (
                httpx.get(f"{front['url']}/ladle/canary", params={"adapter": "bot"}, headers=admin).json()["canary"]
                is None
            ):
                assert time.monotonic() < deadline and runner.is_alive(), result
                time.sleep(0.1)
            traffic.wait(4)
            assert champions.end_canary_at_front("bot", "x") is None  # no front of its own: its base's has it
            assert fleet.end_canary("bot", "the operator stopped it") == "1"
            runner.join(timeout=60)
            traffic.wait(2)
        assert all(status == 200 for _, status, _, _ in traffic.results), traffic.results
        rolled = result["out"]["canary"]
        assert rolled["status"] == "rolled_back" and rolled["reason"] == "the operator stopped it", rolled
        assert promote.champion(registry, "bot").version == "2" and result["out"]["version"] == "2"
        tags = promote.get_version(registry, "bot", "1").tags
        assert tags["ladle.promotion"] == "not promoted" and "the operator stopped it" in tags["ladle.promotion.reason"]
        assert promote.CHALLENGER not in promote.get_version(registry, "bot", "1").aliases
        assert answer_tokens(front["url"], "bot") == blue

        # A challenger whose weights changed since it was registered never takes traffic.
        copy = shutil.copytree(kit["green"][0], tmp_path / "altered")
        tags = {"ladle.kind": "adapter", "ladle.model_sha256": "0" * 64}  # not its weights' hash
        altered = promote.register(registry, "bot", str(copy), None, tags).version
        promote.mark_canary(registry, "bot", altered)
        unloadable = fleet.reconcile(registry, "bot", cfg, promote.champion(registry, "bot"), tiny_model)["canary"]
        assert unloadable["status"] == "rolled_back" and "could not be loaded" in unloadable["reason"], unloadable
        assert "they changed since it was registered" in unloadable["reason"]
        assert promote.get_version(registry, "bot", altered).tags["ladle.promotion"] == "not promoted"
        assert httpx.get(f"{split.url}/ready", timeout=10).status_code == 200
    finally:
        from ladle.platform.processes import stop_pid

        stop_pid(front["pid"], 20, group=True)


def test_a_forced_tool_call_through_an_adapter_is_one_valid_call_whole_and_streamed(kit, tiny_model, tmp_path):
    """Tools per adapter: the base with Hermes's tool-calling template (the same weights, so the adapters fit it),
    a forced call through adapter ``red``: one call of the named function with arguments its schema accepts."""
    from ladle.serve.server import Settings, create_app
    from tests.serve.running import Running
    from tests.templates import TEMPLATES, assert_one_forced_call, with_template

    hermes = with_template(tiny_model, tmp_path / "hermes", TEMPLATES["hermes"])
    backend = TransformersBackend(str(hermes), max_batch=4)
    catalog = Catalog("tiny", BaseWeights.of(hermes))
    version, _ = catalog.add("red", str(kit["red"][0]))
    backend.add_adapter(version.key, version.info.path, version.info.bytes)
    running = Running(create_app(backend, Settings("tiny", max_new_tokens=16), catalog))
    try:
        assert_one_forced_call(running.url, model="red")
        assert backend.slots.loaded  # it ran on the adapter
    finally:
        running.stop()


def test_a_bad_adapter_is_refused_before_the_base_loads(tiny_model, tmp_path, monkeypatch, capsys):
    """`ladle serve MODEL --adapter NAME=PATH`: a folder that is no LoRA adapter, or a bad name, is one line before
    the base's weights load (checked against the base's safetensors headers), not after."""
    from ladle.serve import __main__ as serve_main
    from ladle.serve.transformers_backend import TransformersBackend

    def loaded(cls, *args, **kwargs):
        raise AssertionError("the base loaded before the adapters were checked")

    monkeypatch.setattr(TransformersBackend, "start", classmethod(loaded))
    monkeypatch.setattr(serve_main, "one_thread_until_fork", lambda: None)  # this process keeps its threads
    argv = ["--model", str(tiny_model), "--backend", "transformers"]
    assert serve_main.main([*argv, "--adapter", f"red={tmp_path}"]) == 2
    assert f"adapter {tmp_path}: not a LoRA adapter folder" in capsys.readouterr().err
    assert serve_main.main([*argv, "--adapter", f"a@b={tmp_path}"]) == 2
    assert "adapter name 'a@b'" in capsys.readouterr().err
    assert serve_main.main([*argv, "--adapter", "nothing"]) == 2
    assert "expected NAME=PATH" in capsys.readouterr().err


def test_a_version_is_found_by_its_label_then_an_alias_then_vN_never_by_order(kit, tiny_model):
    catalog = Catalog("tiny", BaseWeights.of(tiny_model))
    one, _ = catalog.add("bot", str(kit["red"][0]), version="v1")
    two, _ = catalog.add("bot", str(kit["blue"][0]), version="1", aliases=["champion"])
    three, _ = catalog.add("bot", str(kit["green"][0]), version="3", aliases=["v1x"])
    assert catalog.resolve("bot@v1") == one.key  # the label "v1", though "1" would answer to v1 too
    assert catalog.resolve("bot@1") == two.key and catalog.resolve("bot@champion") == two.key
    assert catalog.resolve("bot@v3") == three.key and catalog.resolve("bot@v1x") == three.key


def test_a_base_placed_over_several_devices_gets_each_layers_adapter_and_rows_on_that_layers_device(tmp_path):
    """A base spread over devices (``machine.placement``: layers over every GPU) keeps each layer's adapter
    tensors, row ids and mask on that layer's own device; they all went to the first parameter's. Here the second
    layer sits on the meta device, the CPU's stand-in for a second card: a tensor sent to the first device would
    meet it in one product and fail."""
    from safetensors.torch import save_file

    from ladle.serve.multi_lora import MultiLora

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5, bias=False), torch.nn.Linear(5, 4, bias=False))
    model[1].to("meta")
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["0", "1"]}))
    tensors = {}
    for name, (fan_in, fan_out) in {"0": (6, 5), "1": (5, 4)}.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(2, fan_in)
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(fan_out, 2)
    save_file(tensors, folder / "adapter_model.safetensors")
    group = MultiLora(model)
    group.add("a", folder)
    first, second = group.layers["0"], group.layers["1"]
    assert first.a_cat.device.type == "cpu" and second.a_cat.device.type == "meta" == second.b_cat.device.type
    x = torch.randn(2, 3, 6)
    with group.rows_of(["a", None]):
        out = second(torch.empty(2, 3, 5, device="meta"))  # its mask made on its device, from the rows on the CPU
        expected = (
            x @ model[0].weight.T + ((x @ first.a_cat.T) @ first.b_cat.T) * torch.tensor([1.0, 0.0])[:, None, None]
        )
        torch.testing.assert_close(first(x), expected)
    assert out.device.type == "meta" and out.shape == (2, 3, 4)


def test_an_adapter_with_its_own_head_and_embedding_answers_as_its_merged_model_beside_others(
    kit, merged, tiny_model, tmp_path
):
    """peft's ``modules_to_save`` puts a whole head and input embedding in the adapter (as teams that add chat tokens
    train them; the demo recipe saves both): served beside the base, each such adapter's rows take their head and
    embedding from its own copies while the other rows of the same batch keep the base's, and its greedy answers and
    log-probabilities equal its merged model's. It was refused at deploy, after training."""
    from ladle.lifecycle.merge import merge_adapter

    folder = make_adapter(tiny_model, tmp_path / "ends", 4, ["q_proj", "v_proj"], 9, saved=("lm_head", "embed_tokens"))
    merge_adapter(tiny_model, folder, tmp_path / "ends-merged")
    reference = TransformersBackend(str(tmp_path / "ends-merged"), max_batch=8)
    info = inspect(folder, BaseWeights.of(tiny_model))
    assert info.saved == ("lm_head", "model.embed_tokens")
    backend = TransformersBackend(str(tiny_model), max_batch=8)
    keys = {None: None, "ends": "ends#1", "red": "red#1"}
    backend.add_adapter("ends#1", str(folder), info.bytes)
    backend.add_adapter("red#1", str(kit["red"][0]), inspect(kit["red"][0], BaseWeights.of(tiny_model)).bytes)
    sent = [(name, p, submit(backend, p, keys[name], logprobs=1)) for p in PROMPTS for name in ("ends", None, "red")]
    alone_ends = [(p, submit(backend, p, "ends#1", logprobs=1)) for p in PROMPTS[:2]]  # batches of its rows only
    references = {"ends": reference, None: merged[None], "red": merged["red"]}
    for name, prompt, job in [*sent, *[("ends", p, j) for p, j in alone_ends]]:
        got, alone = finished(job), finished(submit(references[name], prompt, logprobs=1))
        assert got.tokens == alone.tokens, (name, prompt)
        gap = max(
            abs(a["logprob"] - b["logprob"]) for a, b in zip(got.token_logprobs, alone.token_logprobs, strict=True)
        )
        assert gap < 1e-4, (name, prompt, gap)
    base_answer = finished(submit(merged[None], PROMPTS[0])).tokens
    assert finished(submit(reference, PROMPTS[0])).tokens != base_answer, "its own head changes the answer"
    assert set(backend.slots.lora.layers["lm_head"].saved) == {backend.slots.lora.ids["ends#1"]}
    backend.drop_adapter("ends#1")  # unloaded at the next placement: its copies go with it, the base's untouched
    finished(submit(backend, PROMPTS[0], "red#1"))
    assert "ends#1" not in backend.slots.lora.ids and not backend.slots.lora.layers["lm_head"].saved
    assert finished(submit(backend, PROMPTS[0])).tokens == base_answer
