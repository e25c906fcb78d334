"""Many LoRA adapters served unmerged on one base: which adapters a server knows (``Catalog``, in the API
process), whether an adapter folder fits the base (``inspect``), and which adapters the engine holds in memory
(``Slots``, in the engine process).

Requests for different adapters share the engine's batch and its KV cache: the loaded adapters live inside the
base's linear layers as one grouped LoRA product (``ladle.serve.multi_lora``), and each forward says which adapter
each row runs on, so every layer adds each row's own adapter's ``B(s A x)`` and nothing else. Chosen over peft's
mixed-adapter batches (``adapter_names``), which compute the same thing with a gather, two matmuls and a scatter-add per adapter present per layer and a forward hook per LoRA module per call: with 8
adapters of SmolLM2-135M on a CPU and 32 clients, peft's way served 0.32x the merged model's tokens/s and the
grouped product 0.53x (0.81x with every answer run to the same length; ``bench/adapters.py``).

Naming: an adapter is registered under a ``name`` (what the OpenAI ``model`` field says) and a ``version`` label,
with optional ``aliases`` (``champion``, ``challenger``); ``name`` alone is its default version, ``name@3`` or
``name@challenger`` addresses one version. The engine knows each registered version by a ``key`` of its own
(``a1``, ``a2``, ...), so a new version of ``name`` loads beside the old one, the rows running on the old one
finish on it, and the old one is unloaded once nothing addresses it and no row runs on it: a swap without a
failed request.

Memory: the engine holds at most ``max_loaded`` adapters and ``max_mb`` of their weights, evicting the least
recently used adapter that no running row uses; an adapter that cannot be placed now (every slot holds an adapter
whose rows are running) waits for a slot like a request waits for a batch row, and past the queue's deadline gets
503 with ``Retry-After``, never an out-of-memory.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ladle.errors import LadleError

RECORD = "ladle-base.json"
"""Written beside a trained adapter: the signature of the base it was trained on (``lineage.base_signature``)."""

MAX_VERSIONS = 256
"""Adapter versions one server answers for (registered, loaded or not): the catalog and ``/v1/models`` stay bounded
whatever admin requests arrive; what is loaded at once is ``serve.adapters.max_loaded``."""

PINNED_HEADER = "x-ladle-adapter-version"
"""Set by ladle's front during an adapter's canary: the version a request for the adapter's bare name is answered
by (the challenger for the canary's share, the champion it is measured against for the rest)."""

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def write_record(adapter_dir: Path, base_dir: Path, base: str) -> None:
    """Record in ``adapter_dir`` which base it was trained on: its signature and how the config named it."""
    from ladle.lifecycle.copies import base_signature

    record = {"base_signature": base_signature(Path(base_dir)), "base": base}
    (Path(adapter_dir) / RECORD).write_text(json.dumps(record, indent=1), encoding="utf-8")


@dataclass(frozen=True)
class BaseWeights:
    """What an adapter is checked against: the base's signature and each weight's shape (safetensors headers)."""

    folder: str
    signature: str
    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, folder: str | Path) -> BaseWeights:
        from safetensors import safe_open

        from ladle.lifecycle.copies import base_signature

        shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no iteration
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        return cls(str(folder), base_signature(Path(folder)), shapes)


@dataclass(frozen=True)
class AdapterInfo:
    path: str
    rank: int
    targets: tuple[str, ...]
    bytes: int
    base_signature: str | None  # None: trained elsewhere, no record of its base (its shapes were checked)
    saved: tuple[str, ...] = ()  # modules it replaces whole (peft's modules_to_save: a head, an embedding)


