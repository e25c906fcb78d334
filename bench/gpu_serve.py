"""Serving on one GPU, side by side on one model: ladle over DeepSpeed-MII, ladle's transformers backend, and
MII's own offline ``mii.pipeline`` (the engine's ceiling), with offline ``generate`` as the reference.

    python bench/gpu_serve.py --out DIR [--phases model,offline,transformers,mii,pipeline] [--small]

Phases (each bounded by the caller's ``timeout``, each writing its part of DIR/gpu_serve.json as it ends):

- ``model``: a random-init Llama that FastGen accepts (bf16, head_dim 128, ~140M parameters; ``--small``: a
  tiny float32 one for a CPU rehearsal of the transformers phases), with the demo tokenizer.
- ``offline``: transformers' greedy ``generate`` of 4 prompts (the reference answers), and its tokens/s for
  one stream.
- ``transformers`` / ``mii``: ``python -m ladle.serve --backend ...`` started as the deploy stage starts it,
  timed to ``/ready``; greedy answers against the reference, one streamed answer against its whole one,
  sampled requests (``temperature`` 1.0, unseeded; seeded too where the backend takes seeds), then 1, 8 and 32
  clients for ``--load-s`` seconds each (requests/s, tokens/s, p50, errors); SIGTERM, and what of its process
  tree is left.
- ``pipeline``: ``mii.pipeline`` on the same model, offline, at batch 1 and 32 (tokens/s).

The summary prints the issue's goals as ratios of these numbers, measured on the same GPU and model.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPTS = ["Tell me about the sea.", "Add 2 and 3.", "Name three colours.", "Write a haiku about rain."]
NEW_TOKENS = 64


def record(out: Path, phase: str, value) -> None:
    """Add ``phase`` to DIR/gpu_serve.json (read, update, write: a phase cut short keeps the others)."""
    path = out / "gpu_serve.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[phase] = value
    path.write_text(json.dumps(data, indent=2))
    print(f"[{phase}] {json.dumps(value)[:1500]}", flush=True)


def make_model(out: Path, small: bool) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ladle.assets import tiny_model_dir

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    shape = (
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}
        if small
        else {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 12, "num_attention_heads": 8}
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=-(-len(tokenizer) // 64) * 64,  # padded as released models are (FastGen needs a multiple of 8)
        num_key_value_heads=shape["num_attention_heads"],
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    model = LlamaForCausalLM(config).to(torch.float32 if small else torch.bfloat16)
    folder = out / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    record(out, "model", {"params": params, "head_dim": shape["hidden_size"] // shape["num_attention_heads"]})
    return folder


def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def offline(out: Path, folder: Path) -> dict:
    """Greedy references, and one stream's tokens/s through transformers' ``generate`` (EOS ignored)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    answers = {}
    for prompt in PROMPTS:
        ids = torch.tensor([chat_ids(tokenizer, prompt)], device=device)
        with torch.no_grad():
            new = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.pad_token_id)
        answers[prompt] = tokenizer.decode(new[0, ids.shape[1] :], skip_special_tokens=True)
    ids = torch.tensor([chat_ids(tokenizer, PROMPTS[0])], device=device)
    began = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids, do_sample=False, max_new_tokens=256, min_new_tokens=256, pad_token_id=tokenizer.pad_token_id
        )
    if device == "cuda":
        torch.cuda.synchronize()
    result = {"answers": answers, "single_stream_tokens_per_s": round(256 / (time.perf_counter() - began), 1)}
    record(out, "offline", result)
    return result