def inspect(path: str | Path, base: BaseWeights) -> AdapterInfo:
    """Whether the LoRA adapter at ``path`` can be served on ``base`` in a mixed batch, and what it holds.

    Raises:
        LadleError: not a peft LoRA folder, trained on another base (both signatures named), a DoRA adapter, or a tensor whose module or shape the base does not have.
    """
    from safetensors import safe_open

    folder = Path(path)
    config_file, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise LadleError(
            f"adapter {path}: not a LoRA adapter folder (it needs adapter_config.json and adapter_model.safetensors, "
            "as peft's save_pretrained writes them)."
        )
    try:
        settings = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise LadleError(f"adapter {path}: adapter_config.json is not JSON ({exc}). Save the adapter again.") from None
    if not isinstance(settings, dict):
        raise LadleError(f"adapter {path}: adapter_config.json is not a JSON object. Save the adapter again.")
    if settings.get("peft_type") != "LORA":
        raise LadleError(
            f"adapter {path}: peft_type {settings.get('peft_type')!r}; only LoRA adapters share a batch. Merge it "
            "and serve it as a model of its own (promote.merge: true)."
        )
    for key, why in (
        ("fan_in_fan_out", "adapts Conv1D layers (fan_in_fan_out)"),
        ("alpha_pattern", "scales modules by an alpha_pattern"),
    ):
        if settings.get(key):
            raise LadleError(
                f"adapter {path}: {why}, which the batched adapter product does not hold. Merge it and serve it as "
                "a model of its own (promote.merge: true)."
            )
    if settings.get("use_dora"):
        raise LadleError(
            f"adapter {path}: a DoRA adapter (use_dora: true), whose update depends on the merged weight's norm and "
            "so cannot share the batched adapter product. Merge it and serve it as a model of its own (promote.merge: true)."
        )
    recorded = None
    if (folder / RECORD).is_file():
        recorded = json.loads((folder / RECORD).read_text(encoding="utf-8")).get("base_signature")
        if recorded and recorded != base.signature:
            raise LadleError(
                f"adapter {path}: trained on a base with signature {recorded[:16]}, but this server's base "
                f"{base.folder} has signature {base.signature[:16]}. Serve it on the base it was trained on."
            )
    from safetensors import SafetensorError

    try:
        return described(folder, path, base, settings, recorded, safe_open(weights, framework="pt"))
    except (OSError, SafetensorError) as exc:  # a torn or corrupt file
        raise LadleError(f"adapter {path}: adapter_model.safetensors cannot be read ({exc}). Save it again.") from None


def described(folder: Path, path, base: BaseWeights, settings: dict, recorded, opened) -> AdapterInfo:
    """``inspect``'s check of the weights file's tensors (``opened``: its ``safe_open`` handle)."""
    targets: set[str] = set()
    saved: set[str] = set()
    ranks: dict[str, dict[str, int]] = {}  # module -> {"A": rank, "B": rank}
    with opened as handle:
        for key in handle.keys():  # noqa: SIM118 - safe_open has no iteration
            name = key.removeprefix("base_model.model.")
            shape = tuple(handle.get_slice(key).get_shape())
            if name.endswith((".lora_A.bias", ".lora_B.bias")):  # peft's lora_bias: a bias beside lora_B
                raise LadleError(
                    f"adapter {path}: holds {name}, a bias trained beside its LoRA (lora_bias: true), which the "
                    "batched adapter product does not hold. Merge it and serve it as a model of its own "
                    "(promote.merge: true)."
                )
            if ".lora_A." in name or ".lora_B." in name:
                module = name.split(".lora_")[0]
                ranks.setdefault(module, {})[name.split(".lora_")[1][0]] = shape[0] if ".lora_A." in name else shape[-1]
                target = base.shapes.get(module + ".weight")
                if target is None:
                    raise LadleError(
                        f"adapter {path}: adapts {module}, which the base {base.folder} does not have (its "
                        "target_modules name layers of another architecture)."
                    )
                rows, cols = target[0], target[-1]
                fits = shape[-1] == cols if ".lora_A." in name else shape[0] == rows
                if len(target) != 2 or not fits:
                    raise LadleError(
                        f"adapter {path}: {name} has shape {list(shape)}, which does not fit {module} of the base "
                        f"(shape {list(target)}): it was trained on another base."
                    )
                targets.add(module.rsplit(".", 1)[-1])
            elif ".lora_" not in name and name.endswith((".weight", ".bias")):  # modules_to_save: a whole module
                saved.add(checked_saved(path, base, name, shape))
            else:  # an embedding's LoRA (lora_embedding_A/B), or a tensor peft does not write
                raise LadleError(
                    f"adapter {path}: holds {name}, which is neither a LoRA weight of a linear layer nor a module "
                    "saved whole (modules_to_save): the batched adapter product holds those only. Merge it and "
                    "serve it as a model of its own (promote.merge: true)."
                )
    if not targets:
        raise LadleError(f"adapter {path}: holds no LoRA weights.")
    for module, halves in ranks.items():
        if len(set(halves.values())) != 1 or set(halves) != {"A", "B"}:
            raise LadleError(
                f"adapter {path}: {module} has LoRA ranks {halves} (A's rows and B's columns must be one rank, "
                "both present): the file is damaged or not peft's. Save the adapter again."
            )
    size = sum(file.stat().st_size for file in folder.glob("adapter_model.*"))
    return AdapterInfo(
        str(folder), int(settings.get("r", 0)), tuple(sorted(targets)), size, recorded, tuple(sorted(saved))
    )


SAVED_MODULES = ("lm_head", "embed_tokens")
"""The modules an adapter may replace whole when served unmerged (peft's ``modules_to_save``): the output head and
the input embedding, a copy per adapter chosen per row (``ladle.serve.multi_lora``). Teams that add chat tokens
train both; any other module saved whole is served merged."""


def checked_saved(path, base: BaseWeights, name: str, shape: tuple[int, ...]) -> str:
    """The module that ``name`` (a tensor saved whole by ``modules_to_save``) replaces, checked against the base.

    Raises:
        LadleError: a module other than the head or the input embedding, or a shape the base's does not have (a
            vocabulary resized for added tokens).
    """
    module, _, part = name.rpartition(".")
    if module.rsplit(".", 1)[-1] not in SAVED_MODULES:
        raise LadleError(
            f"adapter {path}: holds {name}, a module saved whole (modules_to_save) that is not the output head or "
            f"the input embedding ({', '.join(SAVED_MODULES)}): a served adapter replaces only those per request. "
            "Merge it and serve it as a model of its own (promote.merge: true)."
        )
    known = base.shapes.get(name)
    if known is None and module.endswith("lm_head") and part == "weight":  # a tied head: the embedding's weight
        known = next((v for k, v in base.shapes.items() if k.endswith("embed_tokens.weight")), None)
    if known is None or tuple(known) != tuple(shape):
        raise LadleError(
            f"adapter {path}: {name} has shape {list(shape)}, where the base {base.folder} has "
            f"{list(known) if known else 'no such tensor'}: it was trained on another base, or with a vocabulary "
            "resized for added tokens, which a base's server cannot share. Merge it (promote.merge: true)."
        )
    return module


@dataclass
class Version:
    key: str
    label: str
    info: AdapterInfo
    aliases: set[str] = field(default_factory=set)