def post(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def streamed(url: str, body: dict) -> str:
    request = urllib.request.Request(
        url, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    pieces = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            text = line.decode().strip()
            if text.startswith("data: {"):
                delta = json.loads(text[6:])["choices"]
                pieces += [delta[0]["delta"].get("content") or ""] if delta else []
    return "".join(pieces)


def load(url: str, clients: int, seconds: float) -> dict:
    """``clients`` threads sending greedy chat requests back to back for ``seconds``."""
    latencies, tokens, errors, lock = [], [0], [0], threading.Lock()
    stop = time.monotonic() + seconds

    def client(i: int) -> None:
        while time.monotonic() < stop:
            began = time.perf_counter()
            body = {
                "messages": [{"role": "user", "content": PROMPTS[i % 4]}],
                "max_tokens": NEW_TOKENS,
                "temperature": 0,
            }
            try:
                done = post(f"{url}/v1/chat/completions", body)
            except (urllib.error.URLError, OSError, ValueError):
                with lock:
                    errors[0] += 1
                continue
            with lock:
                latencies.append(time.perf_counter() - began)
                tokens[0] += done["usage"]["completion_tokens"]

    began = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.monotonic() - began
    return {
        "clients": clients,
        "requests_per_s": round(len(latencies) / wall, 2),
        "tokens_per_s": round(tokens[0] / wall, 1),
        "p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "errors": errors[0],
    }


def descendants(pid: int) -> list[str]:
    import psutil

    try:
        return [" ".join(p.cmdline())[:120] for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def serve(out: Path, folder: Path, backend: str, reference: dict, load_s: float) -> None:
    """One backend through ladle's server: start, correctness, load, stop, orphans."""
    import psutil

    from ladle.platform.processes import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (out / f"server-{backend}.log").open("w")
    argv = [sys.executable, "-m", "ladle.serve", "--model", str(folder), "--name", "m", "--backend", backend]
    argv += ["--port", str(port), "--max-new-tokens", str(NEW_TOKENS)]
    argv += ["--option", "tensor_parallel=1", "--option", "start_timeout_s=400"] if backend == "mii" else []
    began = time.monotonic()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    result: dict = {}
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/ready", timeout=2)
                break
            except (urllib.error.URLError, OSError):
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited {proc.returncode}: {(out / f'server-{backend}.log').read_text()[-2000:]}"
                    ) from None
                time.sleep(0.5)
        result["start_s"] = round(time.monotonic() - began, 1)
        chat = f"{url}/v1/chat/completions"
        greedy = {
            p: post(chat, {"messages": [{"role": "user", "content": p}], "temperature": 0})["choices"][0]["message"][
                "content"
            ]
            for p in PROMPTS
        }
        result["greedy_equal"] = sum(greedy[p] == reference[p] for p in PROMPTS)
        result["greedy_mismatch"] = {
            p: [greedy[p][:80], reference[p][:80]] for p in PROMPTS if greedy[p] != reference[p]
        }
        result["stream_equal"] = (
            streamed(chat, {"messages": [{"role": "user", "content": PROMPTS[0]}], "temperature": 0})
            == greedy[PROMPTS[0]]
        )
        sampled = [{"messages": [{"role": "user", "content": p}], "temperature": 1.0} for p in PROMPTS * 2]
        if backend == "transformers":
            sampled += [{**s, "seed": 7} for s in sampled[:4]]
        with ThreadPoolExecutor(len(sampled)) as pool:
            codes = list(pool.map(lambda b: status_of(chat, b), sampled))
        result["sampled_200"] = f"{codes.count(200)}/{len(codes)}"
        if backend == "transformers":
            result["structured"] = structured_on_device(chat)
            top = post(chat, {**sampled[0], "temperature": 0, "logprobs": True, "top_logprobs": 3, "max_tokens": 8})
            entries = top["choices"][0]["logprobs"]["content"]
            result["logprobs_greedy_is_top"] = all(
                e["logprob"] >= e["top_logprobs"][0]["logprob"] - 1e-3 for e in entries
            )
        result["load"] = [load(url, clients, load_s) for clients in (1, 8, 32)]
    except Exception as exc:  # recorded, and the server still stopped below
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        tree = (
            [proc.pid, *[p.pid for p in psutil.Process(proc.pid).children(recursive=True)]]
            if proc.poll() is None
            else []
        )
        os.killpg(proc.pid, signal.SIGTERM) if proc.poll() is None else None
        try:
            result["exit"] = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            result["exit"] = "killed after 60 s"
        time.sleep(2)
        result["orphans"] = [
            pid for pid in tree if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        ]
        log.close()
        result["log_tail"] = (out / f"server-{backend}.log").read_text()[-600:]
        record(out, backend, result)


SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["colour", "count"],
    "additionalProperties": False,
}


def structured_on_device(chat: str) -> dict:
    """Half of 16 concurrent sampled requests under a JSON schema (token masks on the device's logits), half free:
    how many constrained answers parse and validate, and whether every request answered."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    bodies = [
        {
            "messages": [{"role": "user", "content": p}],
            "temperature": 1.0,
            **({"response_format": fmt} if i % 2 else {}),
        }
        for i, p in enumerate(PROMPTS * 4)
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: post(chat, b), bodies))
    valid = 0
    for body, reply in zip(bodies, replies, strict=True):
        if "response_format" in body:
            try:
                jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    return {"constrained_valid": f"{valid}/{len(bodies) // 2}", "answered": f"{len(replies)}/{len(bodies)}"}


def status_of(url: str, body: dict) -> int:
    try:
        post(url, body)
        return 200
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, OSError):
        return 0


def pipeline(out: Path, folder: Path) -> None:
    """``mii.pipeline`` offline on the same model: batch 1 and batch 32, tokens/s."""
    from transformers import AutoTokenizer

    from ladle.machine import cuda_arch

    os.environ.update(cuda_arch.fixed_env()[0])  # the image's 9.0a, which DeepSpeed's op builder cannot parse
    import mii

    tokenizer = AutoTokenizer.from_pretrained(folder)
    pipe = mii.pipeline(str(folder))
    texts = [tokenizer.decode(chat_ids(tokenizer, p)) for p in PROMPTS]
    result = {"greedy_first": pipe([texts[0]], max_new_tokens=NEW_TOKENS, do_sample=False)[0].generated_text[:80]}
    for batch in (1, 32):
        prompts = (texts * 8)[:batch]
        began = time.perf_counter()
        responses = pipe(prompts, max_new_tokens=256, min_new_tokens=256, do_sample=False)
        result[f"batch_{batch}_tokens_per_s"] = round(
            sum(r.generated_length for r in responses) / (time.perf_counter() - began), 1
        )
    record(out, "pipeline", result)
    pipe.destroy()


def summary(out: Path) -> None:
    data = json.loads((out / "gpu_serve.json").read_text())
    by = {k: {row["clients"]: row for row in data.get(k, {}).get("load", [])} for k in ("mii", "transformers")}
    lines = []
    if 32 in by["mii"] and "pipeline" in data:
        ratio = by["mii"][32]["tokens_per_s"] / data["pipeline"]["batch_32_tokens_per_s"]
        lines.append(f"ladle-MII at 32 clients / mii.pipeline batch 32: {ratio:.2f}x (goal >= 0.6)")
    for clients in (8, 32):
        if clients in by["mii"] and clients in by["transformers"]:
            ratio = by["mii"][clients]["tokens_per_s"] / by["transformers"][clients]["tokens_per_s"]
            lines.append(f"ladle-MII / ladle-transformers at {clients} clients: {ratio:.2f}x (goal >= 3)")
    if 1 in by["transformers"] and "offline" in data:
        ratio = by["transformers"][1]["tokens_per_s"] / data["offline"]["single_stream_tokens_per_s"]
        lines.append(f"ladle-transformers 1 client / offline generate: {ratio:.2f}x (goal >= 1.0)")
    for backend in ("transformers", "mii"):
        if backend in data:
            row = data[backend]
            errors = sum(r["errors"] for r in row.get("load", []))
            lines.append(
                f"{backend}: start {row.get('start_s')} s, greedy {row.get('greedy_equal')}/4, stream "
                f"{row.get('stream_equal')}, sampled {row.get('sampled_200')}, load errors {errors}, "
                f"orphans {row.get('orphans')}, exit {row.get('exit')}{', ERROR ' + row['error'] if 'error' in row else ''}"
            )
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "gpu-serve")
    parser.add_argument("--phases", default="model,offline,transformers,mii,pipeline")
    parser.add_argument("--small", action="store_true", help="a tiny float32 model (a CPU rehearsal)")
    parser.add_argument("--load-s", type=float, default=12.0, help="seconds of load per client count")
    parser.add_argument("--summary", action="store_true", help="only print the summary of --out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.summary:
        summary(args.out)
        return
    phases = args.phases.split(",")
    folder = make_model(args.out, args.small) if "model" in phases else args.out / "model"
    reference = offline(args.out, folder)["answers"] if "offline" in phases else {}
    if not reference and (args.out / "gpu_serve.json").is_file():
        reference = json.loads((args.out / "gpu_serve.json").read_text()).get("offline", {}).get("answers", {})
    for backend in ("transformers", "mii"):
        if backend in phases:
            serve(args.out, folder, backend, reference, args.load_s)
    if "pipeline" in phases:
        pipeline(args.out, folder)


if __name__ == "__main__":
    main()