class Catalog:
    """The adapters a server answers for, by name, in the API process (thread-safe: the admin routes and the
    completion routes read and change it from the event loop and its threads)."""

    def __init__(self, base_name: str, base: BaseWeights | None):
        self.base_name, self.base = base_name, base
        self.lock = threading.Lock()
        self.names: dict[str, dict[str, Version]] = {}  # name -> label -> version
        self.default: dict[str, str] = {}  # name -> label of the version ``name`` alone addresses
        self.problems: dict[str, str] = {}  # name -> why a version the registry names is not served (``/ready``)
        self.keys = (f"a{n}" for n in itertools.count(1))

    def __bool__(self) -> bool:
        return bool(self.names)

    def check_name(self, name: str) -> None:
        """Raises: LadleError: the backend serves no adapters, or ``name`` cannot name one."""
        if self.base is None:
            raise LadleError("this server's backend does not serve adapters (serve.backend = transformers does).")
        if not NAME.match(name) or "@" in name or name == self.base_name:
            raise LadleError(
                f"adapter name {name!r}: must be 1-128 characters of letters, digits, '.', '_', '-', '/', must not "
                f"contain '@' and must differ from the base's name {self.base_name!r}."
            )

    def add(
        self,
        name: str,
        path: str,
        version: str = "1",
        aliases: list[str] | None = None,
        default: bool = True,
        engine: Callable[[Version], None] | None = None,
    ) -> tuple[Version, list[str]]:
        """Register version ``version`` of adapter ``name`` from ``path`` (checked against the base first).
        Returns the new version and the keys that no name addresses any more (the engine drops them).
        ``engine(version)``: tells the engine of the new key before any name resolves to it (the backend's
        ``add_adapter``), so no request reaches the engine with a key it does not know.

        Raises:
            LadleError: a bad name, version or alias, or an adapter that does not fit the base (``inspect``).
        """
        self.check_name(name)
        for label in [version, *(aliases or [])]:
            if not LABEL.match(label):
                raise LadleError(
                    f"adapter {name}: version or alias {label!r} must be 1-64 letters, digits, '.', '_', '-'."
                )
        info = inspect(path, self.base)
        with self.lock:
            held = sum(len(v) for v in self.names.values()) - (version in self.names.get(name, {}))
            if held >= MAX_VERSIONS:
                raise LadleError(
                    f"adapter {name}@{version}: this server already answers for {held} adapter versions, its most "
                    f"(MAX_VERSIONS = {MAX_VERSIONS}); remove some first (DELETE /v1/adapters/NAME?version=V)."
                )
            added = Version(next(self.keys), version, info, set(aliases or []))
            if engine is not None:
                engine(added)
            versions = self.names.setdefault(name, {})
            replaced = versions.pop(version, None)
            for other in versions.values():  # an alias names one version at a time
                other.aliases -= added.aliases
            versions[version] = added
            if default or name not in self.default or self.default[name] not in versions:
                self.default[name] = version
            return added, [replaced.key] if replaced else []

    def remove(self, name: str, version: str | None = None) -> list[str]:
        """Forget ``name`` (every version, or one); returns the keys to drop.

        Raises:
            LadleError: no such adapter or version.
        """
        with self.lock:
            versions = self.names.get(name)
            if versions is None or (version is not None and version not in versions):
                raise LadleError(f"adapter {name}{'@' + version if version else ''}: not served here.")
            gone = list(versions.values()) if version is None else [versions.pop(version)]
            if version is None or not versions:
                self.names.pop(name, None)
                self.default.pop(name, None)
            elif self.default[name] == version:
                self.default[name] = next(iter(versions))
            return [v.key for v in gone]

    def labels(self, name: str) -> dict[str, set[str]]:
        """Each registered version of ``name`` and its aliases (empty when ``name`` is not served)."""
        with self.lock:
            return {label: set(v.aliases) for label, v in self.names.get(name, {}).items()}

    def relabel(self, name: str, version: str, aliases: set[str], default: bool) -> None:
        """Give a registered version other aliases (and make it ``name``'s default), without loading it again."""
        with self.lock:
            versions = self.names[name]
            for other in versions.values():
                other.aliases -= aliases
            versions[version].aliases = set(aliases)
            if default:
                self.default[name] = version

    def named(self, key: str) -> tuple[str, str] | None:
        """The adapter name and version label of engine key ``key``; None when no version has it (any more)."""
        with self.lock:
            for name, versions in self.names.items():
                for version in versions.values():
                    if version.key == key:
                        return name, version.label
        return None

    def resolve(self, model: str | None) -> str | None:
        """The engine key that the OpenAI ``model`` field addresses; None for the base.

        Raises:
            KeyError: naming nothing served here (the route answers OpenAI's 404).
        """
        if model in (None, self.base_name):
            return None
        name, _, label = model.partition("@")
        with self.lock:
            versions = self.names.get(name)
            if versions is None:
                raise KeyError(model)
            if not label:
                return versions[self.default[name]].key
            # A version's own label first, then an alias, then ``vN`` for version N: never by the order they came.
            if label in versions:
                return versions[label].key
            aliased = next((v for v in versions.values() if label in v.aliases), None)
            if aliased is not None:
                return aliased.key
            if label.startswith("v") and label[1:] in versions:
                return versions[label[1:]].key
        raise KeyError(model)

    def listing(self) -> list[dict]:
        """Every addressable model id, the base first: what ``/v1/models`` lists."""
        entries = [{"id": self.base_name, "object": "model", "created": 0, "owned_by": "ladle"}]
        with self.lock:
            for name, versions in sorted(self.names.items()):
                default = versions[self.default[name]]
                entries.append(self.entry(name, default))
                for version in versions.values():
                    for label in sorted({version.label, *version.aliases}):
                        entries.append(self.entry(f"{name}@{label}", version))
        return entries

    def entry(self, model_id: str, version: Version) -> dict:
        return {
            "id": model_id,
            "object": "model",
            "created": 0,
            "owned_by": "ladle",
            "parent": self.base_name,
            "version": version.label,
            "aliases": sorted(version.aliases),
            "rank": version.info.rank,
        }

    def described(self) -> list[dict]:
        """Each adapter with its versions: ``GET /v1/adapters``."""
        with self.lock:
            return [
                {
                    "name": name,
                    "default": self.default[name],
                    "versions": [
                        {
                            "version": v.label,
                            "aliases": sorted(v.aliases),
                            "path": v.info.path,
                            "rank": v.info.rank,
                            "targets": list(v.info.targets),
                            "bytes": v.info.bytes,
                            "base_signature": v.info.base_signature,
                        }
                        for v in versions.values()
                    ],
                }
                for name, versions in sorted(self.names.items())
            ]


class Slots:
    """The adapters loaded in the engine's model (engine thread only, but ``register``/``forget``, which any
    thread may call): at most ``max_loaded`` and ``max_mb`` of weights, least recently used evicted first. Loaded
    adapters run as one grouped LoRA product (``ladle.serve.multi_lora``)."""

    def __init__(self, model, max_loaded: int = 8, max_mb: float = 0.0):
        from ladle.serve.multi_lora import MultiLora

        self.base = model
        self.lora: MultiLora | None = None  # made on the first load: a model that serves none is left untouched
        self.make = lambda: MultiLora(model)
        self.max_loaded, self.max_bytes = max_loaded, int(max_mb * 2**20)
        self.known: dict[str, tuple[str, int]] = {}  # key -> (folder, bytes)
        # Dropped keys whose requests may still wait in the queue (they were resolved before the drop): placeable
        # until no waiting or running row names them, so a swap fails none of them.
        self.retired: dict[str, tuple[str, int]] = {}
        self.loaded: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self.lock = threading.Lock()
        self.loads = 0

    def register(self, key: str, folder: str, size: int) -> None:
        with self.lock:
            self.known[key] = (folder, size)

    def forget(self, key: str) -> None:
        with self.lock:
            entry = self.known.pop(key, None)
            if entry is not None:
                self.retired[key] = entry

    def rows_of(self, keys: list[str | None]):
        """A context in which each row of a forward runs on its adapter (None: the base)."""
        if self.lora is None or not self.loaded:
            return contextlib.nullcontext()
        return self.lora.rows_of(keys)

    def place(self, key: str, busy: set[str]) -> bool:
        """Make ``key`` loaded, evicting least recently used adapters outside ``busy``; False when it cannot be
        placed now (the budget is held by adapters that running rows use).

        Raises:
            LadleError: ``key`` is not registered (any more), or its folder does not load.
        """
        if key in self.loaded:
            self.loaded.move_to_end(key)
            return True
        with self.lock:
            entry = self.known.get(key) or self.retired.get(key)
        if entry is None:
            raise LadleError(f"adapter {key} is no longer served here (a newer version replaced it); retry.")
        folder, size = entry
        if self.max_bytes and size > self.max_bytes:
            raise LadleError(f"adapter {folder}: {size / 2**20:.1f} MiB alone exceeds serve.adapters.max_mb.")
        self.sweep(busy)
        while len(self.loaded) >= self.max_loaded or (
            self.max_bytes and sum(self.loaded.values()) + size > self.max_bytes
        ):
            victim = next((k for k in self.loaded if k not in busy), None)
            if victim is None:
                return False
            self.unload(victim)
        self.load(key, folder, size)
        return True

    def sweep(self, busy: set[str], waiting: set[str] | None = None) -> None:
        """Unload what is loaded but no longer registered and used by no running row; forget a dropped key once
        no waiting row names it either (``waiting``: None when unknown, and then none is forgotten)."""
        with self.lock:
            if waiting is not None:
                for key in [k for k in self.retired if k not in busy and k not in waiting]:
                    del self.retired[key]
            if all(k in self.known for k in self.loaded):
                return
            stale = [k for k in self.loaded if k not in self.known and k not in busy]
        for key in stale:
            self.unload(key)

    def load(self, key: str, folder: str, size: int) -> None:
        if self.lora is None:
            self.lora = self.make()
        try:
            self.lora.add(key, folder)
        except Exception as exc:  # noqa: BLE001 - the folder changed since it was checked: this adapter fails alone
            self.lora.remove(key)
            raise LadleError(f"adapter {folder} did not load: {type(exc).__name__}: {exc}") from None
        self.loaded[key] = size
        self.loads += 1

    def unload(self, key: str) -> None:
        self.loaded.pop(key, None)
        self.lora.remove(key)
